"""Mamba-2 layers beyond what every family's tests cover: a stack without attention, single-token steps."""

import pytest
import torch

import longstraw
from longstraw.testing.models import tiny_model
from longstraw.model.oracles import _response_logprobs, cache_reference_logprobs

from ..conftest import assert_grads_close, make_model, tokens

#: replay against the unmodified model in float32, absolute on log-probs and relative on gradients: the suite's fp32
#: bound (tests/test_equivalence.py), float32's epsilon × 2^10 = 1.2e-4 taken as 1e-4: a thousand roundings adding
#: up coherently through a tiny model's depth and sums (here the selective scans), on logits of order 1
FP32_TOL = 1e-4


def _no_cache_logprobs(model, prompt, response):
    """log p(response | prompt) from one forward of [prompt + response] without a cache (transformers 5.24 fails on
    a cache with no attention layer, as in an all-SSM stack; with no cache the forward is plain)."""
    ids = torch.cat([prompt, response])
    logits = model(input_ids=ids[None], use_cache=False).logits[0]
    return _response_logprobs(logits[-response.numel() - 1 : -1], response)


def test_all_ssm_stack_forward_and_exact_gradients():
    """granitemoehybrid with Mamba-2 layers only: replay log-probs and exact-mode gradients equal the full
    sequence (the cache then has no attention layer to count tokens from)."""
    model = tiny_model("granitemoehybrid", layer_types=["linear_attention"] * 2, num_hidden_layers=2)
    prompt, responses, adv = tokens(19, 1), [tokens(6, 2), tokens(3, 3)], [0.8, -1.1]
    with torch.no_grad():
        ref = _no_cache_logprobs(model, prompt, responses[0])
        with longstraw.capture(model, prompt, chunk_size=5, block_size=4) as state:
            assert (state.replay(responses[0]).logprobs - ref).abs().max().item() <= FP32_TOL

    def grads(fn):
        model.zero_grad(set_to_none=True)
        fn()
        return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]

    def naive():
        for a, r in zip(adv, responses):
            (a * _no_cache_logprobs(model, prompt, r)).sum().backward()

    def exact():
        with longstraw.capture(model, prompt, chunk_size=5, prompt_grad="exact") as state:
            for a, r in zip(adv, responses):
                (a * state.replay(r).logprobs).sum().backward()
            state.backward()

    assert_grads_close(grads(exact), grads(naive), tol=FP32_TOL)


def test_single_token_replay_leaves_the_state_and_gives_the_reference_gradient():
    """R = 1: the Mamba-2 layers take their single-token step, which updates the state it is handed in place
    (transformers 5.24). The captured state stays as it was, and the gradient equals transformers' own cache."""
    model = tiny_model("granitemoehybrid")
    params = [p for p in model.parameters() if p.requires_grad]
    prompt, response = tokens(13, 4), tokens(1, 5)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        ref = cache_reference_logprobs(model, prompt, response)
        g_ref = torch.autograd.grad(ref.sum(), params, allow_unused=True)
    state = longstraw.capture(model, prompt, chunk_size=4)
    before = [t.clone() for layer in state.layers for t in layer.tensors()]
    out = state.replay(response).logprobs
    g_out = torch.autograd.grad(out.sum(), params, allow_unused=True)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for layer in state.layers for t in layer.tensors()]))
    assert (out - ref).abs().max().item() <= FP32_TOL
    assert_grads_close(list(g_out), list(g_ref), tol=FP32_TOL)


def _graph_tensors() -> int:
    import gc

    # `type(o)`, not isinstance: the latter reads `__class__`, which warns on torch's deprecated module aliases
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("arch", ["granitemoehybrid", "qwen3_next", "llama"])
def test_no_graph_survives_its_backward(arch):
    """After a replay's backward (and exact mode's reverse pass) no tensor of its graph stays alive: the count of
    live tensors with history is the same after the 2nd and the 3rd step (a pack hook that returned the saved
    tensor itself kept every graph alive through a reference cycle in autograd's graph)."""
    model = make_model(arch, use_lora=True)
    counts = []
    for step in range(3):
        state = longstraw.capture(model, tokens(30, step), chunk_size=8, prompt_grad="exact")
        for r in (1, 5):
            state.replay(tokens(r, 10 + step)).logprobs.sum().backward()
        state.backward()
        del state
        counts.append(_graph_tensors())
    assert counts[2] == counts[1], counts
