"""Every attention kernel against the plain reference kernel, at the kernel interface: (out, lse) and the
gradients (dq, dk, dv) given a merged output and a log-sum-exp gradient, on odd shapes, GQA / MQA, folded
sequences, windows, chunks, softcap, value dims that differ, 8-bit and host-resident keys.

The reference runs in float64 on the same inputs, so an error is the kernel's own rounding, held to `TOL` (the
dtype's epsilon × a growth stated there) relative to the largest reference value. CUDA cases carry the `cuda`
marker and skip without a GPU."""

import pytest
import torch

from longstraw.ops import kernels
from longstraw.ops.attention import reference_attention, split_attention
from longstraw.ops.kernels import KERNELS, Part
from longstraw.ops.quant import QuantizedTokens

# name: (B, H, Hkv, R, T, D, Dv, q_start, k_start, window, softcap, chunk, q_period, block)
PARTS = {
    "full-gqa-odd": (1, 4, 2, 7, 37, 16, 16, 40, 0, None, None, None, None, 8),
    "full-mqa-long": (1, 8, 1, 5, 300, 64, 64, 300, 0, None, None, None, None, 64),
    "full-folded-seqs": (1, 4, 2, 12, 50, 32, 32, 50, 0, None, None, None, 4, 16),
    "full-batch2": (2, 4, 4, 3, 19, 8, 8, 19, 0, None, None, None, None, 4),
    # decode steps: one position per sequence (8 sequences folded, or one), over keys every query sees
    "decode-folded": (1, 4, 2, 8, 300, 16, 16, 300, 0, None, None, None, 1, 32),
    "decode-one": (2, 6, 2, 1, 37, 32, 32, 40, 0, None, None, None, None, 8),
    "causal-own-gqa": (1, 6, 2, 9, 9, 16, 16, 40, 40, None, None, None, None, 4),
    "causal-d128": (2, 2, 2, 33, 33, 128, 128, 7, 7, None, None, None, None, 16),
    "window": (1, 4, 2, 6, 20, 16, 16, 20, 0, 8, None, None, None, 4),
    "softcap": (1, 4, 2, 5, 30, 16, 16, 30, 0, None, 20.0, None, None, 8),
    "chunk": (1, 4, 2, 6, 10, 8, 8, 10, 0, None, None, 8, None, 4),
    "dv-differs": (1, 4, 1, 5, 24, 24, 16, 24, 0, None, None, None, None, 8),
    # long windowed / chunked parts, walked in query tiles (`blockwise.query_tiles`: 256 rows here)
    "window-tiled-own": (1, 4, 2, 600, 600, 16, 16, 100, 100, 40, None, None, None, 32),
    "window-tiled-prompt": (1, 2, 1, 650, 700, 16, 16, 700, 0, 300, None, None, None, 64),
    "chunk-tiled-own": (1, 2, 2, 700, 700, 8, 8, 150, 150, None, None, 300, None, 64),
}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
#: a kernel's error against the float64 reference, relative to the largest reference value (at least 1). float32:
#: epsilon × 2^5 (3.8e-6): D ≤ 128-term logit dot products and sums over T ≤ 700 keys (and the CPU kernel's
#: exponential, within 2.5 epsilon: tests/ops/test_native_kernel.py), rounding errors adding at random as
#: √(128 + 700) ≈ 29 ≤ 2^5. bf16 / fp16: epsilon × 4: the fused kernels round the probabilities to the dtype for
#: P · V (≤ 2^-8 or 2^-11 of max |v| ≈ 4) and the output (once more): ≤ 5 half-epsilons < 8
TOL = {torch.float32: torch.finfo(torch.float32).eps * 2**5, torch.bfloat16: torch.finfo(torch.bfloat16).eps * 4,
       torch.float16: torch.finfo(torch.float16).eps * 4}
#: gradients: the backward chains three more reductions of the same lengths onto the forward's probabilities
#: (dO · Vᵀ, rowsum(dO ∘ O), then dq over the keys or dk, dv over the queries): √4 = 2 at random, × 2 for the
#: cancellation in dS = P ∘ (dP − rowsum(dO ∘ O))
GRAD_FACTOR = 4


def _inputs(name, device, dtype, seed=0):
    b, h, hkv, r, t, d, dv, qs, ks, window, softcap, chunk, period, block = PARTS[name]
    g = torch.Generator().manual_seed(seed + sum(map(ord, name)))

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    part = Part(qs, ks, window, softcap, d ** -0.5, block, period, chunk)
    q, k, v = rnd(b, h, r, d), rnd(b, hkv, t, d), rnd(b, hkv, t, dv)
    g_out, merged, g_lse = rnd(b, h, r, dv), rnd(b, h, r, dv), rnd(b, h, r).float()
    return q, k, v, part, g_out, merged, g_lse


def _ref(q, k, v, part, g_out, merged, g_lse, need_kv):
    d = [x.double() for x in (q, k, v, g_out, merged)]
    out, lse = KERNELS["reference"].forward(d[0], d[1], d[2], part)
    grads = KERNELS["reference"].backward(d[3], d[0], d[1], d[2], d[4], lse, part, need_kv,
                                          None if g_lse is None else g_lse.double())
    return out, lse, grads


def _close(got, want, tol, what):
    assert got.shape == want.shape, what
    got = got.double()
    inf = torch.isinf(want)  # a query that sees no key of the part: lse −inf, in the kernel as well
    assert (got[inf] == want[inf]).all(), f"{what}: {int((got[inf] != want[inf]).sum())} finite where the reference is inf"
    assert torch.isfinite(got[~inf]).all(), f"{what}: non-finite where the reference is finite"
    err = (got - want)[~inf].abs().max().item()
    bar = tol * max(1.0, want[~inf].abs().max().item())
    assert err <= bar, f"{what}: max error {err:.3g} > {bar:.3g}"


def _kernels_on(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return [k for k in KERNELS.values() if k.name in ("reference", "blockwise")
            or (getattr(k, "device_type", None) == device and k.available())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(PARTS))
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_equals_reference(device, name, dtype):
    ran = []
    for kernel in _kernels_on(device):
        q, k, v, part, g_out, merged, g_lse = _inputs(name, device, dtype)
        if kernel.why_not(q, k, v, part) is not None:
            with pytest.raises(ValueError, match=kernel.name), kernels.use(kernel.name):
                kernels.part_forward(q, k, v, part)
            continue
        fused = kernel.name not in ("reference", "blockwise")
        tol = TOL[dtype]
        out, lse = kernel.forward(q, k, v, part)
        r_out, r_lse, _ = _ref(q, k, v, part, g_out, merged, None, False)
        assert out.dtype == dtype and lse.dtype == torch.float32
        _close(out, r_out, tol, f"{kernel.name} out")
        _close(lse, r_lse, tol, f"{kernel.name} lse")
        for need_kv in (False, True):
            gl = None if fused else g_lse
            grads = (kernel.backward(g_out, q, k, v, merged, lse, part, need_kv) if fused
                     else kernel.backward(g_out, q, k, v, merged, lse, part, need_kv, gl))
            _, _, want = _ref(q, k, v, part, g_out, merged, gl, need_kv)
            for got, ref, what in zip(grads, want, ("dq", "dk", "dv")):
                if ref is None:
                    assert got is None
                    continue
                _close(got, ref, GRAD_FACTOR * tol, f"{kernel.name} {what} need_kv={need_kv}")
        ran.append(kernel.name)
    assert "reference" in ran and "blockwise" in ran


@pytest.mark.parametrize("window,chunk", [(512, None), (None, 1024)], ids=["window", "chunk"])
def test_windowed_part_reads_only_the_keys_its_query_tiles_see(window, chunk):
    """A capture chunk of R = 4,096 queries of a sliding-window (or chunked) layer, over its own keys and over
    4,096 earlier prompt keys, reads O(R · (W + tile + block)) key positions per query row, not R · T: the work
    that made a sliding-window capture chunk cost its square."""
    from longstraw.ops.kernels import blockwise

    r, t, block = 4096, 4096, 256
    span = window or chunk
    for q_start, k_start in ((4096, 4096), (4096, 0)):
        part = Part(q_start, k_start, window, None, 1.0, block, None, chunk)
        read = 0
        for i0, i1, sub in blockwise.query_tiles(part, r):
            read += sum((i1 - i0) * n for _, n, _ in blockwise.blocks(sub, i1 - i0, i1 - i0, t, "cpu"))
        tile = min(max(span, blockwise.QUERY_TILE[0]), blockwise.QUERY_TILE[1])
        assert read <= r * (span + tile + block), (q_start, k_start, read / r)


@pytest.mark.parametrize("device", DEVICES)
def test_chosen_kernels(device):
    """The choice table: fused where the part is mask-free, and on CPU where it has a window or an attention chunk
    (the flash kernel's mask); blockwise for a softcap, other masks, folded sequences under a window, float64."""
    _kernels_on(device)
    fused = {"cpu": "flash_cpu", "cuda": "flash_cuda"}[device]
    windowed = {"cpu": "flash_cpu", "cuda": "blockwise"}[device]
    for name, want in (("full-gqa-odd", fused), ("causal-own-gqa", fused), ("window", windowed),
                       ("softcap", "blockwise"), ("chunk", windowed), ("window-tiled-prompt", windowed),
                       ("dv-differs", "blockwise")):
        q, k, v, part, *_ = _inputs(name, device, torch.bfloat16)
        assert kernels.choose(q, k, v, part).name == want, name
    q, k, v, part, *_ = _inputs("full-gqa-odd", device, torch.float64)
    assert kernels.choose(q, k, v, part).name == "blockwise"
    q, k, v, part, *_ = _inputs("decode-folded", device, torch.float32)
    # a decode step's few query rows over keys every one sees: matrix products on the CPU
    assert kernels.choose(q, k, v, part).name == {"cpu": "gemm_cpu", "cuda": "efficient_cuda"}[device]
    # a replay's positions, or a decode step of more than 256 rows per key head: the SIMD kernel
    fp32 = {"cpu": "simd_cpu" if KERNELS["simd_cpu"].available() else "flash_cpu", "cuda": "efficient_cuda"}
    q2, k2, v2, part2, *_ = _inputs("full-gqa-odd", device, torch.float32)
    assert kernels.choose(q2, k2, v2, part2).name == fp32[device]
    assert kernels.choose(q.repeat(1, 1, 40, 1), k, v, part).name == fp32[device]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_quantized_keys_read_tile_by_tile(device, dtype):
    """An 8-bit prompt state: each fused kernel reads it one dequantized tile at a time and equals the
    reference over the same dequantized keys."""
    q, k, v, part, g_out, merged, _ = _inputs("full-mqa-long", device, dtype)
    qk = QuantizedTokens(k, k.shape[2], torch.int8, block=64)
    qv = QuantizedTokens(v, v.shape[2], torch.int8, block=64)
    qk.append(k), qv.append(v)
    kd, vd = qk.dequantize(), qv.dequantize()
    for kernel in _kernels_on(device):
        if kernel.why_not(q, qk, qv, part) is not None:
            continue
        out, lse = kernel.forward(q, qk, qv, part)
        r_out, r_lse, want = _ref(q, kd, vd, part, g_out, merged, None, False)
        _close(out, r_out, TOL[dtype], f"{kernel.name} out")
        _close(lse, r_lse, TOL[dtype], f"{kernel.name} lse")
        args = (g_out, q, qk, qv, merged, lse, part, False)
        dq = kernel.backward(*args)[0] if kernel.name not in ("reference", "blockwise") else kernel.backward(*args, None)[0]
        _close(dq, want[0], GRAD_FACTOR * TOL[dtype], f"{kernel.name} dq")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_host_resident_keys_stream_to_the_gpu(dtype):
    """Keys and values in pinned host memory: the fused CUDA kernels stream them tile by tile."""
    q, k, v, part, g_out, merged, _ = _inputs("full-mqa-long", "cuda", dtype)
    hk, hv = k.cpu().pin_memory(), v.cpu().pin_memory()
    for kernel in _kernels_on("cuda"):
        if kernel.why_not(q, hk, hv, part) is not None:
            continue
        out, lse = kernel.forward(q, hk, hv, part)
        r_out, r_lse, want = _ref(q, k, v, part, g_out, merged, None, False)
        _close(out, r_out, TOL[dtype], f"{kernel.name} out")
        args = (g_out, q, hk, hv, merged, lse, part, False)
        dq = kernel.backward(*args)[0] if kernel.name not in ("reference", "blockwise") else kernel.backward(*args, None)[0]
        _close(dq, want[0], GRAD_FACTOR * TOL[dtype], f"{kernel.name} dq")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 30.0)], ids=["full", "window", "softcap"])
def test_split_attention_bf16_on_device(device, window, softcap):
    """The automatic choice end to end (split + merge + backward) in bf16 against the float64 reference on the same
    bf16 inputs: the output within `TOL`, the gradients within twice that (bf16 gradients: the fused kernels' bf16
    rounding of dS and of the result, for the output's gradient through each part)."""
    _kernels_on(device)
    g = torch.Generator().manual_seed(11)
    h, hkv, r, p, d = 8, 2, 17, 300, 64
    x = [torch.randn(*s, generator=g, dtype=torch.float64) for s in
         [(1, h, r, d), (1, hkv, r, d), (1, hkv, r, d), (1, hkv, p, d), (1, hkv, p, d)]]
    dev = [t.to(device=device, dtype=torch.bfloat16).requires_grad_() for t in x]
    out = split_attention(*dev, q_start=p, own_start=p, window=window, softcap=softcap, block=64)
    ref_in = [t.detach().double().cpu().requires_grad_() for t in dev]
    ref = reference_attention(ref_in[0], torch.cat([ref_in[3], ref_in[1]], 2), torch.cat([ref_in[4], ref_in[2]], 2),
                              p, 0, window=window, softcap=softcap)
    _close(out.cpu(), ref, TOL[torch.bfloat16], "out")
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.float() * w.to(device, torch.float32)).sum(), dev)
    want = torch.autograd.grad((ref * w).sum(), ref_in)
    for a, b, what in zip(got, want, ("dq", "dk_own", "dv_own", "dk_prompt", "dv_prompt")):
        _close(a.cpu(), b, 2 * TOL[torch.bfloat16], what)


@pytest.mark.parametrize("name", ["window-tiled-own", "window-tiled-prompt", "chunk-tiled-own"])
def test_masked_cpu_tiles_split_to_bound_their_mask(name, monkeypatch):
    """The CPU flash kernel's long windowed and chunked parts with the mask's element bound cut to 2,048: each tile's
    rows split into tiles of 16 (the smallest), every mask within the bound or of at most 16 rows, and out, lse,
    dq, dk, dv still the reference's (`TOL`)."""
    from longstraw.ops.kernels import fused

    monkeypatch.setattr(fused, "TILE_ELEMENTS", 2048)
    kernel = KERNELS["flash_cpu"]
    if not kernel.available():
        pytest.skip("no CPU flash kernel in this torch build")
    sizes = []
    raw = kernel.raw_masked_forward

    def recording(q, k, v, bias, scale):
        sizes.append((q.shape[2], bias.numel()))
        return raw(q, k, v, bias, scale)

    monkeypatch.setattr(kernel, "raw_masked_forward", recording)
    q, k, v, part, g_out, merged, _ = _inputs(name, "cpu", torch.float32)
    out, lse = kernel.forward(q, k, v, part)
    r_out, r_lse, want = _ref(q, k, v, part, g_out, merged, None, True)
    g = q.shape[1] // k.shape[1]
    assert sizes and all(n <= 2048 or rows <= 16 * g for rows, n in sizes), sizes
    assert len(sizes) > 1
    _close(out, r_out, TOL[torch.float32], "out")
    _close(lse, r_lse, TOL[torch.float32], "lse")
    for got, ref, what in zip(kernel.backward(g_out, q, k, v, merged, lse, part, True), want, ("dq", "dk", "dv")):
        _close(got, ref, GRAD_FACTOR * TOL[torch.float32], what)


@pytest.mark.parametrize("name", ["decode-folded", "decode-one"])
def test_gemm_cpu_over_several_key_tiles(name, monkeypatch):
    """`gemm_cpu` with tiles of a few keys (`TILE_ELEMENTS` lowered: 5-6 tiles, the last one short): the tiles'
    outputs merged by log-sum-exp and their dq / dk / dv summed or placed give the float64 reference (`TOL`, the
    gradients `GRAD_FACTOR` × it), as one tile does in `test_kernel_equals_reference`."""
    from longstraw.ops.kernels import gemm

    q, k, v, part, g_out, merged, _ = _inputs(name, "cpu", torch.float32)
    rows, heads = (q.shape[1] // k.shape[1]) * q.shape[2], q.shape[0] * k.shape[1]
    monkeypatch.setattr(gemm, "TILE_ELEMENTS", heads * rows * max(1, k.shape[2] // 5))
    kernel = KERNELS["gemm_cpu"]
    assert kernel.why_not(q, k, v, part) is None
    assert k.shape[2] > gemm.GemmCPU._tile(heads, rows, k.shape[2], part.block)  # several tiles
    out, lse = kernel.forward(q, k, v, part)
    r_out, r_lse, _ = _ref(q, k, v, part, g_out, merged, None, False)
    _close(out, r_out, TOL[torch.float32], "out")
    _close(lse, r_lse, TOL[torch.float32], "lse")
    for need_kv in (False, True):
        got = kernel.backward(g_out, q, k, v, merged, lse, part, need_kv)
        _, _, want = _ref(q, k, v, part, g_out, merged, None, need_kv)
        for a, b, what in zip(got, want, ("dq", "dk", "dv")):
            if b is None:
                assert a is None
                continue
            _close(a, b, GRAD_FACTOR * TOL[torch.float32], f"{what} need_kv={need_kv}")


def test_windowed_masks_kept_are_the_masks_built_anew():
    """`MaskCache` keeps a windowed tile's mask by what it depends on: every tile a sequence of parts asks for (windows,
    attention chunks, folded rows of several sequences, queries before and after the keys, the same rows at other
    offsets) gets the mask built from its own positions by `part.visible`, whatever the cache held before."""
    from longstraw.ops.kernels.fused import MaskCache
    from longstraw.ops.kernels.part import visible

    cache = MaskCache(entries=3)
    g = torch.Generator().manual_seed(0)
    asked = 0
    for _ in range(200):
        window = [4, 7, None][int(torch.randint(3, (1,), generator=g))]
        chunk = None if window is not None else 6
        rows = [5, 10][int(torch.randint(2, (1,), generator=g))]
        q_start, k_start = (int(x) for x in torch.randint(0, 12, (2,), generator=g))
        first = int(torch.randint(0, 4, (1,), generator=g))
        end = first + int(torch.randint(1, 9, (1,), generator=g))
        # the same tile with its rows consecutive, then folded from two sequences; then all of it one position on
        for period, shift in ((None, 0), (5, 0), (None, 1), (5, 1)):
            part = Part(q_start=q_start + shift, k_start=k_start % 4 + shift, window=window, softcap=None, scale=1.0,
                        block=4, q_period=period, chunk=chunk)
            bias, seen = cache.get(part, rows, first, end, 2, torch.float32, "cpu")
            vis = visible(part, rows, first, end - first, "cpu")
            vis = torch.ones(rows, end - first, dtype=torch.bool) if vis is None else vis
            want = torch.zeros(vis.shape).masked_fill_(~vis, float("-inf")).repeat(2, 1)
            assert torch.equal(bias, want) and torch.equal(seen, vis.any(-1))
            asked += 1
    assert asked == 800 and len(cache.kept) == 3
