"""Chunked LM-head log-probs and entropies against the plain log-softmax: values and gradients."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from longstraw.ops.logprobs import chunked_logprobs

from ..conftest import rel_err

EPS = torch.finfo(torch.float32).eps
#: chunked against the float64 log-softmax of the same float32 logits, norm-wise relative: float32's epsilon × 2^4
#: for log-probs and entropies. The chunked path computes logits over H ≤ 24 in its own blocking and reduces
#: exp and p · log p over V ≤ 100 in float32 with online rescaling: √(24 + 100) ≈ 11 ≤ 2^4 at random
TOL = EPS * 2**4
#: gradients: 4 × more. The backward chains two more reductions (p − onehot times the head's weights over V, or
#: times the hidden states over T ≤ 63): √(1 + 2) ≈ 2 at random, × 2 for p − onehot's and the entropy's cancellation
GRAD_TOL = TOL * 4
#: bf16 hidden states and head against the float32 reference on the unrounded values: the hidden states, the head's
#: weights and the logits each rounded to bf16 (≤ 2^-8 relative), carried by both z_t and log Σ e^z (× 2), on logits
#: smaller than the log-probs (rms 2.8 against 8.5 here): ≤ 6 × 2^-8 × 2.8 / 8.5 < 4 × 2^-8 = bf16's epsilon × 2
BF16_TOL = torch.finfo(torch.bfloat16).eps * 2

def reference_logprobs(hidden, head, targets, *, temperature=1.0, softcap=None):
    """Written here, independent of longstraw.ops.logprobs: the whole `[T, V]` log-softmax of the head's logits
    (float64, then back to float32), and the entropy from the probabilities."""
    z = head(hidden).double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.nn.functional.log_softmax(z / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None])[:, 0].float(), ent.float()

# (T, H, V, token_chunk, vocab_chunk, temperature, softcap, bias)
CASES = [
    pytest.param(13, 16, 50, 4, 7, 1.0, None, False, id="T13-V50-chunks-4x7"),
    pytest.param(1, 8, 33, 1024, 32768, 0.7, None, True, id="T1-bias-temp0.7"),
    pytest.param(63, 24, 100, 16, 100, 1.3, 30.0, False, id="T63-softcap"),
    pytest.param(20, 8, 64, 20, 64, 1.0, None, True, id="one-chunk"),
]


def _setup(t, h, v, bias, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(h, v, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(v, generator=g))
    hidden = torch.randn(t, h, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, (t,), generator=g)
    return head, hidden, targets


@pytest.mark.parametrize("t,h,v,tc,vc,temp,softcap,bias", CASES)
def test_fused_matches_reference_fp32(t, h, v, tc, vc, temp, softcap, bias):
    head, hidden, targets = _setup(t, h, v, bias)
    params = [hidden, *head.parameters()]
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(t, generator=g), torch.randn(t, generator=g)
    lp, ent = chunked_logprobs(hidden, head, targets, temperature=temp, softcap=softcap, token_chunk=tc, vocab_chunk=vc)
    rlp, rent = reference_logprobs(hidden, head, targets, temperature=temp, softcap=softcap)
    assert rel_err(lp, rlp) <= TOL and rel_err(ent, rent) <= TOL
    grads = torch.autograd.grad((a * lp + b * ent).sum(), params)
    ref = torch.autograd.grad((a * rlp + b * rent).sum(), params)
    for x, y in zip(grads, ref):
        assert rel_err(x, y) <= GRAD_TOL


def test_logprob_only_gradient_and_module_fallback():
    """Entropy unused (its gradient is None); a non-Linear head goes through checkpointed chunks. Both are held
    to the plain log-softmax written in this file, not to the function the fallback itself runs."""
    head, hidden, targets = _setup(17, 8, 40, True)
    wrapped = torch.nn.Sequential(head)
    for module in (head, wrapped):
        lp, _ = chunked_logprobs(hidden, module, targets, token_chunk=5, vocab_chunk=9, temperature=0.9)
        rlp, _ = reference_logprobs(hidden, head, targets, temperature=0.9)
        g1 = torch.autograd.grad(lp.sum(), [hidden, head.weight, head.bias])
        g2 = torch.autograd.grad(rlp.sum(), [hidden, head.weight, head.bias])
        assert rel_err(lp, rlp) <= TOL
        assert all(rel_err(x, y) <= GRAD_TOL for x, y in zip(g1, g2))


def test_bf16_within_documented_tolerance():
    """bf16 inputs, float32 accumulation: within `BF16_TOL` relative of the fp32 reference."""
    head, hidden, targets = _setup(31, 32, 90, False)
    lp, _ = chunked_logprobs(hidden.bfloat16(), copy.deepcopy(head).bfloat16(), targets, token_chunk=8, vocab_chunk=16)
    rlp, _ = reference_logprobs(hidden, head, targets)
    assert lp.dtype == torch.float32
    assert rel_err(lp, rlp) <= BF16_TOL


def test_temperature_scales_logits():
    """Invariance: temperature τ on head W equals temperature 1 on head W/τ. τ = 0.5 is a power of two: dividing by it
    scales every operand and result exactly, so the two agree bit for bit."""
    head, hidden, targets = _setup(9, 8, 30, False)
    scaled = torch.nn.Linear(8, 30, bias=False)
    with torch.no_grad():
        scaled.weight.copy_(head.weight / 0.5)
    a, _ = chunked_logprobs(hidden, head, targets, temperature=0.5, vocab_chunk=7)
    b, _ = chunked_logprobs(hidden, scaled, targets, vocab_chunk=7)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_no_full_logits_saved():
    head, hidden, targets = _setup(64, 8, 200, False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        chunked_logprobs(hidden, head, targets, token_chunk=8, vocab_chunk=50)
    assert max(x.numel() for x in saved) < 64 * 200



@pytest.mark.parametrize("t,h,v,tc,vc,temp,softcap,bias", CASES)
@pytest.mark.parametrize("loss", ["logp", "entropy", "both"])
def test_frozen_head_gradient_matches_reference(t, h, v, tc, vc, temp, softcap, bias, loss):
    """A head without gradient (LoRA) takes the path that computes ∂logp/∂h in forward; the hidden states' gradient
    is the plain log-softmax's, whichever outputs the loss reads."""
    head, hidden, targets = _setup(t, h, v, bias)
    head.requires_grad_(False)
    g = torch.Generator().manual_seed(9)
    a = torch.randn(t, generator=g) * (loss != "entropy")
    b = torch.randn(t, generator=g) * (loss != "logp")
    lp, ent = chunked_logprobs(hidden, head, targets, temperature=temp, softcap=softcap, token_chunk=tc, vocab_chunk=vc)
    rlp, rent = reference_logprobs(hidden, head, targets, temperature=temp, softcap=softcap)
    assert rel_err(lp, rlp) <= TOL and rel_err(ent, rent) <= TOL
    (got,) = torch.autograd.grad((a * lp + b * ent).sum(), [hidden])
    (ref,) = torch.autograd.grad((a * rlp + b * rent).sum(), [hidden])
    assert rel_err(got, ref) <= GRAD_TOL


def test_frozen_head_scale_and_backward_without_products():
    """The causal-LM class's logit `scale` enters the forward-computed gradient; with the entropy unread, backward
    runs no matrix product (the head's products all in forward: two per tile), with it read it recomputes the tiles."""
    head, hidden, targets = _setup(21, 12, 70, True)
    head.requires_grad_(False)
    lp, ent = chunked_logprobs(hidden, head, targets, scale=0.37, token_chunk=8, vocab_chunk=16)
    scaled = torch.nn.Linear(12, 70)
    with torch.no_grad():
        scaled.weight.copy_(head.weight * 0.37)
        scaled.bias.copy_(head.bias * 0.37)
    rlp, _ = reference_logprobs(hidden, scaled, targets)
    with FlopCounterMode(display=False) as counted:
        (got,) = torch.autograd.grad(lp.sum(), [hidden], retain_graph=True)
    (ref,) = torch.autograd.grad(rlp.sum(), [hidden])
    assert rel_err(got, ref) <= GRAD_TOL
    assert counted.get_total_flops() == 0
    with FlopCounterMode(display=False) as counted:
        torch.autograd.grad(ent.sum(), [hidden])
    assert counted.get_total_flops() == 2 * (2 * 21 * 70 * 12)  # the logits again and their product with the head
