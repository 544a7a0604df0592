"""One trainer step's parameter gradient is the gradient of the GRPO loss it claims.

The trainer's rollout (2 prompts × 4 sampled responses of different lengths, rewards, reference
log-probs) is kept; the policy is then moved (as after earlier updates: ratios ≠ 1, clipping active);
the trainer's update (exact prompt gradients; a row's responses replayed one at a time, or 3 at a time:
`replay_batch`) is compared with
(a) a plain batched GRPO loss written here from TRL's documented definitions over full-sequence
    forwards of [prompt + response], and
(b) TRL 1.16's own `GRPOTrainer._compute_loss` fed the same full-sequence log-probs,
each within `FLOOR_FACTOR` × the reference's own float32 rounding (its gradient against a float64 copy's).
"""

import copy

import pytest
import torch

from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

from ..conftest import rel_err
from ..test_equivalence import FLOOR_FACTOR
from ..trl_oracle import trl_config, trl_loss

EPS, BETA, ENT = 0.2, 0.1, 0.01


def _trainer(tmp_path, loss_type, **kw):
    cfg = TrainConfig(**kw, **dict(model="llama", output_dir=str(tmp_path / loss_type), prompt_length=20,
                      task_options={"num_pairs": 4, "num_values": 8}, num_steps=1, num_generations=4,
                      prompts_per_step=2, max_completion_length=4, restrict_to_answer_tokens=True, lora=True,
                      beta=BETA, epsilon=EPS, loss_type=loss_type, prompt_grad="exact", temperature=0.9,
                      entropy_coef=ENT, progress=False, threads=1, seed=3))
    return Trainer(cfg, reward_funcs=[_token_sum_reward])


def _token_sum_reward(prompts, completions, completion_ids, **kw):
    """A reward that varies within a group (an untrained model rarely gets the task's answer)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def _full_sequence(model, rollout, temperature):
    """Per-token log-probs and entropies `[N, L]` of every response from one forward of [prompt + response],
    padded with zeros, and the mask `[N, L]`."""
    lps, ents, masks = [], [], []
    length = max(r.tokens.numel() for r in rollout.responses)
    for g in rollout.groups:
        for r in g.responses:
            seq = torch.cat([g.prompt_ids, r.tokens])
            logits = model(input_ids=seq[None]).logits[0, g.prompt_ids.numel() - 1 : -1]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
            logp = torch.log_softmax(logits, -1)
            pad = length - r.tokens.numel()
            lps.append(torch.nn.functional.pad(logp.gather(-1, r.tokens[:, None])[:, 0], (0, pad)))
            ents.append(torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (0, pad)))
            masks.append(torch.nn.functional.pad(torch.ones(r.tokens.numel(), dtype=logp.dtype), (0, pad)))
    return torch.stack(lps), torch.stack(ents), torch.stack(masks)


def _assert_within_floor(got, want, floor, whole_floor):
    """Each parameter's gradient within `FLOOR_FACTOR` × the reference's own rounding for it (`floor`), one whose floor
    is below 1e-3 of the largest held at that scale instead (as `conftest.assert_grads_close`: a gradient that
    cancels carries the rounding of the terms that cancelled); the concatenation within `FLOOR_FACTOR` × `whole_floor`
    relative."""
    scale = max(floor)
    for a, b, f in zip(got, want, floor):
        assert (a - b).norm().item() <= FLOOR_FACTOR * max(f, 1e-3 * scale)
    err = rel_err(torch.cat([a.flatten() for a in got]), torch.cat([b.flatten() for b in want]))
    assert err <= FLOOR_FACTOR * whole_floor, (err, whole_floor)


def _padded(rows, length):
    return torch.stack([torch.nn.functional.pad(x, (0, length - x.numel())) for x in rows])


def _plain_grpo_loss(loss_type, logp, ent, mask, old, ref, adv, max_len):
    """TRL's documented GRPO loss (docs: "Loss types", "Computing the KL"), one batch, no accumulation."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
    per_token = per_token + BETA * ratio * (torch.exp(ref - logp) - (ref - logp) - 1)  # bias-corrected k3
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum()
    else:  # dr_grpo
        loss = (per_token * mask).sum() / (mask.shape[0] * max_len)
    return loss - ENT * (ent * mask).sum() / mask.sum()


@pytest.mark.parametrize("replay_batch", [1, 3], ids=["serial", "batch-3"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_trainer_step_gradient_equals_batched_grpo_and_trl(tmp_path, monkeypatch, loss_type, replay_batch):
    import longstraw.replay.order as order

    batches = []
    inner = order.replay_batch

    def spy(state, responses, *a, **kw):
        batches.append(len(responses))
        return inner(state, responses, *a, **kw)

    monkeypatch.setattr(order, "replay_batch", spy)
    trainer = _trainer(tmp_path, loss_type, replay_batch=replay_batch)
    model, params = trainer.model, trainer.params
    rollout = trainer.rollout(0)
    lengths = [r.tokens.numel() for r in rollout.responses]
    assert len(set(lengths)) > 1, lengths  # responses of different lengths
    with torch.no_grad():  # the policy moves after sampling: ratios ≠ 1
        g = torch.Generator().manual_seed(0)
        for p in params:
            p.add_(0.1 * torch.randn(p.shape, generator=g))

    for p in params:
        p.grad = None
    metrics = trainer.update(rollout)
    got = [p.grad.clone() for p in params]
    assert batches == ([] if replay_batch == 1 else [2, 2, 2, 2])  # G = 4 responses a row, k = 3: two of 2

    # independent inputs: advantages from the raw rewards, reference log-probs from the model, adapters off (the
    # advantages by TRL's formula: the group's std + 1e-4, a constant of the formula, not a tolerance)
    rewards = rollout.rewards.view(2, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)
    assert adv.abs().sum() > 0
    length = max(lengths)
    old = _padded([r.old_logprobs for r in rollout.responses], length)
    with torch.no_grad(), model.disable_adapter():
        ref = _full_sequence(model, rollout, 0.9)[0]

    def grads(loss_fn):
        for p in params:
            p.grad = None
        loss_fn().backward()
        return [p.grad.clone() for p in params]

    def plain():
        logp, ent, mask = _full_sequence(model, rollout, 0.9)
        ratio = torch.exp(logp - old)
        clipped = ((ratio < 1 - EPS) & (adv[:, None] < 0)) | ((ratio > 1 + EPS) & (adv[:, None] > 0))
        assert int((clipped * mask).sum()) > 0  # clipping is active
        # TRL's clip metrics (its `clip_ratio/low_mean`, `high_mean`, `region_mean`: clipped tokens over the tokens)
        low = ((ratio < 1 - EPS) & (adv[:, None] < 0)).float()
        high = ((ratio > 1 + EPS) & (adv[:, None] > 0)).float()
        seen.update({"clip_ratio/low_mean": int((low * mask).sum()), "clip_ratio/high_mean": int((high * mask).sum()),
                     "clip_ratio": int((clipped * mask).sum()), "tokens": int(mask.sum())})
        return _plain_grpo_loss(loss_type, logp, ent, mask, old, ref, adv, 4)

    seen: dict = {}
    want = grads(plain)
    # the step's clip metrics count the clipped tokens the reference counts (each side; the same tokens clipped is
    # also what the gradients below compare)
    assert seen["clip_ratio/low_mean"] > 0 and seen["clip_ratio/high_mean"] > 0
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio"):
        assert round(metrics[key] * seen["tokens"]) == seen[key], (key, metrics[key], seen)
    # the reference's own float32 rounding: its distance from the same loss on a float64 copy of the model (same
    # inputs), per parameter and for the concatenation
    m64 = copy.deepcopy(model).double()
    params64 = [p for p in m64.parameters() if p.requires_grad]
    want64 = torch.autograd.grad(_plain_grpo_loss(loss_type, *_full_sequence(m64, rollout, 0.9), old.double(),
                                                  ref.double(), adv.double(), 4), params64)
    flat = lambda gs: torch.cat([x.flatten().double() for x in gs])  # noqa: E731
    floor = [(a.double() - b).norm().item() for a, b in zip(want, want64)]
    whole_floor = rel_err(flat(want), flat(want64))
    _assert_within_floor(got, want, floor, whole_floor)

    args = trl_config(tmp_path, loss_type=loss_type, beta=BETA, epsilon=EPS, max_completion_length=4,
                      entropy_coef=ENT, temperature=0.9)
    mask = _full_sequence(model, rollout, 0.9)[2]
    trl = grads(lambda: trl_loss(args, lambda: _full_sequence(model, rollout, 0.9)[:2], mask, adv, old, ref))
    _assert_within_floor(got, trl, floor, whole_floor)
    print(f"{loss_type}: rel err vs plain {rel_err(flat(got), flat(want)):.2e}, "
          f"vs TRL {rel_err(flat(got), flat(trl)):.2e} (floor {whole_floor:.2e})")


def test_num_iterations_replays_one_rollout_against_the_moved_policy_as_trl(tmp_path):
    """`num_iterations: 2` (TRL's μ): step 1 trains on step 0's rollout (the same responses, the sampling-time old
    log-probs) after step 0's optimizer step moved the policy, and its gradient is TRL's `_compute_loss` on the moved
    model's full-sequence log-probs against those old ones (within the float32 floor); step 2 draws a new batch."""
    trainer = _trainer(tmp_path, "dapo", num_iterations=2, learning_rate=0.05)
    model, params = trainer.model, trainer.params
    first = trainer.rollout(0)
    old_before = [r.old_logprobs.clone() for r in first.responses]
    trainer.train_step(0)
    rollout = trainer.rollout(1)
    assert rollout is first and all(torch.equal(r.old_logprobs, o) for r, o in zip(rollout.responses, old_before))
    for p in params:
        p.grad = None
    trainer.update(rollout)
    got = [p.grad.clone() for p in params]

    lengths = [r.tokens.numel() for r in rollout.responses]
    length = max(lengths)
    old = _padded([r.old_logprobs for r in rollout.responses], length)
    ref = _padded([r.ref_logprobs for r in rollout.responses], length)
    logp, _, mask = _full_sequence(model, rollout, 0.9)
    assert ((logp - old).abs() * mask).max() > 1e-3  # the policy moved: ratios ≠ 1
    rewards = rollout.rewards.view(2, 4)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(-1)

    def grads(fn, ps):
        return [g.clone() for g in torch.autograd.grad(fn(), ps)]

    args = trl_config(tmp_path, loss_type="dapo", beta=BETA, epsilon=EPS, max_completion_length=4, entropy_coef=ENT,
                      temperature=0.9)
    trl = grads(lambda: trl_loss(args, lambda: _full_sequence(model, rollout, 0.9)[:2], mask, adv, old, ref), params)
    m64 = copy.deepcopy(model).double()
    params64 = [p for p in m64.parameters() if p.requires_grad]
    trl64 = grads(lambda: trl_loss(args, lambda: _full_sequence(m64, rollout, 0.9)[:2], mask.double(), adv.double(),
                                   old.double(), ref.double()), params64)
    flat = lambda gs: torch.cat([x.flatten().double() for x in gs])  # noqa: E731
    floor = [(a.double() - b).norm().item() for a, b in zip(trl, trl64)]
    _assert_within_floor(got, trl, floor, rel_err(flat(trl), flat(trl64)))
    assert trainer.rollout(2) is not rollout and trainer.generation(2) == 1


def _one_group_flat():
    """A reward that is the same for every response of the first prompt it sees (advantage 0 there) and varies
    within the other groups."""
    first: list = []

    def reward(prompts, completions, completion_ids, **kw):
        first[:] = first or [prompts[0]]
        return [1.0 if p == first[0] else float(sum(ids) % 7) for p, ids in zip(prompts, completion_ids)]

    return reward


def test_skip_zero_advantage_replays_fewer_responses_for_the_same_gradient(tmp_path, monkeypatch):
    """`skip_zero_advantage` (beta 0, no entropy bonus): a group whose rewards are equal is not replayed, and the
    step's gradient is the one replaying every response gives (their loss terms are 0); with beta > 0 it is refused."""
    import longstraw.replay.order as order

    replayed = []
    inner = order.replay_batch
    monkeypatch.setattr(order, "replay_batch", lambda state, rs, *a, **kw: replayed.append(len(rs)) or inner(
        state, rs, *a, **kw))
    grads = {}
    for skip in (False, True):
        cfg = TrainConfig(model="llama", output_dir=str(tmp_path / str(skip)), prompt_length=20,
                          task_options={"num_pairs": 4, "num_values": 8}, num_steps=1, num_generations=4,
                          prompts_per_step=2, max_completion_length=4, lora=True, beta=0.0, entropy_coef=0.0,
                          prompt_grad="detached", temperature=0.9, progress=False, threads=1, seed=3,
                          skip_zero_advantage=skip)
        trainer = Trainer(cfg, reward_funcs=[_one_group_flat()])
        rollout = trainer.rollout(0)
        adv = rollout.advantages.view(2, 4)
        assert (adv[0] == 0).all() and (adv[1] != 0).any()
        with torch.no_grad():  # ratios ≠ 1
            g = torch.Generator().manual_seed(0)
            for p in trainer.params:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        for p in trainer.params:
            p.grad = None
        replayed.clear()
        trainer.update(rollout)
        grads[skip] = [p.grad.clone() for p in trainer.params]
        assert sum(replayed) == (4 if skip else 8)
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="skip_zero_advantage needs beta"):
        TrainConfig(model="llama", beta=0.1, skip_zero_advantage=True)
