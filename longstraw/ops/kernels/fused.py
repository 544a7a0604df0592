"""Fused kernels: PyTorch's flash-attention entry points that return the log-sum-exp.

Each computes a mask-free part exactly (`part.mask_free_mode`): 'full', every key visible to every
query (the prompt part of a full-attention layer), or 'causal', a square causal block (the own part).
Grouped-query attention: in 'full' mode the query heads of one key head are folded into rows
(`[B, H, R, D]` → `[B, Hkv, g·R, D]`), exact and free, and dK / dV come out in the key layout; in
'causal' mode the own K/V (R tokens) are repeated per query head and their gradients summed back.

Keys that are not a plain tensor on the queries' device (an 8-bit `QuantizedTokens` state, a state
in host memory) and key gradients that are not wanted (detached replay: dq only) go tile by tile over
the keys: forward merges the tiles by log-sum-exp, backward sums each tile's dq (a tile's backward
with the part's whole log-sum-exp gives exactly that tile's share of dq). Transient memory: one tile
of K/V (and of its dK / dV), never a copy of the part.

- `flash_cpu`: `aten._scaled_dot_product_flash_attention_for_cpu` (+ backward), torch 2.11–2.13; float32,
  bfloat16, float16; tiles of TILE_ELEMENTS keys × heads × dims (at least `part.block` keys). It also computes
  windowed and chunked parts (sliding-window layers, Llama 4's attention chunks) through the kernel's additive mask:
  the queries in the blockwise kernel's tiles (`part.query_tiles`), each over only the keys its rows may see
  (`part.key_range`), masked by `part.visible` (a float mask of tile rows × heads per key head × those keys, at
  most TILE_ELEMENTS elements: a tile's rows split further where the window and g call for it). A query that sees
  no key gets out 0 and lse −inf, as in blockwise. Forward 1.5–1.6× blockwise's on a Gemma 3 capture chunk's parts
  (window 512, head dim 256), 5.6–10× at Mistral's window of 4,096 (`bench/windowed_kernel.py`, 2 threads).
- `simd_cpu`: longstraw's compiled float32 kernel (`native.py`) for 'full' parts with value dims a multiple of 16,
  ≤ SIMD_MAX_HEAD_DIM, reading an 8-bit state in place (decoded per tile inside the kernel); its causal parts and
  backward are `flash_cpu`'s.
- `flash_cuda`: `aten._scaled_dot_product_flash_attention` (FlashAttention-2 in PyTorch), bfloat16 /
  float16, head dim ≤ 256 and a multiple of 8; tiles of `CUDA_TILE` keys.
- `efficient_cuda`: `aten._scaled_dot_product_efficient_attention` (memory-efficient attention), float32
  and half precision; tiles of `CUDA_TILE` keys.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..quant import QuantizedTokens, read_block
from . import native
from .part import TILE_ELEMENTS, Part, key_range, mask_free_mode, may_see, query_tiles, visible

aten = torch.ops.aten
#: keys × heads × dims per tile when a CPU part is read tile by tile (a compressed state, dq-only backward)
CPU_TILE_ELEMENTS = TILE_ELEMENTS
#: largest head dim for which `simd_cpu` is chosen (faster than `flash_cpu` up to here; bench/cpu_kernel.py)
SIMD_MAX_HEAD_DIM = 128
#: keys per tile when a CUDA part is read tile by tile (compressed / host state, dq-only backward)
CUDA_TILE = 1 << 16


def _fold(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """`[B, H, R, ...]` → `[B, Hkv, g·R, ...]` (query heads of one key head as rows)."""
    b, h, r = x.shape[:3]
    return x.reshape(b, hkv, (h // hkv) * r, *x.shape[3:])


def _plain(k, device) -> bool:
    return isinstance(k, torch.Tensor) and k.device == device


def _on_host(x) -> bool:
    return (x.device if isinstance(x, torch.Tensor) else x.values.device).type == "cpu"


_COPY_STREAMS: dict = {}


def tiles(k, v, tile: int, dtype, device):
    """Yield (s0, n, k tile, v tile) on `device` in `dtype`. From host memory to a GPU, the next tile is copied
    on a side stream while the caller computes on the current one (two tiles in flight)."""
    t = k.shape[2]
    if device.type != "cuda" or not _on_host(k):
        for s0 in range(0, t, tile):
            n = min(tile, t - s0)
            yield s0, n, read_block(k, s0, n, dtype, device), read_block(v, s0, n, dtype, device)
        return
    side = _COPY_STREAMS.setdefault(device, torch.cuda.Stream(device))
    main = torch.cuda.current_stream(device)

    def fetch(s0):
        n = min(tile, t - s0)
        side.wait_stream(main)  # the tiles' memory may come from blocks the main stream just released
        with torch.cuda.stream(side):
            kb, vb = read_block(k, s0, n, dtype, device), read_block(v, s0, n, dtype, device)
        done = torch.cuda.Event()
        done.record(side)
        return s0, n, kb, vb, done

    pending = fetch(0)
    while pending is not None:
        s0, n, kb, vb, done = pending
        pending = fetch(s0 + n) if s0 + n < t else None
        main.wait_event(done)
        kb.record_stream(main)
        vb.record_stream(main)
        yield s0, n, kb, vb


class MaskCache:
    """The additive masks of windowed parts' tiles, kept by what they depend on (`key`), least recently used first
    out. Without an attention chunk a tile's mask is a function of its rows, its keys and the queries' positions
    relative to the first key (and the window): a capture chunk's query tiles after the first share one, and the
    sliding layers of a model (Gemma 3: 15 of 18) see the same ones, where each built it anew (on a Gemma 3 capture,
    building the masks took twice the masked attention itself). At most `entries` masks are kept (each at most
    TILE_ELEMENTS elements: 8 MiB in float32), and only for CPU tensors."""

    def __init__(self, entries: int = 4):
        self.entries = entries
        self.kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def key(part: Part, rows: int, first: int, end: int, g: int, dtype, device) -> tuple:
        k_lo = part.k_start + first
        where = (part.q_start - k_lo,) if part.chunk is None else (part.q_start, k_lo, part.chunk)
        return (rows, end - first, part.window, part.q_period, g, dtype, str(device), *where)

    def get(self, part: Part, rows: int, first: int, end: int, g: int, dtype, device):
        """(bias `[g·rows, end − first]`, seen `[rows]`) of the tile (see `FusedKernel._masked_tiles`)."""
        key = self.key(part, rows, first, end, g, dtype, device)
        got = self.kept.pop(key, None)
        if got is None:
            vis = visible(part, rows, first, end - first, device)
            if vis is None:
                vis = torch.ones(rows, end - first, dtype=torch.bool, device=device)
            bias = torch.zeros(vis.shape, dtype=dtype, device=device).masked_fill_(~vis, float("-inf"))
            got = (bias.repeat(g, 1), vis.any(-1))
        if torch.device(device).type == "cpu":
            self.kept[key] = got  # the most recently used last
            while len(self.kept) > self.entries:
                self.kept.pop(next(iter(self.kept)))
        return got


#: the process's windowed masks (`MaskCache`)
_MASKS = MaskCache()


class FusedKernel:
    """A fused (out, lse) kernel: subclasses give the raw calls on `[B, Hq, Rq, D]` / `[B, Hq, T, D]`."""

    name = "fused"
    device_type = "cpu"
    dtypes: tuple[torch.dtype, ...] = ()
    #: whether the kernel takes an additive mask (`raw_masked_forward` / `raw_masked_backward`): windowed and chunked
    #: parts of consecutive query positions, tile by tile
    masked = False

    def available(self) -> bool:
        raise NotImplementedError

    def head_dim_ok(self, d: int) -> bool:
        return True

    def tile(self, part: Part, k) -> int:
        """Keys per tile when the part's keys are read tile by tile (`k` `[1, Hkv, T, D]`)."""
        return CUDA_TILE

    def raw_forward(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def raw_backward(self, do, q, k, v, out, lse, causal: bool, scale: float):
        raise NotImplementedError

    def raw_masked_forward(self, q, k, v, bias, scale: float):
        raise NotImplementedError

    def raw_masked_backward(self, do, q, k, v, out, lse, bias, scale: float):
        raise NotImplementedError

    # -------------------------------------------------------------------- interface
    def why_not(self, q, k, v, part: Part) -> str | None:
        """None when this kernel computes the part exactly, else the reason it does not."""
        if not self.available():
            return "not available in this torch build"
        if q.device.type != self.device_type:
            return f"runs on {self.device_type}, not {q.device.type}"
        if q.dtype not in self.dtypes:
            return f"dtype {q.dtype} not in {self.dtypes}"
        if part.softcap is not None:
            return "no softcap"
        if mask_free_mode(part, q.shape[2], k.shape[2]) is None:
            if not self.masked:
                return "the part needs a mask (window, chunk, or keys after some query)"
            if part.window is None and part.chunk is None:
                return "the part needs a mask other than a window or an attention chunk (keys after some query)"
            if part.q_period is not None:
                return "a window over the rows of several folded sequences"
        if v.shape[-1] != q.shape[-1] or not self.head_dim_ok(q.shape[-1]):
            return f"head dims q {q.shape[-1]} / v {v.shape[-1]}"
        if isinstance(k, torch.Tensor) and k.dtype != q.dtype:
            return "keys in another dtype"
        return None

    def forward(self, q, k, v, part: Part):
        mode = mask_free_mode(part, q.shape[2], k.shape[2])
        if mode is None:
            return self._masked_forward(q, k, v, part)
        b, h, r, _ = q.shape
        hkv = k.shape[1]
        if mode == "causal":
            g = h // hkv
            out, lse = self.raw_forward(q, _repeat(k, g), _repeat(v, g), True, part.scale)
            return out, lse
        qf = _fold(q, hkv)
        if _plain(k, q.device):
            out, lse = self.raw_forward(qf, k, v, False, part.scale)
        else:
            out = lse = None
            for o, l in self.pieces(qf, k, v, part):
                if out is None:
                    out, lse = o.float(), l
                else:  # merged in float32, rounded to q's dtype once at the end
                    w = torch.sigmoid(l - lse)
                    out = out + w[..., None] * (o.float() - out)
                    lse = torch.logaddexp(lse, l)
            out = out.to(q.dtype)
        return out.reshape(b, h, r, -1), lse.reshape(b, h, r)

    def pieces(self, qf, k, v, part: Part):
        """(out, lse) of the folded queries over successive pieces of keys that are not a plain tensor on their
        device, merged by the caller: one tile at a time, dequantized / copied to the queries' device."""
        for _, _, kb, vb in tiles(k, v, self.tile(part, k), qf.dtype, qf.device):
            yield self.raw_forward(qf, kb, vb, False, part.scale)

    def backward(self, g_out, q, k, v, out, lse, part: Part, need_kv: bool):
        mode = mask_free_mode(part, q.shape[2], k.shape[2])
        if mode is None:
            return self._masked_backward(g_out, q, k, v, out, lse, part, need_kv)
        b, h, r, _ = q.shape
        hkv = k.shape[1]
        lse = lse.float().contiguous()
        if mode == "causal":
            g = h // hkv
            dq, dk, dv = self.raw_backward(g_out, q, _repeat(k, g), _repeat(v, g), out, lse, True, part.scale)
            if not need_kv:
                return dq, None, None
            return dq, _unrepeat(dk, hkv), _unrepeat(dv, hkv)
        qf, dof, outf, lsef = _fold(q, hkv), _fold(g_out, hkv), _fold(out, hkv), _fold(lse, hkv)
        if need_kv:  # exact mode: the whole part's dK / dV are wanted anyway
            dq, dk, dv = self.raw_backward(dof, qf, k, v, outf, lsef, False, part.scale)
            return dq.reshape(q.shape), dk, dv
        dq = None
        for _, _, kb, vb in tiles(k, v, self.tile(part, k), q.dtype, q.device):
            d, _, _ = self.raw_backward(dof, qf, kb, vb, outf, lsef, False, part.scale)
            dq = d.float() if dq is None else dq + d.float()
        return dq.to(q.dtype).reshape(q.shape), None, None

    def _masked_tiles(self, part: Part, r: int, t: int, g: int, dtype, device):
        """Yield (i0, i1, first key, end key, bias `[g·rows, n]`, seen `[rows]` bool) over the query tiles of a
        windowed or chunked part that see some key: the additive mask of the tile's rows (repeated for the g query
        heads folded under each key head) over its key range, and which rows see any key. A tile's mask is kept to
        TILE_ELEMENTS elements (what the planner budgets for the blockwise kernel's score tile) by splitting its
        rows: a tile of `rows` reads at most window (or chunk) + rows keys. The masks come from `_MASKS`: a window's
        mask depends on the queries' positions relative to the keys only, so the tiles of every chunk and every
        sliding layer share a few."""
        span = part.window if part.window is not None else part.chunk
        assert span is not None  # a masked part is windowed or chunked (`why_not`)
        for i0, i1, sub in query_tiles(part, r):
            step = max(16, TILE_ELEMENTS // (g * (span + i1 - i0)))
            for j0 in range(i0, i1, step):
                j1 = min(j0 + step, i1)
                rows, rows_part = j1 - j0, replace(sub, q_start=sub.q_start + j0 - i0)
                first, end = key_range(rows_part, rows, t)
                if end <= first or not may_see(rows_part, rows, part.k_start + first, part.k_start + end - 1):
                    continue
                bias, seen = _MASKS.get(rows_part, rows, first, end, g, dtype, device)
                yield j0, j1, first, end, bias, seen

    def _masked_forward(self, q, k, v, part: Part):
        """(out, lse) of a windowed or chunked part, tile by tile (see the module doc)."""
        b, h, r, _ = q.shape
        hkv, t = k.shape[1], k.shape[2]
        out = q.new_zeros(b, h, r, v.shape[-1])
        lse = torch.full((b, h, r), float("-inf"), dtype=torch.float32, device=q.device)
        for i0, i1, first, end, bias, seen in self._masked_tiles(part, r, t, h // hkv, q.dtype, q.device):
            n, rows = end - first, i1 - i0
            kb, vb = read_block(k, first, n, q.dtype, q.device), read_block(v, first, n, q.dtype, q.device)
            o, lt = self.raw_masked_forward(_fold(q[:, :, i0:i1], hkv), kb, vb, bias, part.scale)
            out[:, :, i0:i1] = o.reshape(b, h, rows, -1)
            lse[:, :, i0:i1] = lt.reshape(b, h, rows).masked_fill(~seen, float("-inf"))  # the kernel gives 0 there
        return out, lse

    def _masked_backward(self, g_out, q, k, v, out, lse, part: Part, need_kv: bool):
        """(dq, dk, dv) of a windowed or chunked part, tile by tile: each tile's rows get their whole dq from it (a
        tile reads every key its rows see); its dK / dV add into the key range it read, in float32."""
        b, h, r, _ = q.shape
        hkv, t = k.shape[1], k.shape[2]
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device) if need_kv else None
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device) if need_kv else None
        # a row that sees no key: its log-sum-exp −inf would make exp(s − lse) = exp(−inf + inf); any finite value
        # gives probability 0 over its all-masked scores
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).float()
        for i0, i1, first, end, bias, _ in self._masked_tiles(part, r, t, h // hkv, q.dtype, q.device):
            n, rows = end - first, i1 - i0
            kb, vb = read_block(k, first, n, q.dtype, q.device), read_block(v, first, n, q.dtype, q.device)
            do_t, q_t, out_t, lse_t = (_fold(x[:, :, i0:i1], hkv) for x in (g_out, q, out, lse))
            d_q, d_k, d_v = self.raw_masked_backward(do_t, q_t, kb, vb, out_t, lse_t.contiguous(), bias, part.scale)
            dq[:, :, i0:i1] = d_q.reshape(b, h, rows, -1)
            if dk is not None and dv is not None:  # need_kv: key gradients of a plain K/V part
                dk[:, :, first:end] += d_k.float()
                dv[:, :, first:end] += d_v.float()
        if dk is None or dv is None:
            return dq, None, None
        return dq, dk.to(k.dtype), dv.to(v.dtype)


def _repeat(x, g):
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _unrepeat(dx, hkv):
    b, h, t, d = dx.shape
    return dx if h == hkv else dx.reshape(b, hkv, h // hkv, t, d).sum(2)


class FlashCPU(FusedKernel):
    name = "flash_cpu"
    device_type = "cpu"
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    masked = True

    def available(self):
        return hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward")

    def tile(self, part, k):
        # a tile of about CPU_TILE_ELEMENTS keys × heads × dims (8 MiB per float32 K or V tile), at least one key
        # block: each tile costs a kernel call and a float32 merge of the whole output, so small tiles of a long
        # state spend more time merging than attending (measured: 1,024-key tiles 2.3× slower than 65,536)
        return max(part.block, CPU_TILE_ELEMENTS // max(1, k.shape[1] * k.shape[-1]))

    def raw_forward(self, q, k, v, causal, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def raw_backward(self, do, q, k, v, out, lse, causal, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.contiguous(), q, k, v, out.contiguous(), lse, 0.0, causal, scale=scale
        )

    def raw_masked_forward(self, q, k, v, bias, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse

    def raw_masked_backward(self, do, q, k, v, out, lse, bias, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.contiguous(), q, k, v, out.contiguous(), lse, 0.0, False, attn_mask=bias, scale=scale
        )


class SimdCPU(FlashCPU):
    """longstraw's compiled float32 kernel (`native.py`) for the 'full' parts — the prompt part, every query over
    every key, tile by tile from a compressed state — and their dq-only backward (a detached replay); causal own
    parts and every other backward go to PyTorch's flash kernel (the log-sum-exp it returns is the same quantity)."""

    name = "simd_cpu"
    dtypes = (torch.float32,)
    masked = False  # windowed parts are flash_cpu's (next in the CPU preference)

    def available(self):
        return native.why_unavailable() is None

    def why_not(self, q, k, v, part):
        if q.device.type == "cpu" and q.dtype in self.dtypes and not self.available():
            return f"not built: {native.why_unavailable()}"
        return super().why_not(q, k, v, part)

    def head_dim_ok(self, d):
        return d % native.VALUE_DIM_MULTIPLE == 0 and d <= SIMD_MAX_HEAD_DIM

    def raw_forward(self, q, k, v, causal, scale):
        if causal:
            return super().raw_forward(q, k, v, causal, scale)
        return native.attend_full(q, k, v, scale)

    def backward(self, g_out, q, k, v, out, lse, part: Part, need_kv: bool):
        """dq alone of a 'full' part whose keys are a plain tensor (a detached replay's prompt part) by the compiled
        kernel (`native.attend_full_dq`: 1.5 × the forward's products, where the flash backward also computes the
        keys' and values' gradients); every other backward as `flash_cpu`."""
        mode = mask_free_mode(part, q.shape[2], k.shape[2])
        if mode != "full" or need_kv or not _plain(k, q.device) or q.shape[-1] % native.VALUE_DIM_MULTIPLE:
            return super().backward(g_out, q, k, v, out, lse, part, need_kv)
        hkv = k.shape[1]
        dq = native.attend_full_dq(_fold(q, hkv), k, v, _fold(g_out, hkv), _fold(out, hkv), _fold(lse, hkv), part.scale)
        return dq.reshape(q.shape), None, None

    def pieces(self, qf, k, v, part):
        """An 8-bit state in host memory: its whole blocks read in place by one call (decoded tile by tile inside the
        kernel, as `QuantizedTokens.read` dequantizes), then its unfinished tail; anything else as `FusedKernel`."""
        if (
            isinstance(k, QuantizedTokens)
            and k.quantized
            and k.values.device.type == "cpu"
            and qf.device.type == "cpu"
            and qf.shape[0] == 1
        ):
            yield native.attend_full_8bit(qf, k, v, part.scale)
            n = k.length - k.quantized
            if n:
                yield self.raw_forward(
                    qf,
                    read_block(k, k.quantized, n, qf.dtype),
                    read_block(v, k.quantized, n, qf.dtype),
                    False,
                    part.scale,
                )
            return
        yield from super().pieces(qf, k, v, part)


class FlashCUDA(FusedKernel):
    name = "flash_cuda"
    device_type = "cuda"
    dtypes = (torch.bfloat16, torch.float16)

    def available(self):
        return torch.cuda.is_available() and torch.backends.cuda.is_flash_attention_available()

    def head_dim_ok(self, d):
        return d % 8 == 0 and d <= 256

    def raw_forward(self, q, k, v, causal, scale):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    def raw_backward(self, do, q, k, v, out, lse, causal, scale):
        # dense (not variable-length) inputs: no cumulative sequence lengths (None → undefined tensors, as the
        # forward returns them; a defined empty tensor selects the variable-length kernel); no dropout, so the
        # RNG state is not read
        seed = torch.zeros((), dtype=torch.long, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            do.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse,
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            seed,
            scale=scale,
        )


class EfficientCUDA(FusedKernel):
    name = "efficient_cuda"
    device_type = "cuda"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def available(self):
        return torch.cuda.is_available()

    def head_dim_ok(self, d):
        return d % 4 == 0 and d <= 512

    #: whether this build pads the log-sum-exp's rows to a multiple of 32 (read off the first forward)
    padded_lse = False

    def raw_forward(self, q, k, v, causal, scale):
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        if lse.shape[-1] != q.shape[2]:
            EfficientCUDA.padded_lse = True
        return out, lse[..., : q.shape[2]]

    def raw_backward(self, do, q, k, v, out, lse, causal, scale):
        if self.padded_lse:
            lse = torch.nn.functional.pad(lse, (0, (-q.shape[2]) % 32))
        seed = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do.contiguous(),
            q,
            k,
            v,
            None,
            out.contiguous(),
            lse.contiguous(),
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, dk, dv


FLASH_CPU, SIMD_CPU, FLASH_CUDA, EFFICIENT_CUDA = FlashCPU(), SimdCPU(), FlashCUDA(), EfficientCUDA()
