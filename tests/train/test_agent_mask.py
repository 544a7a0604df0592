"""Agent-style responses: tool tokens inside a response are read but masked out of the loss, the ratio and
the normalizer; a rollout hook builds such two-turn responses from one captured prompt."""

import copy

import torch

from longstraw.train.config import TrainConfig
from longstraw.train.rollout import Response
from longstraw.train.trainer import Trainer

from ..distributed.test_distributed_trainer import EPS32
from ..test_equivalence import FLOOR_FACTOR
from .test_trainer_gradient import _assert_within_floor

TOOL_TOKENS = [7, 9, 11]  # "tool output" the policy did not write


def two_turns(sampler, example, num_generations):
    """Turn 1 (2 tokens), a tool's reply (3 tokens, mask 0), turn 2 (2 tokens) continuing after both."""
    out = []
    for _ in range(num_generations):
        first = sampler.sample(1, 2)
        tool = torch.tensor(TOOL_TOKENS)
        prefix = torch.cat([first.tokens[0], tool])
        second = sampler.sample(1, 2, prefix_ids=prefix)
        tokens = torch.cat([prefix, second.tokens[0]])
        mask = torch.cat([torch.ones(first.tokens[0].numel()), torch.zeros(3), torch.ones(second.tokens[0].numel())])
        logprobs = torch.cat([first.logprobs[0], torch.zeros(3), second.logprobs[0]])
        out.append({"tokens": tokens, "mask": mask, "logprobs": logprobs, "truncated": bool(second.truncated[0])})
    return out


def _full_sequence_logprobs(model, prompt, tokens):
    logits = model(input_ids=torch.cat([prompt, tokens])[None]).logits[0, prompt.numel() - 1 : -1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]


def test_masked_tool_tokens_gradient_equals_naive_full_sequence(tmp_path):
    """The sampler's log-probs and the trainer's gradient against one full-sequence forward per response, each within
    `FLOOR_FACTOR` × that forward's own float32 rounding (its distance from a float64 copy of the model's)."""
    cfg = TrainConfig(model="llama", output_dir=str(tmp_path / "run"), prompt_length=20, num_steps=1,
                      task_options={"num_pairs": 4, "num_values": 8}, num_generations=3, prompts_per_step=2,
                      max_completion_length=8, ignore_eos=True, lora=False, loss_type="dapo", prompt_grad="exact",
                      importance_sampling_level="sequence", progress=False, threads=1,
                      rollout_func="tests.train.test_agent_mask:two_turns")  # the YAML form: an import path
    trainer = Trainer(cfg, reward_funcs=[lambda prompts, completions, completion_ids, **kw:
                                         [float(sum(ids) % 5) for ids in completion_ids]])
    model, params = trainer.model, trainer.params
    rollout = trainer.rollout(0)
    responses = [(g.prompt_ids, r) for g in rollout.groups for r in g.responses]
    assert all(isinstance(r, Response) and r.mask.tolist()[2:5] == [0, 0, 0] for _, r in responses)
    with torch.no_grad():  # the sampler's old log-probs of turn 2 (after the tool tokens) are the model's
        m64 = copy.deepcopy(model).double()
        for prompt, r in responses:
            full = _full_sequence_logprobs(model, prompt, r.tokens)
            on = r.mask > 0
            floor = (full - _full_sequence_logprobs(m64, prompt, r.tokens)).abs().max().item()
            # + one float32 rounding of the log-prob itself
            tol = FLOOR_FACTOR * floor + EPS32 * full.abs().max().item()
            assert (full[on] - r.old_logprobs[on]).abs().max() <= tol
        g = torch.Generator().manual_seed(0)
        for p in params:  # the policy moves after sampling: ratios ≠ 1
            p.add_(0.02 * torch.randn(p.shape, generator=g))

    for p in params:
        p.grad = None
    trainer.update(rollout)
    got = [p.grad.clone() for p in params]

    adv = rollout.advantages
    assert adv.abs().sum() > 0
    total_policy_tokens = sum(float(r.mask.sum()) for _, r in responses)

    def naive(model):  # every token through one full-sequence forward
        loss = 0.0
        for i, (prompt, r) in enumerate(responses):
            logp = _full_sequence_logprobs(model, prompt, r.tokens)
            old, mask, a = (x.to(logp.dtype) for x in (r.old_logprobs, r.mask, adv[i]))
            seq_ratio = torch.exp(((logp - old) * mask).sum() / mask.sum())
            per_token = -torch.min(seq_ratio * a, torch.clamp(seq_ratio, 0.8, 1.2) * a).expand_as(logp)
            loss = loss + (per_token * mask).sum() / total_policy_tokens
        return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    want = naive(model)
    want64 = naive(copy.deepcopy(model).double())  # the naive gradient's own rounding: against float64
    floor = [(a.double() - b).norm().item() for a, b in zip(want, want64)]
    flat = lambda gs: torch.cat([x.flatten().double() for x in gs])  # noqa: E731
    whole_floor = ((flat(want) - flat(want64)).norm() / flat(want64).norm()).item()
    _assert_within_floor(got, want, floor, whole_floor)
