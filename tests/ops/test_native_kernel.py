"""longstraw's compiled CPU kernel (`longstraw.ops.kernels.native`, `simd_cpu`) against a float64 softmax: many key
tiles, rows that do not fill a register block, keys read in place from a view into a longer cache, several
threads; the build on a machine with a compiler; the fallback to PyTorch's kernel without it."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longstraw.ops import kernels
from longstraw.ops.kernels import native
from longstraw.ops.kernels.part import Part

HAS_COMPILER = any(shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++"))


def test_builds_where_a_compiler_is_at_hand():
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the kernel is unavailable and PyTorch's is used")
    assert native.why_unavailable() is None


def test_exponential_is_float32_accurate_and_flushes_to_zero():
    if native.why_unavailable() is not None:
        pytest.skip(native.why_unavailable())
    # every region of the range reduction: integers, half-integers (where the rounding of n flips), the flush edge
    x = torch.cat([-torch.rand(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 130,
                   -torch.arange(0, 127, 0.5, dtype=torch.float64), torch.tensor([-126.4999, -126.5001, -1e-30, 0.0]),
                   torch.full((10,), -float("inf"), dtype=torch.float64)]).float()
    x = torch.cat([x, torch.zeros(-x.numel() % 16)])
    got, want = native.exp2_neg(x).double(), torch.exp2(x.double())
    normal = x >= -126
    rel = ((got - want).abs() / want)[normal].max().item()
    # a few float32 roundings (6e-8 each) over the polynomial's own 7.5e-8; a degree-4 polynomial gives 2.6e-6
    assert rel < 3e-7, f"relative error {rel:.3g}"
    assert (got[x < -126.5] == 0).all()


def _softmax(q, k, v, scale, dtype):
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    return torch.softmax(s, -1) @ v.to(dtype), torch.logsumexp(s, -1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,t,d,dv", [(37, 1000, 16, 16), (9, 129, 32, 64), (130, 300, 64, 32), (1, 1, 5, 16)])
def test_equals_float64_softmax(rows, t, d, dv, threads):
    if native.why_unavailable() is not None:
        pytest.skip(native.why_unavailable())
    g = torch.Generator().manual_seed(rows + t + d)
    q = torch.randn(1, 3, rows, d, generator=g) * 3  # peaked softmax: the running maximum moves across tiles
    # keys and values read in place from caches longer than the part, tokens-major (row stride H·D)
    k = torch.randn(1, t + 50, 3, d, generator=g).transpose(1, 2)[:, :, :t]
    v = torch.randn(1, t + 50, 3, dv, generator=g).transpose(1, 2)[:, :, :t]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = native.attend_full(q, k, v, d ** -0.5)
    finally:
        torch.set_num_threads(old)
    want_out, want_lse = _softmax(q, k, v, d ** -0.5, torch.float64)
    # within float32's own error: that of the plain float32 softmax on the same inputs, with a margin for the order
    # of summation
    f32_out, f32_lse = _softmax(q, k, v, d ** -0.5, torch.float32)
    for got, want, f32 in ((out, want_out, f32_out), (lse, want_lse, f32_lse)):
        err, bar = (got.double() - want).abs().max().item(), 3 * (f32.double() - want).abs().max().item() + 1e-6
        assert err <= bar, f"error {err:.3g} > {bar:.3g}"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which("objdump"),
                    reason="x86-64 with objdump only")
def test_avx2_build_has_no_avx512_instruction_and_equals_float64(tmp_path):
    """The build a machine without AVX-512 gets (`LONGSTRAW_NATIVE_ARCH=x86-64-v3`: AVX2 + FMA), made and run on this
    one: its machine code names no 512-bit register (objdump), and it computes the float64 softmax within float32's
    error, as `test_equals_float64_softmax` bounds it. (The second test pass of `.ci/run` runs this whole file on
    that build.)"""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    code = ("import torch; from longstraw.ops.kernels import native; "
            "from tests.ops.test_native_kernel import _softmax; "
            "print(native.why_unavailable()); print(native.library_path()); g = torch.Generator().manual_seed(0); "
            "q, k, v = (torch.randn(1, 2, n, 32, generator=g) * s for n, s in ((19, 3), (700, 1), (700, 1))); "
            "out, lse = native.attend_full(q, k, v, 32 ** -0.5); "
            "w64, w32 = _softmax(q, k, v, 32 ** -0.5, torch.float64), _softmax(q, k, v, 32 ** -0.5, torch.float32); "
            "print(max((a.double() - b).abs().max().item() - 3 * (c.double() - b).abs().max().item() - 1e-6 "
            "for a, b, c in zip((out, lse), w64, w32)))")
    env = {**os.environ, "LONGSTRAW_NATIVE_ARCH": "x86-64-v3", "LONGSTRAW_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])  # the repository root: `tests` importable
    assert res.returncode == 0, res.stderr
    why, path, excess = res.stdout.split("\n")[:3]
    assert why == "None" and path.startswith(str(tmp_path)), res.stdout
    assert float(excess) <= 0, f"error beyond float32's bound by {excess}"
    asm = subprocess.run(["objdump", "-d", path], capture_output=True, text=True, timeout=120).stdout
    assert "ymm" in asm and "zmm" not in asm


def test_chosen_for_prompt_parts_and_refused_where_it_cannot():
    if native.why_unavailable() is not None:
        pytest.skip(native.why_unavailable())
    part = Part(q_start=40, k_start=0, window=None, softcap=None, scale=0.25, block=16)
    # a replay's 5 positions (a decode step's single position is gemm_cpu's)
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    assert kernels.choose(q, k, v, part).name == "simd_cpu"
    assert kernels.choose(q[:, :, :1], k, v, part).name == "gemm_cpu"
    assert kernels.choose(q.bfloat16(), k.bfloat16(), v.bfloat16(), part).name == "flash_cpu"
    with pytest.raises(ValueError, match="simd_cpu"), kernels.use("simd_cpu"):
        kernels.part_forward(q[..., :12], k[..., :12], v[..., :12], part)  # value dim 12: not a multiple of 16


def test_without_it_the_choice_falls_back_to_pytorch():
    code = ("import torch; from longstraw.ops import kernels; from longstraw.ops.kernels import native; "
            "from longstraw.ops.kernels.part import Part; "
            "p = Part(40, 0, None, None, 0.25, 16); q = torch.randn(1, 2, 3, 16); k = torch.randn(1, 2, 40, 16); "
            "print(native.why_unavailable()); print(kernels.choose(q, k, k, p).name)")
    env = {**os.environ, "LONGSTRAW_NATIVE": "0"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["disabled by LONGSTRAW_NATIVE=0", "flash_cpu"]


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("h,rows,t,d,dv", [(2, 37, 1000, 16, 16), (1, 9, 330, 32, 64)])
def test_8bit_state_read_in_place_equals_the_dequantized_attention(qdtype, h, rows, t, d, dv):
    """An 8-bit state's whole blocks, decoded inside the kernel, give the float32 attention over its dequantized
    values (the unfinished tail excluded: the caller's)."""
    if native.why_unavailable() is not None:
        pytest.skip(native.why_unavailable())
    from longstraw.ops.quant import QuantizedTokens

    g = torch.Generator().manual_seed(t + d)
    k, v = torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, dv, generator=g) * 3
    q = torch.randn(1, h, rows, d, generator=g) * 3
    qk, qv = QuantizedTokens(k, t, qdtype), QuantizedTokens(v, t, qdtype)
    for s in range(0, t, 300):  # appended in pieces, as capture does
        qk.append(k[:, :, s : s + 300]), qv.append(v[:, :, s : s + 300])
    n = qk.quantized
    assert 0 < n < t
    out, lse = native.attend_full_8bit(q, qk, qv, d ** -0.5)
    kd, vd = qk.dequantize(torch.float32)[:, :, :n], qv.dequantize(torch.float32)[:, :, :n]
    want_out, want_lse = _softmax(q, kd, vd, d ** -0.5, torch.float64)
    f32_out, f32_lse = _softmax(q, kd, vd, d ** -0.5, torch.float32)
    for got, want, f32 in ((out, want_out, f32_out), (lse, want_lse, f32_lse)):
        err, bar = (got.double() - want).abs().max().item(), 3 * (f32.double() - want).abs().max().item() + 1e-6
        assert err <= bar, f"error {err:.3g} > {bar:.3g}"


def test_capture_and_sampling_read_an_8bit_state_in_place(monkeypatch):
    """With an fp8 state, the prompt part of capture's later chunks and of every decode step is read by the kernel
    in place: nothing dequantizes more than the unfinished tail (< one block of 64 tokens)."""
    if native.why_unavailable() is not None:
        pytest.skip(native.why_unavailable())
    import longstraw
    from longstraw.ops import quant

    from ..conftest import make_model, tokens

    calls, reads = [], []
    real_8bit, real_read = native.attend_full_8bit, quant.QuantizedTokens.read
    monkeypatch.setattr(native, "attend_full_8bit", lambda q, k, *a: calls.append(k.quantized) or real_8bit(q, k, *a))
    monkeypatch.setattr(quant.QuantizedTokens, "read", lambda self, s, n, *a: reads.append(n) or real_read(self, s, n, *a))
    model = make_model("llama")
    with torch.no_grad():
        state = longstraw.capture(model, tokens(300, 1), chunk_size=100, state_dtype="fp8")
        state.sample(num=2, max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    assert calls and max(calls) == 256 and max(reads) < 64
