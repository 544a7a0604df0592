"""The replay orders' one entry point (`longstraw.replay.order`): every order gives one gradient, the model's own.

The reference: transformers' model on each response's whole sequence (`full_sequence_logprobs`, prompt included, so
the exact prompt gradient is in it), the responses' policy tokens weighted by distinct per-response weights, summed.
The responses have different lengths and one holds environment tokens (mask 0: read, not trained), so a piece given
to the wrong response, a lost piece or a lost last batch shows.
"""

import pytest
import torch

import longstraw
from longstraw.model.oracles import full_sequence_logprobs
from longstraw.replay.layer_major import LayerMajor
from longstraw.replay.order import ReplayOrder, choose_order, replay_backward

from ..conftest import assert_grads_close, make_model, tokens
from ..test_equivalence import FP32_GRAD_TOL
from .test_batched import _grads

WEIGHTS = [0.7, -1.2, 0.4]
MASKS = [[1, 1, 0, 0, 1, 1], [1, 1], [1, 1, 1, 1, 1, 1, 1]]

ORDERS = {
    "whole": ReplayOrder(),
    "batched-2": ReplayOrder(batch=2),
    "batched-3": ReplayOrder(batch=3),
    "segments": ReplayOrder(segments=True),
    "layer-major": ReplayOrder(layer_major=LayerMajor(1, 2)),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("name", list(ORDERS))
def test_every_order_gives_the_models_gradient(arch, name):
    """Whole, batched (2 and 3 at a time), by segments and layer by layer: the exact-mode gradient of the weighted
    policy-token log-probs equals the full-sequence forward's; the last backward's hook runs once; each response's
    pieces cover its trained tokens."""
    model = make_model(arch)
    prompt = tokens(23, 1)
    responses = [tokens(len(m), 10 + i) for i, m in enumerate(MASKS)]
    masks = [torch.tensor(m, dtype=torch.float32) for m in MASKS]

    def reference():
        total = sum(w * (full_sequence_logprobs(model, prompt, r) * m).sum()
                    for w, r, m in zip(WEIGHTS, responses, masks))
        total.backward()

    want = _grads(model, reference)
    calls = []

    def ours():
        def loss_of(j, sl, out):
            calls.append(("loss", j, sl.start, sl.stop))
            return WEIGHTS[j] * (out.logprobs * masks[j][sl]).sum()

        state = longstraw.capture(model, prompt, chunk_size=8, prompt_grad="exact")
        # layer-major takes no hook (one process without FSDP2, the only place it is used)
        hook = None if name == "layer-major" else (lambda: calls.append(("last",)))
        replay_backward(state, list(zip(responses, masks)), loss_of, ORDERS[name], before_last_backward=hook)
        state.backward()

    got = _grads(model, ours)
    assert_grads_close(got, want, FP32_GRAD_TOL)
    assert calls.count(("last",)) == (0 if name == "layer-major" else 1)
    covered = {j: sorted((a, b) for kind, jj, a, b in (c for c in calls if c[0] == "loss") if jj == j)
               for j in range(len(MASKS))}
    for j, m in enumerate(MASKS):  # each response's pieces cover its trained tokens
        assert covered[j] and all(m[t] == 0 or any(a <= t < b for a, b in covered[j]) for t in range(len(m)))


def test_the_order_is_chosen_from_the_settings():
    """An integer batch as given (at most the row's responses), "auto" from the memory budget; context-parallel
    ranks batch too (one collective per batch), ranks in lockstep that take contexts of their own and responses that
    go layer by layer one at a time."""
    model = make_model("llama")
    assert choose_order(model, 8, 3).batch == 3
    assert choose_order(model, 2, 3).batch == 2
    assert choose_order(model, 8, "auto", replay_memory=1).batch == 1
    assert choose_order(model, 8, "auto", replay_memory=1 << 40).batch == 8
    assert choose_order(model, 8, 4, collective=True).batch == 4
    assert choose_order(model, 8, 4, collective=True, lockstep=True).batch == 4
    assert choose_order(model, 8, 4, lockstep=True).batch == 1
    assert choose_order(model, 8, 4, layer_major=LayerMajor(1, 2)).batch == 1
    # the run record's words for it (`replay_order`), saying why a batch asked for is not used
    assert choose_order(model, 8, 4, layer_major=LayerMajor(1, 2)).name == (
        "layer-major, one response at a time (layer-major replay does not batch)")
    assert choose_order(model, 8, 4, lockstep=True).name == (
        "whole responses, one at a time (ranks in lockstep that take contexts of their own replay one at a time)")
    assert choose_order(model, 8, 4, segments=True).name == (
        "whole responses, 4 at a time; responses with tool output by segments, one at a time (segmented replay does "
        "not batch)")
    assert choose_order(model, 8, 4, segments=True, collective=True).name == (
        "every response by segments, one at a time (segmented replay does not batch)")
    assert choose_order(model, 8, 4, collective=True).name == "whole responses, 4 at a time per rank, one collective per batch"
    assert choose_order(model, 8, 1).name == "whole responses, one at a time"
