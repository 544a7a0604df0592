"""longstraw's compiled CPU attention kernel (`longstraw/ops/kernels/csrc/attend_cpu.cpp`), built on first use, loaded
with ctypes.

What it computes: one mask-free part — every query sees every key — in float32: `out = softmax(q kᵀ · scale) v`
and the log-sum-exp per query row, with an online softmax over tiles of 256 keys (transient per thread: one tile of
scores, 8 × 256 floats, and the tile's keys transposed; of an 8-bit state, the tile's keys and values decoded).
At head dims 16–128 it is 1.13–1.35× PyTorch's fused CPU flash attention per core (`bench/cpu_kernel.py`): its
score and value products keep 8 query rows × 32 keys (resp. 8 rows × 16 value dims) in vector registers.

How it is built: once per kind of machine, with the C++ compiler at hand (`$CXX`, else `c++` or `g++`) and `-O3
-march=native` (`$LONGSTRAW_NATIVE_ARCH` names another target: `x86-64-v3` builds the AVX2 + FMA code a machine without
AVX-512 gets, so that build is tested on any x86-64 machine; see `tests/ops/test_native_kernel.py`), into
`$LONGSTRAW_CACHE` (default `~/.cache/longstraw`, else a folder in the temporary directory) under a name that hashes
the source, the flags, the compiler's version and the CPU's model and feature flags (a home folder shared by different
machines keeps one build per CPU kind). Written under a temporary name and renamed, so concurrent processes (torchrun
ranks) never load a half-written library. Without a compiler, with a failed build, or with `LONGSTRAW_NATIVE=0`, the
kernel is unavailable (`why_unavailable()` says why) and `longstraw.ops.kernels` uses PyTorch's kernels: nothing else
changes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ...paths import cache_dir

SOURCE = Path(__file__).with_name("csrc") / "attend_cpu.cpp"
#: compiler flags besides `-march` (`-Wno-psabi`: the 64-byte vector type changes the ABI of the kernel's internal
#: inline helpers below AVX-512, which nothing outside the library calls)
FLAGS = ["-O3", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wno-psabi"]
#: value dims are walked 16 floats per vector
VALUE_DIM_MULTIPLE = 16

_lock = threading.Lock()
_state: dict = {}


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))


def target_arch() -> str:
    """The `-march` target of the build: `$LONGSTRAW_NATIVE_ARCH`, else `native` (this CPU's instruction set)."""
    return os.environ.get("LONGSTRAW_NATIVE_ARCH") or "native"


def library_path() -> Path | None:
    """Where the loaded library lies (None while it is unavailable); builds it on the first call."""
    _library()
    return _state.get("path")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("LONGSTRAW_NATIVE", "1") == "0":
        return None, "disabled by LONGSTRAW_NATIVE=0"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found ($CXX, c++, g++, clang++)"
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{cxx} --version failed: {err}"
    flags = [f"-march={target_arch()}", *FLAGS]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), version, _cpu_signature()]).encode())
    try:
        cache = cache_dir()
    except OSError as err:
        return None, str(err)
    target = cache / f"attend_cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            res = subprocess.run([cxx, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                return None, f"building {SOURCE.name} failed: {res.stderr.strip()[-2000:]}"
            os.replace(tmp, target)
            tmp = None
        except (OSError, subprocess.SubprocessError) as err:
            return None, f"building {SOURCE.name} failed: {err}"
        finally:
            if tmp is not None and os.path.exists(tmp):  # a failed or interrupted build leaves no partial file
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return None, f"loading {target} failed: {err}"
    fn = lib.longstraw_attend_full
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 11 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.longstraw_attend_full_8bit
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 14 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.longstraw_attend_full_dq
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 15 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    fn = lib.longstraw_exp2_neg
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = ctypes.c_int
    _state["path"] = target
    return lib, None


def _library() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _build()
        return _state["lib"]


def _loaded() -> ctypes.CDLL:
    """The loaded library, else RuntimeError saying why it is unavailable."""
    lib = _library()
    if lib is None:
        raise RuntimeError(f"longstraw's CPU attention kernel is unavailable: {_state['why']}")
    return lib


def why_unavailable() -> str | None:
    """None when the kernel is built and loaded, else why it is not (building it on the first call)."""
    _library()
    return _state["why"]


_LUTS: dict = {}


def _lut(dtype: torch.dtype) -> torch.Tensor:
    """Code (0-255) → float32 value of an 8-bit dtype, as torch converts it."""
    if dtype not in _LUTS:
        _LUTS[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).float().contiguous()
    return _LUTS[dtype]


def exp2_neg(x: torch.Tensor) -> torch.Tensor:
    """The kernel's softmax exponential 2^x, elementwise, of a float32 CPU tensor of values ≤ 0 (numel a multiple
    of 16): 0 below 2^-126.5 and at −inf. Exposed for tests of its accuracy."""
    lib = _loaded()
    x = x.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    if lib.longstraw_exp2_neg(x.data_ptr(), y.data_ptr(), x.numel()) != 0:
        raise ValueError(f"numel {x.numel()} is not a multiple of 16")
    return y


def attend_full_8bit(q: torch.Tensor, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_full` over the whole blocks of an 8-bit state (`longstraw.ops.quant.QuantizedTokens` `k`, `v` on the
    CPU: tokens 0 … `k.quantized` − 1; the unfinished tail is the caller's), read where it lies: each tile of 256
    keys is decoded into float32 as `QuantizedTokens.read` dequantizes it (code value × block scale), so the result
    is the attention over the dequantized state. Transient: one tile of K and of V per thread."""
    lib = _loaded()
    b, h, r, d = q.shape
    t, dv = k.quantized, v.values.shape[-1]
    if (
        q.dtype != torch.float32
        or b != 1
        or k.values.shape[1] != h
        or v.quantized != t
        or t < 1
        or k.block != v.block
        or k.qdtype != v.qdtype
        or dv % VALUE_DIM_MULTIPLE
    ):
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} over {t} 8-bit keys: float32 queries of batch 1, one query row "
            "group per key head (query heads folded), keys and values alike in length, block and dtype, "
            f"value dim a multiple of {VALUE_DIM_MULTIPLE}"
        )
    q = q if q.stride(-1) == 1 else q.contiguous()
    kc, vc = k.values.view(torch.uint8), v.values.view(torch.uint8)
    out = torch.empty(1, h, r, dv)
    lse = torch.empty(1, h, r)
    rc = lib.longstraw_attend_full_8bit(
        q.data_ptr(),
        kc.data_ptr(),
        k.scales.data_ptr(),
        vc.data_ptr(),
        v.scales.data_ptr(),
        _lut(k.qdtype).data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        h,
        r,
        t,
        d,
        dv,
        k.block,
        q.stride(1),
        q.stride(2),
        kc.stride(1),
        kc.stride(2),
        k.scales.stride(1),
        vc.stride(1),
        vc.stride(2),
        v.scales.stride(1),
        float(scale),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"longstraw_attend_full_8bit refused q {tuple(q.shape)} over {t} keys")
    return out, lse


def attend_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out `[B, H, R, Dv]`, lse `[B, H, R]`) of queries `q` `[B, H, R, D]` over keys `k` `[B, H, T, D]`, values
    `v` `[B, H, T, Dv]`, every key visible to every query; float32 CPU tensors, Dv a multiple of 16, T ≥ 1.
    K and V are read in place (any head and row strides, last dim contiguous): a view into a longer cache is
    not copied."""
    lib = _loaded()
    if q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"float32 only; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    b, h, r, d = q.shape
    t, dv = k.shape[2], v.shape[-1]
    if dv % VALUE_DIM_MULTIPLE or t < 1 or k.shape[-1] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: value dim must be a "
            f"multiple of {VALUE_DIM_MULTIPLE}, at least one key"
        )
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(b, h, r, dv)
    lse = torch.empty(b, h, r)
    threads = torch.get_num_threads()
    for i in range(b):
        rc = lib.longstraw_attend_full(
            q[i].data_ptr(),
            k[i].data_ptr(),
            v[i].data_ptr(),
            out[i].data_ptr(),
            lse[i].data_ptr(),
            h,
            r,
            t,
            d,
            dv,
            q.stride(1),
            q.stride(2),
            k.stride(1),
            k.stride(2),
            v.stride(1),
            v.stride(2),
            float(scale),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"longstraw_attend_full refused q {tuple(q.shape)}, k {tuple(k.shape)}")
    return out, lse


def attend_full_dq(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, scale: float
) -> torch.Tensor:
    """dq `[B, H, R, D]` of `attend_full`'s attention with the keys and values constants: queries `q` `[B, H, R, D]`,
    keys `k` `[B, H, T, D]`, values `v` `[B, H, T, Dv]`, the incoming gradient `g` and the merged output `o`
    `[B, H, R, Dv]` (the softmax correction's rowsum(dO ∘ O)), the part's log-sum-exp `lse` `[B, H, R]`; float32 CPU
    tensors, D and Dv multiples of 16. dq_i = scale · Σ_j p_ij (dO_i · v_j − dO_i · O_i) k_j: 1.5 × the forward's
    products, where the flash backward computes the keys' and values' gradients too (2.5 ×)."""
    lib = _loaded()
    if any(x.dtype != torch.float32 for x in (q, k, v, g, o)):
        raise ValueError("float32 only")
    b, h, r, d = q.shape
    t, dv = k.shape[2], v.shape[-1]
    if d % VALUE_DIM_MULTIPLE or dv % VALUE_DIM_MULTIPLE or t < 1 or k.shape[-1] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: head and value dims must be "
            f"multiples of {VALUE_DIM_MULTIPLE}, at least one key"
        )
    q, k, v, g, o = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, o))
    lse = lse.float().contiguous()
    dq = torch.empty(b, h, r, d)
    threads = torch.get_num_threads()
    for i in range(b):
        rc = lib.longstraw_attend_full_dq(
            q[i].data_ptr(),
            k[i].data_ptr(),
            v[i].data_ptr(),
            g[i].data_ptr(),
            o[i].data_ptr(),
            lse[i].data_ptr(),
            dq[i].data_ptr(),
            h,
            r,
            t,
            d,
            dv,
            q.stride(1),
            q.stride(2),
            k.stride(1),
            k.stride(2),
            v.stride(1),
            v.stride(2),
            g.stride(1),
            g.stride(2),
            o.stride(1),
            o.stride(2),
            float(scale),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"longstraw_attend_full_dq refused q {tuple(q.shape)}, k {tuple(k.shape)}")
    return dq
