"""Attention kernels for one part of the split attention, and the one place that picks among them.

Interface: a kernel computes one part — queries `q` `[B, H, R, D]` over one key/value part `k` `[B, Hkv, T, D]`,
`v` `[B, Hkv, T, Dv]` at the positions, window, attention chunk and softcap of a `Part` — as
`forward(q, k, v, part) → (out [B, H, R, Dv] in q's dtype, lse [B, H, R] float32)`, and
`backward(g_out, q, k, v, out, lse, part, need_kv, g_lse) → (dq, dk, dv)`, where `out` is the *merged*
output of all parts (its softmax-correction term), `g_out` this part's share of dO and `g_lse` the merged
log-sum-exp's gradient (attention sinks). No kernel keeps an R × T tensor for backward.

Kernels (`KERNELS`):
- `reference`: every score materialised (O(H·R·T)); any device; the tests' oracle.
- `blockwise`: PyTorch, any device, every mask, softcap, float64, 8-bit and host-resident keys.
- `gemm_cpu`: a decode step's float32 parts every query sees whole (the prompt part: one position per sequence, at
  most `GEMM_MAX_ROWS` (256) query rows per key head) as `torch.bmm` products per key tile (`kernels/gemm.py`);
  plain tensors only.
- `simd_cpu`: longstraw's compiled float32 kernel for mask-free parts where every query sees every key (the
  prompt part), value dims a multiple of 16; built on first use (`kernels/native.py`); causal parts and
  backward are flash_cpu's.
- `flash_cpu`: PyTorch's fused CPU flash attention (float32 / bf16 / fp16); windowed and chunked parts through its
  additive mask, in the blockwise kernel's query tiles (`fused.py`).
- `flash_cuda`: PyTorch's FlashAttention-2 (bf16 / fp16, head dim ≤ 256, multiple of 8).
- `efficient_cuda`: PyTorch's memory-efficient attention (float32 and half, head dim ≤ 512).

The choice (`choose`), per part:

| device | part                                          | dtype        | kernel           |
|--------|-----------------------------------------------|--------------|------------------|
| any    | softcap                                       | any          | blockwise        |
| any    | float64                                       | float64      | blockwise        |
| cpu    | window or attention chunk, consecutive query positions | fp32/bf16/fp16 | flash_cpu (masked) |
| any    | window or attention chunk, elsewhere          | any          | blockwise        |
| cpu    | mask-free decode step, ≤ 256 query rows per key head, plain keys | fp32 | gemm_cpu     |
| cpu    | mask-free, fp32, value dim a multiple of 16 ≤ 128 | fp32       | simd_cpu         |
| cpu    | mask-free (prompt part; square causal own part) | fp32/bf16/fp16 | flash_cpu      |
| cuda   | mask-free, head dim ≤ 256, multiple of 8      | bf16 / fp16  | flash_cuda       |
| cuda   | mask-free, other head dims ≤ 512              | fp32 / half  | efficient_cuda   |
| any    | anything else (e.g. MLA's value dim ≠ key dim) | any         | blockwise        |

Backward takes the same kernel except when the merged log-sum-exp carries a gradient (attention
sinks, DeepSeek-V4's compressed entries): the fused entry points take none, so that part's backward
runs blockwise. `use(name)` forces one kernel (tests, benchmarks); a forced kernel that cannot compute
a part raises a `ValueError` naming why, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from . import blockwise as _blockwise
from . import reference as _reference
from .fused import EFFICIENT_CUDA, FLASH_CPU, FLASH_CUDA, SIMD_CPU, FusedKernel
from .gemm import GEMM_CPU
from .part import TILE_ELEMENTS, Part, acc_dtype, mask_free_mode

__all__ = [
    "KERNELS",
    "Part",
    "TILE_ELEMENTS",
    "acc_dtype",
    "choose",
    "part_backward",
    "part_forward",
    "use",
    "mask_free_mode",
]


class _Plain:
    """A kernel of module functions (reference, blockwise): computes every part."""

    def __init__(self, name, module):
        self.name, self._m = name, module

    def why_not(self, q, k, v, part) -> str | None:
        return None

    def forward(self, q, k, v, part):
        return self._m.forward(q, k, v, part)

    def backward(self, g_out, q, k, v, out, lse, part, need_kv, g_lse=None):
        return self._m.backward(g_out, q, k, v, out, lse, part, need_kv, g_lse)


REFERENCE = _Plain("reference", _reference)
BLOCKWISE = _Plain("blockwise", _blockwise)
KERNELS: dict[str, _Plain | FusedKernel] = {
    k.name: k for k in (REFERENCE, BLOCKWISE, GEMM_CPU, SIMD_CPU, FLASH_CPU, FLASH_CUDA, EFFICIENT_CUDA)
}
#: fused kernels in order of preference per device type (first that applies wins)
PREFERENCE = {"cpu": (GEMM_CPU, SIMD_CPU, FLASH_CPU), "cuda": (FLASH_CUDA, EFFICIENT_CUDA)}

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("longstraw_kernel", default=None)


@contextlib.contextmanager
def use(name: str | None):
    """Force the kernel `name` for every part inside the block (None: the automatic choice)."""
    if name is not None and name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; known: {sorted(KERNELS)}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def choose(q, k, v, part: Part):
    """The kernel that computes this part (see the module table)."""
    forced = _forced.get()
    if forced is not None:
        kernel = KERNELS[forced]
        reason = kernel.why_not(q, k, v, part)
        if reason is not None:
            raise ValueError(f"attention kernel {forced!r} cannot compute this part: {reason}")
        return kernel
    if q.dtype == torch.float64:
        return BLOCKWISE
    for kernel in PREFERENCE.get(q.device.type, ()):
        if kernel.why_not(q, k, v, part) is None:
            return kernel
    return BLOCKWISE


def part_forward(q, k, v, part: Part):
    """(out, lse) of one part with the chosen kernel."""
    return choose(q, k, v, part).forward(q, k, v, part)


def part_backward(g_out, q, k, v, out, lse, part: Part, need_kv: bool, g_lse=None):
    """(dq, dk, dv) of one part with the chosen kernel (blockwise when the log-sum-exp carries a gradient
    and the chosen kernel is fused)."""
    kernel = choose(q, k, v, part)
    if isinstance(kernel, FusedKernel):
        if g_lse is None:
            return kernel.backward(g_out, q, k, v, out, lse, part, need_kv)
        if _forced.get() is not None:
            raise ValueError(f"attention kernel {kernel.name!r} takes no log-sum-exp gradient (attention sinks)")
        kernel = BLOCKWISE
    return kernel.backward(g_out, q, k, v, out, lse, part, need_kv, g_lse)
