"""prompt_grad="exact": parameter gradients equal naive full-sequence GRPO over G sequences."""

import pytest
import torch

import longstraw
from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs

from .conftest import ARCHS, assert_grads_close, assert_tie_free, make_model, rel_err, tokens
from .test_equivalence import FLOOR_FACTOR, FP32_GRAD_TOL

EXACT_ARCHS = ARCHS
#: float64 arithmetic, relative: float64's epsilon (2.2e-16) × 2^10, the fp32 bound's growth factor (a thousand
#: roundings adding up coherently through the model's depth and sums)
FP64_TOL = 2**10 * torch.finfo(torch.float64).eps


def _grads(model, fn):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    fn()
    return [None if p.grad is None else p.grad.clone() for p in params]


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", EXACT_ARCHS)
def test_exact_gradients_equal_naive_full_sequence_grpo(arch, use_lora):
    model = make_model(arch, use_lora)
    prompt = tokens(23, 1)  # 22 captured tokens in chunks of 5: not a multiple
    responses = [tokens(n, 10 + n) for n in (5, 1, 8)]  # different lengths
    for r in responses:
        assert_tie_free(model, torch.cat([prompt, r]))
    adv = [0.7, -1.2, 0.4]

    def naive():
        for a, r in zip(adv, responses):
            (a * full_sequence_logprobs(model, prompt, r)).sum().backward()

    def exact():
        with longstraw.capture(model, prompt, chunk_size=5, prompt_grad="exact", block_size=4) as state:
            for a, r in zip(adv, responses):
                (a * state.replay(r).logprobs).sum().backward()
            state.backward()

    assert_grads_close(_grads(model, exact), _grads(model, naive), tol=FP32_GRAD_TOL)


def test_detached_and_exact_each_equal_their_reference_and_backward_once():
    """Detached mode equals transformers' own cache under no_grad then the response with grad; exact mode
    equals the full-sequence forward; the two estimators differ (DESIGN: a different estimator, not rounding)."""
    model = make_model("llama")
    prompt, response = tokens(12, 3), tokens(4, 4)

    def exact():
        state = longstraw.capture(model, prompt, chunk_size=4, prompt_grad="exact")
        state.replay(response).logprobs.sum().backward()
        state.backward()
        with pytest.raises(RuntimeError, match="already"):
            state.backward()

    def detached():
        with longstraw.capture(model, prompt, chunk_size=4) as state:
            state.replay(response).logprobs.sum().backward()
            state.backward()  # nothing to do in detached mode

    got_exact, got_detached = _grads(model, exact), _grads(model, detached)
    naive = _grads(model, lambda: full_sequence_logprobs(model, prompt, response).sum().backward())
    cached = _grads(model, lambda: cache_reference_logprobs(model, prompt, response).sum().backward())
    assert_grads_close(got_exact, naive, tol=FP32_GRAD_TOL)
    assert_grads_close(got_detached, cached, tol=FP32_GRAD_TOL)
    flat = lambda gs: torch.cat([g.flatten() for g in gs if g is not None])  # noqa: E731
    # a different estimator (measured 0.6 apart): 100 × the fp32 bound, which no rounding reaches
    assert rel_err(flat(got_exact), flat(got_detached)) > 100 * FP32_GRAD_TOL


def test_exact_mode_replays_are_unchanged_and_state_grad_is_the_directional_derivative():
    """The gradient a replay accumulates on the durable state (K/V, conv and recurrent states) is checked by
    central finite differences along a random direction, in float64: independent of autograd.

    transformers keeps parts of gated DeltaNet in float32 inside a float64 model (its recurrent state among the
    leaves), so the bounds come from the model's own rounding floor, measured here: the full-sequence forward
    against transformers' cache reference reordered (one-forward and chunked prefill, stepwise response) bounds the
    rounding of the replay's log-probs and of each value the difference quotient reads; the analytic derivative
    against itself from a capture in other chunks (the same state, rounded otherwise) bounds its own rounding.
    """
    from longstraw.testing.models import tiny_model

    model = tiny_model("qwen3_5_text", dtype=torch.float64)  # hybrid, no MoE (grouped_mm has no float64)
    prompt, response = tokens(17, 5), tokens(6, 6)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        reordered = [cache_reference_logprobs(model, prompt, response, **kw)
                     for kw in ({}, dict(prefill_chunk=4), dict(stepwise_response=True))]
    floor = max((v - ref).abs().max().item() for v in reordered)
    # the rounding of one value (the summed log-probs), bounded by the sum of its terms' reordered differences
    value_floor = max((v - ref).abs().sum().item() for v in reordered)
    assert floor <= FP32_GRAD_TOL, f"the reordered reference differs by {floor:.2e}: not rounding"

    def directional(chunk):
        state = longstraw.capture(model, prompt, chunk_size=chunk, prompt_grad="exact")
        out = state.replay(response).logprobs
        out.sum().backward()
        leaves = [t for layer in state.layers for t in layer.tensors() if t.requires_grad]
        return state, out, leaves

    state, out, leaves = directional(4)
    assert (out - ref).abs().max().item() <= FP64_TOL * ref.abs().max().item() + FLOOR_FACTOR * floor
    assert leaves and all(t.grad is not None for t in leaves)
    g = torch.Generator().manual_seed(0)
    direction = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in leaves]
    norm = torch.cat([d.flatten() for d in direction]).norm()
    direction = [d / norm for d in direction]  # a unit step: h is the distance moved
    analytic = sum((t.grad * d).sum() for t, d in zip(leaves, direction)).item()
    _, _, other = directional(3)
    assert [t.shape for t in other] == [t.shape for t in leaves]
    analytic_floor = abs(sum((t.grad * d).sum() for t, d in zip(other, direction)).item() - analytic)
    # the difference quotient errs by its rounding, value_floor / h, and by c·h² truncation: h balances the two
    # (measured c ≈ 0.7, value_floor ≈ 4e-8: h ≈ (value_floor / 2c)^(1/3))
    h = 3e-3
    saved = [t.detach().clone() for t in leaves]

    def value(sign, h):
        with torch.no_grad():
            for t, d in zip(leaves, direction):
                t.add_(sign * h * d)
            v = state.replay(response).logprobs.sum().item()
            for t, s in zip(leaves, saved):
                t.copy_(s)  # exactly as captured (subtracting the step again would leave its rounding)
            return v

    def numeric(h):
        return (value(1, h) - value(-1, h)) / (2 * h)

    d1, d2 = numeric(h), numeric(2 * h)
    # truncation c·h² at h, 4c·h² at 2h: their difference over 3 bounds it (with both quotients' rounding in it);
    # the perturbed float32 leaves round to float32 as well: ≤ eps/2 of each element, times its gradient, per value
    leaf_rounding = sum((t.grad.abs() * (t.abs() + h * d.abs())).sum().item() for t, d in zip(leaves, direction)
                        if t.dtype == torch.float32) * torch.finfo(torch.float32).eps / 2
    bound = FLOOR_FACTOR * (analytic_floor + (value_floor + leaf_rounding) / h + abs(d2 - d1) / 3)
    # the check resolves an error of 1% of the derivative (measured: the bound 7e-4 of it, the error 6e-5)
    assert bound <= 1e-2 * abs(analytic), (bound, analytic)
    assert abs(d1 - analytic) <= bound, (d1, analytic, bound)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64], ids=lambda c: f"C{c}")
def test_exact_sliding_window_with_chunks_smaller_and_larger_than_the_window(chunk):
    """gemma3's sliding window is 5: chunks shorter than it read windows spanning several chunks."""
    model = make_model("gemma3_text")
    prompt, responses = tokens(17, 2), [tokens(3, 3), tokens(7, 4)]

    def naive():
        for r in responses:
            full_sequence_logprobs(model, prompt, r).sum().backward()

    def exact():
        with longstraw.capture(model, prompt, chunk_size=chunk, prompt_grad="exact", block_size=4) as state:
            for r in responses:
                state.replay(r).logprobs.sum().backward()
            state.backward()

    assert_grads_close(_grads(model, exact), _grads(model, naive), tol=FP32_GRAD_TOL)


def test_constant_early_layers_get_no_gradient_buffer():
    """LoRA on the full-attention layer only: the linear layers before it hold constant states."""
    from peft import LoraConfig, get_peft_model

    from longstraw.testing.models import tiny_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_model("qwen3_next"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                init_lora_weights=False))
    prompt, responses = tokens(21, 7), [tokens(4, 8), tokens(6, 9)]

    def naive():
        for r in responses:
            full_sequence_logprobs(model, prompt, r).sum().backward()

    def exact():
        with longstraw.capture(model, prompt, chunk_size=4, prompt_grad="exact") as state:
            assert not any(t.requires_grad for t in state.layers[0].tensors())  # linear layer 0: constant
            assert all(t.requires_grad for t in state.layers[1].tensors())  # the LoRA-adapted attention
            for r in responses:
                state.replay(r).logprobs.sum().backward()
            state.backward()

    assert_grads_close(_grads(model, exact), _grads(model, naive), tol=FP32_GRAD_TOL)


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2"])
def test_boundary_states_hold_no_chunk_sized_memory(arch):
    """Exact mode keeps each chunk's boundary conv window: its own few columns, not a view that keeps the whole
    chunk's conv inputs alive (which made capture memory grow by one chunk's inputs per chunk, O(P))."""
    model = make_model(arch)
    with torch.no_grad():
        state = longstraw.capture(model, tokens(240, 1), chunk_size=80, prompt_grad="exact")
    windows = [t for layer in state.layers for b in getattr(layer, "boundaries", ()) if isinstance(b, tuple)
               for d in b if isinstance(d, dict) for t in d.values() if t is not None and t.dim() == 3]
    windows += [t for layer in state.layers for t in getattr(layer, "conv_states", {}).values() if t is not None]
    assert windows
    for t in windows:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size() < 80 * t.shape[1] * t.element_size()
