"""Split attention (both kernels) against the plain masked-softmax reference: values and gradients."""

import pytest
import torch

from longstraw.ops import kernels
from longstraw.ops.attention import reference_attention, split_attention

# (heads, kv_heads, R, P, head_dim, v_dim, block, window, softcap)
CASES = [
    pytest.param(4, 2, 7, 13, 5, 5, 4, None, None, id="gqa-odd-P>block"),
    pytest.param(4, 4, 1, 1, 8, 8, 16, None, None, id="mha-R1-P1"),
    pytest.param(6, 2, 9, 100, 16, 16, 32, None, None, id="gqa3-P>>block"),
    pytest.param(4, 2, 9, 5, 16, 16, 32, None, None, id="P<block"),
    pytest.param(4, 1, 5, 3, 4, 4, 2, None, 30.0, id="mqa-softcap"),
    pytest.param(2, 2, 20, 0, 8, 8, 4, 6, None, id="no-prompt-window"),
    pytest.param(6, 2, 9, 100, 16, 16, 32, 11, None, id="window-within-prompt"),
    pytest.param(4, 2, 3, 50, 8, 8, 16, 4, None, id="window-R<W"),
    pytest.param(4, 2, 63, 37, 16, 12, 8, None, None, id="R63-Dv12"),
]

#: split attention against the plain reference in the same dtype, relative and absolute (unit-normal inputs, values
#: of order 1): the dtype's epsilon × 2^4. Each side rounds D ≤ 16-term logit dot products and sums over ≤ 109 keys
#: in its own order (key blocks, online rescaling); rounding errors adding at random grow as √(16 + 109) ≈ 11 ≤ 2^4
VALUE_GROWTH = 2**4
#: gradients: 4 × more. The backward chains three more reductions of the same lengths onto the forward's
#: probabilities (dO · Vᵀ, rowsum(dO ∘ O), then dq over the keys or dk, dv over the ≤ 63 queries): √4 = 2 at random,
#: × 2 for the cancellation in dS = P ∘ (dP − rowsum(dO ∘ O))
GRAD_GROWTH = VALUE_GROWTH * 4
#: bf16 inputs against the float32 reference on the unrounded inputs: 4 roundings to bf16 of ≤ 2^-8 each (q, k, v and
#: the output), × 2 for logits q · k / √D of up to ~2 that carry q's and k's relative error into the weights:
#: 2^-8 × 8 = bf16's epsilon × 4 (3.1e-2)
BF16_TOL = torch.finfo(torch.bfloat16).eps * 4


def tol(dtype, growth: int = VALUE_GROWTH) -> float:
    """`growth` × the dtype's epsilon (see `VALUE_GROWTH`, `GRAD_GROWTH`)."""
    return torch.finfo(dtype).eps * growth


def _run(dtype, h, hkv, r, p, d, dv, block, window, softcap):
    g = torch.Generator().manual_seed(h * 1000 + r * 10 + p)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    q, kp, vp, ko, vo = rnd(1, h, r, d), rnd(1, hkv, p, d), rnd(1, hkv, p, dv), rnd(1, hkv, r, d), rnd(1, hkv, r, dv)
    out = split_attention(q, ko, vo, kp, vp, q_start=p, own_start=p, prompt_start=0, window=window,
                          softcap=softcap, block=block)
    ref = reference_attention(q, torch.cat([kp, ko], 2), torch.cat([vp, vo], 2), p, 0, window=window, softcap=softcap)
    w = torch.randn(ref.shape, generator=g, dtype=dtype)
    inputs = [q, kp, vp, ko, vo]
    g_out = torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs, allow_unused=True)
    return out, ref, g_out, g_ref


@pytest.mark.parametrize("h,hkv,r,p,d,dv,block,window,softcap", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_split_attention_matches_reference(dtype, h, hkv, r, p, d, dv, block, window, softcap):
    out, ref, g_out, g_ref = _run(dtype, h, hkv, r, p, d, dv, block, window, softcap)
    torch.testing.assert_close(out, ref, atol=tol(dtype), rtol=tol(dtype))
    for a, b in zip(g_out, g_ref):
        if b is None or p == 0 and a is None:
            continue
        torch.testing.assert_close(a, b, atol=tol(dtype, GRAD_GROWTH), rtol=tol(dtype, GRAD_GROWTH))


@pytest.mark.parametrize("h,hkv,r,p,d,dv,block,window,softcap", CASES[:4] + CASES[-1:])
def test_blockwise_kernel_matches_reference_without_flash(h, hkv, r, p, d, dv, block, window, softcap):
    """The portable kernel alone (as on devices without a fused kernel)."""
    with kernels.use("blockwise"):
        out, ref, g_out, g_ref = _run(torch.float32, h, hkv, r, p, d, dv, block, window, softcap)
    torch.testing.assert_close(out, ref, atol=tol(torch.float32), rtol=tol(torch.float32))
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=tol(torch.float32, GRAD_GROWTH), rtol=tol(torch.float32, GRAD_GROWTH))


def test_bf16_close_to_fp32_reference():
    g = torch.Generator().manual_seed(3)
    q, kp, vp, ko, vo = (torch.randn(*s, generator=g) for s in [(1, 4, 9, 16), (1, 2, 40, 16), (1, 2, 40, 16),
                                                                 (1, 2, 9, 16), (1, 2, 9, 16)])
    ref = reference_attention(q, torch.cat([kp, ko], 2), torch.cat([vp, vo], 2), 40, 0)
    out = split_attention(*(t.bfloat16() for t in (q, ko, vo, kp, vp)), q_start=40, own_start=40, block=8)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=BF16_TOL, rtol=BF16_TOL)


def test_graph_holds_no_prompt_sized_tensor_but_the_prompt_itself():
    """Saved for backward: references to the prompt K/V (same storage), nothing of size R×P."""
    h, hkv, r, p, d = 4, 2, 6, 500, 8
    q = torch.randn(1, h, r, d, requires_grad=True)
    ko, vo = torch.randn(1, hkv, r, d, requires_grad=True), torch.randn(1, hkv, r, d, requires_grad=True)
    kp, vp = torch.randn(1, hkv, p, d), torch.randn(1, hkv, p, d)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = split_attention(q, ko, vo, kp, vp, q_start=p, own_start=p, block=64)
    prompt_ptrs = {kp.data_ptr(), vp.data_ptr()}
    for t in saved:
        if t.data_ptr() in prompt_ptrs:
            continue
        assert t.numel() < r * p, f"saved tensor {tuple(t.shape)} is of prompt size"
    assert any(t.data_ptr() in prompt_ptrs for t in saved)
    out.sum().backward()
    assert q.grad is not None and kp.grad is None


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window"])
def test_shared_prompt_serves_a_batch(window):
    """Queries of B sequences against one batch-1 prompt K/V equal B separate computations."""
    g = torch.Generator().manual_seed(5)
    b, h, hkv, r, p, d = 3, 4, 2, 2, 30, 8
    q = torch.randn(b, h, r, d, generator=g, requires_grad=True)
    ko, vo = torch.randn(b, hkv, r, d, generator=g), torch.randn(b, hkv, r, d, generator=g)
    kp = torch.randn(1, hkv, p, d, generator=g, requires_grad=True)
    vp = torch.randn(1, hkv, p, d, generator=g, requires_grad=True)
    out = split_attention(q, ko, vo, kp, vp, q_start=p, own_start=p, window=window, block=8)
    ref = torch.cat([reference_attention(q[i : i + 1], torch.cat([kp, ko[i : i + 1]], 2),
                                         torch.cat([vp, vo[i : i + 1]], 2), p, 0, window=window) for i in range(b)])
    torch.testing.assert_close(out, ref, atol=tol(torch.float32), rtol=tol(torch.float32))
    w = torch.randn(ref.shape, generator=g)
    ga = torch.autograd.grad((out * w).sum(), [q, kp, vp])
    gb = torch.autograd.grad((ref * w).sum(), [q, kp, vp])
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=tol(torch.float32, GRAD_GROWTH), rtol=tol(torch.float32, GRAD_GROWTH))


# (heads, kv_heads, R, P, first prompt key kept, chunk, window, sinks): chunked local attention keeps only
# the keys of the prompt's last unfinished chunk; sinks add a learned logit per head to the denominator.
VARIANTS = [
    pytest.param(4, 2, 6, 10, 8, 4, None, False, id="chunk4-R-crosses-chunks"),
    pytest.param(4, 2, 3, 9, 8, 4, None, False, id="chunk4-P-on-boundary"),
    pytest.param(2, 1, 9, 30, 24, 8, None, True, id="chunk8-sinks"),
    pytest.param(4, 2, 7, 13, 0, None, None, True, id="sinks-full"),
    pytest.param(4, 4, 5, 20, 16, None, 5, True, id="sinks-window5"),
    pytest.param(4, 2, 1, 1, 0, None, None, True, id="sinks-R1-P1"),
    pytest.param(4, 2, 5, 0, 0, 3, None, True, id="chunk3-no-prompt"),
]


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "blockwise"])
@pytest.mark.parametrize("h,hkv,r,p,keep_from,chunk,window,use_sinks", VARIANTS)
def test_chunked_attention_and_sinks_match_reference(flash, h, hkv, r, p, keep_from, chunk, window, use_sinks):
    """Values and gradients (sinks included) against the plain softmax over all keys with the same mask."""
    with kernels.use(None if flash else "blockwise"):
        _variant(h, hkv, r, p, keep_from, chunk, window, use_sinks)


def _variant(h, hkv, r, p, keep_from, chunk, window, use_sinks):
    g = torch.Generator().manual_seed(r * 100 + p)
    dtype = torch.float64

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    q, kp, vp, ko, vo = rnd(1, h, r, 8), rnd(1, hkv, p, 8), rnd(1, hkv, p, 8), rnd(1, hkv, r, 8), rnd(1, hkv, r, 8)
    sinks = rnd(h) if use_sinks else None
    out = split_attention(q, ko, vo, kp[:, :, keep_from:], vp[:, :, keep_from:], q_start=p, own_start=p,
                          prompt_start=keep_from, window=window, chunk=chunk, sinks=sinks, block=4)
    ref = reference_attention(q, torch.cat([kp, ko], 2), torch.cat([vp, vo], 2), p, 0, window=window, chunk=chunk,
                              sinks=sinks)
    torch.testing.assert_close(out, ref, atol=tol(dtype), rtol=tol(dtype))
    w = torch.randn(ref.shape, generator=g, dtype=dtype)
    inputs = [t for t in (q, kp, vp, ko, vo, sinks) if t is not None]
    g_out = torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs, allow_unused=True)
    for a, b in zip(g_out, g_ref):
        if a is None:  # prompt keys before the kept chunk: not read; masked to probability exp(−inf) = 0 in the
            assert b is None or b.numel() == 0 or b.abs().max() == 0  # reference, so their gradient is exactly 0
            continue
        torch.testing.assert_close(a, b, atol=tol(dtype, GRAD_GROWTH), rtol=tol(dtype, GRAD_GROWTH))


@pytest.mark.parametrize("kernel,window,use_sinks", [
    ("flash_cpu", None, False), ("flash_cpu", None, True), ("flash_cpu", 9, False),  # a window: the kernel's mask
    ("blockwise", None, False), ("blockwise", 9, False), ("blockwise", None, True)])
def test_a_carried_part_equals_attention_over_the_concatenated_keys(kernel, window, use_sinks):
    """A segmented replay's earlier own K/V passed as a part of their own (`split_attention(carried=...)`): output
    and every input's gradient (queries, own, carried and prompt K/V, sinks) equal `reference_attention` over
    [prompt | carried | own] concatenated. Blockwise in float64 (bound 1e-10: float64's rounding); the fused CPU
    kernel, which serves float32 only, in float32 (bound 64 float32 eps relative to the largest value: sums of at
    most 25 terms per element, rounded a few times each)."""
    torch.manual_seed(0)
    dtype = torch.float64 if kernel == "blockwise" else torch.float32
    h, hkv, d, p, c, r = 4, 2, 8, 11, 7, 5
    q = torch.randn(1, h, r, d, dtype=dtype, requires_grad=True)
    pk, pv, ck, cv, ok, ov = (torch.randn(1, hkv, n, d, dtype=dtype, requires_grad=True) for n in (p, p, c, c, r, r))
    sinks = torch.randn(h, dtype=dtype, requires_grad=True) if use_sinks else None
    g = torch.randn(1, h, r, d, dtype=dtype)
    with kernels.use(kernel):
        got = split_attention(q, ok, ov, pk, pv, q_start=p + c, own_start=p + c, window=window, sinks=sinks, block=4,
                              carried=(ck, cv, p))
    ref = [t.detach().double().requires_grad_(True) for t in (q, pk, pv, ck, cv, ok, ov)]
    ref_sinks = None if sinks is None else sinks.detach().double().requires_grad_(True)
    want = reference_attention(ref[0], torch.cat([ref[1], ref[3], ref[5]], 2), torch.cat([ref[2], ref[4], ref[6]], 2),
                               q_start=p + c, k_start=0, window=window, sinks=ref_sinks)
    inputs = [q, pk, pv, ck, cv, ok, ov] + ([sinks] if use_sinks else [])
    g_got = torch.autograd.grad(got, inputs, g)
    g_want = torch.autograd.grad(want, ref + ([ref_sinks] if use_sinks else []), g.double())
    for a, b in [(got, want), *zip(g_got, g_want)]:
        tol = 1e-10 if dtype == torch.float64 else 64 * torch.finfo(torch.float32).eps * max(b.abs().max().item(), 1)
        assert (a.double() - b).abs().max().item() <= tol
