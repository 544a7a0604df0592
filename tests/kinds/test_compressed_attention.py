"""DeepSeek-V4 compressed attention: pooling and attention kernels against plain references, the indexer's choice
against transformers' own, and the tiny model against the unmodified one on shapes around compression windows.

The tiny model (`longstraw.archs.deepseek_v4`) has one CSA layer (m = 4, top-3), one HCA layer (m′ = 8) and
one sliding layer (W = 6). transformers initialises `position_bias` and the sinks to zero; the model tests
here draw them at random so that a slot of the pooling or a sink at the wrong place cannot hide.
Selections are checked tie-free first (`assert_tie_free` covers V4's indexer).
"""

import pytest
import torch

import longstraw
import longstraw.testing.models
from longstraw.kinds.compressed_attention import Stream, full_indexer_scores
from longstraw.hf.parts import base_model, decoder_of
from longstraw.ops.attention import split_attention
from longstraw.ops.compressed_attention import (
    apply_sinks,
    dense_entry_part,
    entry_part,
    entry_positions,
    gathered_entry_part,
    merge_parts,
    reference_compressed_attention,
    reference_pool,
)
from longstraw.ops.latent_attention import select_topk
from longstraw.model.oracles import full_sequence_logprobs

from ..conftest import assert_grads_close, assert_tie_free, make_model, tie_free_tokens, tokens

#: the float64 pooling and attention parts against their plain references, absolute (values and gradients here are
#: at most ~6 in size): epsilon × 2^5 for values. Each reorders sums over ≤ 2 × 5 window slots (pooling) or over
#: ≤ 12 keys and entries of D = 8 (the parts merged by log-sum-exp): √(8 + 12) ≈ 4.5 at random, × 6 ≤ 2^5
FP64_TOL = torch.finfo(torch.float64).eps * 2**5
#: gradients: 4 × more. The backward chains the same reductions again (√2 at random, rounded up) and
#: dS = P ∘ (dP − rowsum(dO ∘ O)) cancels (× 2)
FP64_GRAD_TOL = FP64_TOL * 4
#: replay against the unmodified model in float32, absolute on log-probs and relative on gradients: the suite's fp32
#: bound (tests/test_equivalence.py), float32's epsilon × 2^10 = 1.2e-4 taken as 1e-4: a thousand roundings adding
#: up coherently through a tiny model's depth and sums, on logits of order 1
FP32_TOL = 1e-4


class _Pooler(torch.nn.Module):
    """The parts of a V4 compressor that `Stream.push` reads, with identity norm and no rotation."""

    def __init__(self, rate, d, overlap):
        super().__init__()
        self.head_dim = d
        self.position_bias = torch.nn.Parameter(torch.randn(rate, (2 if overlap else 1) * d, dtype=torch.float64))
        self.kv_norm = torch.nn.Identity()

    def rotary_emb(self, x, position_ids, layer_type):
        z = torch.zeros(*position_ids.shape, 0, dtype=x.dtype)
        return z, z


@pytest.mark.parametrize("overlap", [True, False], ids=["CSA", "HCA"])
@pytest.mark.parametrize("rate,pieces", [(4, [3, 1, 6, 2, 5]), (3, [1, 1, 1, 9]), (5, [17])], ids=["m4", "m3-C1", "m5"])
def test_streamed_pooling_equals_reference(monkeypatch, overlap, rate, pieces):
    """Pushing a sequence in pieces that split windows (tails, overlaps carried) gives every window's pooled
    entry as the whole-sequence reference does; gradients to kv, gate and bias too (fp64)."""
    import longstraw.kinds.compressed_attention as mod

    monkeypatch.setattr(mod, "_rope", lambda module: lambda x, cos, sin: x)
    d = 5
    pool = _Pooler(rate, d, overlap)
    f = (2 if overlap else 1) * d
    kv = torch.randn(2, sum(pieces), f, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(2, sum(pieces), f, dtype=torch.float64, requires_grad=True)
    st, s0 = Stream(rate, 0), 0
    for n in pieces:
        st = st.push(pool, kv[:, s0 : s0 + n], gate[:, s0 : s0 + n], overlap)
        s0 += n
    ref = reference_pool(kv, gate, pool.position_bias, d, overlap)
    got = st.own[:, 0]
    assert got.shape == ref.shape == (2, sum(pieces) // rate, d)
    torch.testing.assert_close(got, ref, rtol=0, atol=FP64_TOL)
    assert st.tail_kv.shape[1] == sum(pieces) % rate
    w = torch.randn_like(ref)
    g = torch.autograd.grad((got * w).sum(), [kv, gate, pool.position_bias])
    g_ref = torch.autograd.grad((ref * w).sum(), [kv, gate, pool.position_bias])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=FP64_GRAD_TOL)


@pytest.mark.parametrize("sparse", [False, True], ids=["HCA-all-visible", "CSA-selected"])
@pytest.mark.parametrize("b", [1, 3], ids=["B1", "B3-shared-prompt"])
def test_attention_parts_equal_reference(sparse, b):
    """[sliding window | prompt entries | own entries] merged by log-sum-exp with sinks equals one plain softmax,
    in value and gradient (fp64): prompt entries blockwise (batch 1 shared by B) or gathered by a selection."""
    torch.manual_seed(0)
    h, d, rate, window, block = 4, 8, 4, 5, 3
    p, s = 22, 9  # 22 prompt tokens (5 entries, tail 2); queries at 22..30 complete entries 5 and 6
    dt = torch.float64
    q = torch.randn(b, h, s, d, dtype=dt, requires_grad=True)
    keys = torch.randn(1, 1, p + s, d, dtype=dt)
    own_k = keys[:, :, p:].expand(b, -1, -1, -1).clone().requires_grad_(True)
    prompt_k = keys[:, :, p - window + 1 : p]
    prompt_e = torch.randn(1, 1, p // rate, d, dtype=dt, requires_grad=True)
    own_e = torch.randn(b, 1, 2, d, dtype=dt, requires_grad=True)
    sinks = torch.randn(h, dtype=dt, requires_grad=True)
    scale = d ** -0.5
    pos_own = entry_positions(p // rate, 2, rate, "cpu")
    sliding = split_attention(q, own_k, own_k, prompt_k, prompt_k, q_start=p, own_start=p, prompt_start=p - window + 1,
                              scale=scale, window=window, block=block, with_lse=True)
    n_e = p // rate + 2
    positions = torch.cat([entry_positions(0, p // rate, rate, "cpu"), pos_own])
    allowed = None
    if sparse:
        qi, ki = torch.randn(b, s, 2, 4, dtype=dt), torch.randn(1, p // rate, 4, dtype=dt)
        sel = select_topk(qi, torch.randn(b, s, 2, dtype=dt), 0.5, ki, torch.randn(b, 2, 4, dtype=dt), 3, q_start=p,
                          own_start=0, block=2, own_positions=pos_own)
        assert sel.indices is not None
        parts = [gathered_entry_part(q, prompt_e, own_e, sel, scale)]
        allowed = torch.zeros(b, s, n_e, dtype=torch.bool)
        allowed.scatter_(-1, sel.indices, sel.valid)
    else:
        parts = [entry_part(q, prompt_e, scale, block), dense_entry_part(q, own_e, pos_own, p, scale)]
    out, lse = merge_parts(sliding, *parts)
    out = apply_sinks(out, lse, sinks)
    full_keys = torch.cat([keys[:, :, :p].expand(b, -1, -1, -1), own_k], dim=2)
    entries = torch.cat([prompt_e.expand(b, -1, -1, -1), own_e], dim=2)
    ref = reference_compressed_attention(q, full_keys, entries, positions, scale, window, sinks, allowed)
    torch.testing.assert_close(out, ref, rtol=0, atol=FP64_TOL)
    w = torch.randn_like(ref)
    inputs = [q, own_k, prompt_e, own_e, sinks]
    g = torch.autograd.grad((out * w).sum(), inputs)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    for a, c in zip(g, g_ref):
        torch.testing.assert_close(a, c, rtol=0, atol=FP64_GRAD_TOL)


def _random_v4(use_lora=False):
    model = make_model("deepseek_v4", use_lora)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if "position_bias" in name or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def test_indexer_choice_equals_transformers():
    """The entries `full_indexer_scores` ranks top-k are those transformers' own indexer picks (hooked output)."""
    model = _random_v4()
    ids = tie_free_tokens(model, 33, 6, seed=2)
    ids = torch.cat(ids)
    seen = []
    layers = decoder_of(base_model(model)).layers
    idx = layers[0].self_attn.compressor.indexer
    handle = idx.register_forward_hook(lambda mod, args, out: seen.append((args, out)))
    with torch.no_grad():
        model(input_ids=ids[None])
    handle.remove()
    (args, picked), = seen
    scores = full_indexer_scores(idx, args[0], args[1])[0]
    sparse = 0
    for t in range(ids.numel()):
        want = {int(i) for i in picked[0, t] if i >= 0}
        visible = int((scores[t] > float("-inf")).sum())
        got = set(scores[t].topk(min(idx.index_topk, visible)).indices.tolist()) if visible else set()
        assert got == want, t
        sparse += visible > idx.index_topk
    assert sparse >= 10


# (P, R, chunk): chunks splitting a CSA window (5, 3) and an HCA window (5, 7); P < one CSA window and < one
# HCA window; P = 1; R = 1; responses crossing CSA and HCA window boundaries (P = 22: captured 21, tails 1
# and 5; the response completes entries at positions 23, 27 and 23)
CASES = [
    pytest.param(22, 9, 5, id="P22-R9-C5-crossing"),
    pytest.param(31, 7, 3, id="P31-R7-C3"),
    pytest.param(3, 6, 2, id="P<csa-window"),
    pytest.param(7, 5, 64, id="P<hca-window"),
    pytest.param(1, 9, 4, id="P1"),
    pytest.param(26, 1, 7, id="R1"),
]


@pytest.mark.parametrize("p,r,chunk", CASES)
def test_forward_equals_full_sequence_around_windows(p, r, chunk):
    model = _random_v4()
    prompt, response = tie_free_tokens(model, p, r, seed=4)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=chunk, block_size=4) as state:
            out = state.replay(response).logprobs
    assert (out - ref).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_exact_gradients_equal_full_sequence_around_windows(use_lora):
    """Exact mode, chunks of 3 (CSA windows of 4 and HCA windows of 8 span chunks), three responses of which one
    completes entries: parameter gradients equal naive full-sequence GRPO (rel ≤ `FP32_TOL`)."""
    model = _random_v4(use_lora)
    prompt = tokens(22, 5)
    responses = [tokens(n, 40 + n) for n in (6, 1, 3)]
    for rr in responses:
        assert_tie_free(model, torch.cat([prompt, rr]))
    adv = [0.9, -1.1, 0.5]
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(fn):
        for p in params:
            p.grad = None
        fn()
        return [None if p.grad is None else p.grad.clone() for p in params]

    def naive():
        for a, rr in zip(adv, responses):
            (a * full_sequence_logprobs(model, prompt, rr)).sum().backward()

    def exact():
        with longstraw.capture(model, prompt, chunk_size=3, prompt_grad="exact", block_size=4) as state:
            for a, rr in zip(adv, responses):
                (a * state.replay(rr).logprobs).sum().backward()
            state.backward()

    assert_grads_close(grads(exact), grads(naive), tol=FP32_TOL)


@pytest.mark.parametrize("rate", [0, 2.5])
def test_unhandled_compression_rate_is_refused(rate):
    model = make_model("deepseek_v4")
    # a new dict: the config's own is the family spec's (`longstraw.archs`), shared by every tiny model
    model.config.compress_rates = {**model.config.compress_rates, "heavily_compressed_attention": rate}
    with pytest.raises(ValueError, match="compress_rates\\['heavily_compressed_attention'\\]"):
        longstraw.capture(model, tokens(10, 1))


def test_no_tensor_spans_the_compressed_prompt():
    """At P = 1500 (374 CSA entries, more than any dimension of the tiny model), no tensor but the durable state
    and its views has a dimension of 374 or more: capture (chunks of 64) holds no chunk × entries indexer or
    attention scores, and a replay (forward and backward) no R × entries ones."""
    from ..kinds.test_latent_attention import _Outputs

    model = make_model("deepseek_v4", use_lora=True)
    p = 1500
    n = (p - 1) // 4
    with _Outputs() as capture_mode:
        state = longstraw.capture(model, tokens(p, 16), chunk_size=64, block_size=32)
    kept = [t for layer in state.layers for t in layer.tensors()]
    assert capture_mode.spanning(n, kept) == []
    with _Outputs() as replay_mode:
        state.replay(tokens(8, 17)).logprobs.sum().backward()
    assert replay_mode.spanning(n, kept) == []


def test_bf16_model_agrees_loosely():
    """bf16 weights: replay log-probs agree with the full-sequence forward to bf16's precision of the log-probs. Both
    pool and score in float32 but round projections differently (and so may select another entry where index scores
    nearly tie at bf16's rounding): each within its relative rounding 2^-8 of |log p| (≈ 5.5 here), the two within
    bf16's epsilon 2^-7 × the largest |log p| (≈ 0.045; measured 2.3e-2)."""
    model = longstraw.testing.models.tiny_model("deepseek_v4", dtype=torch.bfloat16)
    prompt, response = tokens(40, 1), tokens(7, 2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response).float()
        with longstraw.capture(model, prompt, chunk_size=6) as state:
            out = state.replay(response).logprobs
    assert (out - ref).abs().max().item() <= torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
