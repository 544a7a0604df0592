"""`recapture_every: k` (`longstraw.train.staleness`): a document's state captured once is read for k optimizer steps.

The reference is transformers alone: a `DynamicCache` filled over the document but its last token by the weights of
the step that captured it (a prompt state holds the last prompt token back, to be read with what follows), then that
token, the row's question and the response read through it by the current weights. The responses a kept
state samples have exactly those log-probs, and they differ from a fresh capture's (the test sees staleness)."""

import json

import pytest
import torch

from longstraw.train.config import TrainConfig
from longstraw.train.staleness import StateStore
from longstraw.train.trainer import Trainer

from .test_shared_prefix_step import DOC, OLD_LOGPROB_TOL

#: one document, four questions: with two rows per step, steps 0 and 1 read the document, then steps 2 and 3 again
ROWS = [{"prompt": DOC + f" ? k{9 * q}", "answer": "v1", "context": "doc"} for q in range(1, 5)]


def _trainer(tmp_path, name="run", **kw):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = dict(model="llama", output_dir=str(tmp_path / name), dataset=str(data), eval_fraction=0.0,
               prompts_per_step=2, rows_per_context=2, num_steps=3, num_generations=3, max_completion_length=3,
               chunk_size=8, lora=False, progress=False, threads=1, min_shared_prefix=16, seed=5,
               learning_rate=5e-2, save_every=100, reward_funcs=["tests.train.test_shared_prefix_step:length_reward"])
    cfg.update(kw)
    return Trainer(TrainConfig(**cfg))


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stale_logprobs(model, old, new, prefix, suffix, response) -> torch.Tensor:
    """`[R]` log-probs of `response` after `prefix + suffix`, the cache of `prefix[:-1]` filled by weights `old` and the
    rest read by weights `new` (transformers' own model and DynamicCache)."""
    rest = torch.cat([prefix[-1:], suffix])
    with torch.no_grad():
        model.load_state_dict(old)
        cache = model(prefix[None, :-1], use_cache=True).past_key_values
        model.load_state_dict(new)
        logits = model(torch.cat([rest, response])[None], cache=cache).logits[0].float()
    at = logits[rest.numel() - 1 : rest.numel() - 1 + response.numel()]
    return torch.log_softmax(at, -1).gather(-1, response[:, None])[:, 0]


def test_a_kept_state_samples_from_the_weights_that_captured_it(tmp_path):
    trainer = _trainer(tmp_path, recapture_every=2)
    seen = []
    collect = trainer.rollout_stage.collect

    def spy(examples, step, meter):
        weights = _weights(trainer.model)
        r = collect(examples, step, meter)
        seen.append((weights, r))
        return r

    trainer.rollout_stage.collect = spy
    out = trainer.train()
    assert [(m["state_captures"], m["state_reuses"]) for m in out] == [(1, 0), (0, 1), (1, 0)]
    final = _weights(trainer.model)
    for step, captured_at in [(0, 0), (1, 0), (2, 2)]:
        weights, r = seen[step]
        (ctx,) = r.contexts
        for b in ctx.rows:
            g = r.groups[b]
            prefix, suffix = g.prompt_ids[: ctx.length], g.prompt_ids[ctx.length :]
            for resp in g.responses:
                want = _stale_logprobs(trainer.model, seen[captured_at][0], weights, prefix, suffix, resp.tokens)
                assert (resp.old_logprobs - want).abs().max().item() <= OLD_LOGPROB_TOL, (step, b)
                if captured_at != step:  # a fresh capture would have given other log-probs: staleness is visible
                    fresh = _stale_logprobs(trainer.model, weights, weights, prefix, suffix, resp.tokens)
                    assert (fresh - want).abs().max().item() > 100 * OLD_LOGPROB_TOL
    trainer.model.load_state_dict(final)


def test_recapture_every_one_is_the_default_run_and_checkpoints_end_kept_states(tmp_path):
    """k = 1 is today's run; a checkpoint releases the kept states, so a run saved every step (k = 2) captures every
    step, like a run resumed there would."""
    a = _trainer(tmp_path, "a").train()
    b = _trainer(tmp_path, "b", recapture_every=1).train()
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    saved = _trainer(tmp_path, "c", recapture_every=2, save_every=1).train()
    assert [m["state_captures"] for m in saved] == [1, 1, 1]


def test_iterations_of_one_batch_reuse_its_state(tmp_path):
    out = _trainer(tmp_path, recapture_every=2, num_iterations=2, num_steps=4).train()
    # steps 0, 1: batch 0 (captured at step 0, reused); steps 2, 3: batch 1 of the same document (age 2: recaptured)
    assert [(m["state_captures"], m["state_reuses"]) for m in out] == [(1, 0), (0, 1), (1, 0), (0, 1)]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="recapture_every > 1 keeps detached prompt states"):
        TrainConfig(model="llama", recapture_every=2, prompt_grad="exact")
    with pytest.raises(ValueError, match="recapture_every must be >= 1"):
        TrainConfig(model="llama", recapture_every=0)
    with pytest.raises(ValueError, match="recapture_every must be >= 1"):
        StateStore(0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_drift_probe_is_the_kv_change_transformers_computes(arch):
    """`kv_drift_probe`: the relative change of the full-attention K/V at the prompt's first positions between the kept
    state's weights and today's, held to transformers' own DynamicCache filled by each set of weights. gemma3_text
    (window 5, a full-attention layer between two sliding ones): its full-attention layer alone is read."""
    import longstraw
    from longstraw.testing.models import tiny_model
    from longstraw.train.staleness import kv_drift_probe

    model = tiny_model(arch)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    prefix = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    old = _weights(model)
    kept = longstraw.capture(model, prefix, chunk_size=8)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    new = _weights(model)
    got = kv_drift_probe(model, kept, prefix, tokens=16)

    def kv(weights):
        model.load_state_dict(weights)
        with torch.no_grad():
            cache = model(prefix[None, :15], use_cache=True).past_key_values
        full = [layer for layer, kind in zip(cache.layers, types) if kind == "full_attention"]
        return [t.float() for layer in full for t in (layer.keys, layer.values)]

    a, b = kv(old), kv(new)
    want = (sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)) / sum(float(y.pow(2).sum()) for y in b)) ** 0.5
    assert want > 1e-3
    # the same K/V to float32 rounding (the capture's chunks against one forward): 2^10 eps relative to the drift
    assert abs(got - want) <= 2**10 * torch.finfo(torch.float32).eps + 1e-3 * want
    assert kv_drift_probe(model, longstraw.capture(model, prefix, chunk_size=8), prefix, tokens=16) < 1e-5


def test_recapture_drift_captures_anew_past_its_bound(tmp_path):
    """With a bound nothing passes, a kept state is reused as with `recapture_every` alone; with one every update
    passes, it is captured anew each step; the step reports the drift its probe predicted."""
    free = _trainer(tmp_path, "free", recapture_every=2, num_iterations=2, num_steps=4, recapture_drift=1e9).train()
    assert [(m["state_captures"], m["state_reuses"]) for m in free] == [(1, 0), (0, 1), (1, 0), (0, 1)]
    assert free[1]["state_drift"] > 0
    tight = _trainer(tmp_path, "tight", recapture_every=2, num_iterations=2, num_steps=4, recapture_drift=1e-9).train()
    assert [(m["state_captures"], m["state_reuses"]) for m in tight] == [(1, 0), (1, 0), (1, 0), (1, 0)]
    with pytest.raises(ValueError, match="recapture_drift must be > 0 and needs recapture_every > 1"):
        TrainConfig(model="llama", recapture_drift=0.02)
