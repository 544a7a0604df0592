"""`gemm_cpu`: a decode step's part that every query sees whole (the prompt part) as batched matrix products.

A decode step (one new position per sequence) attends with a few query rows per key head (G samples × the query
heads of one key head: 24 at G = 8 on SmolLM2, 192 for a ragged batch of 64 rows) over the whole prompt. There the
compiled SIMD kernel (`native.py`) spends as long transposing each key tile as scoring it, and hands the work
between its own threads and PyTorch's thread pool at every layer; two `torch.bmm` calls per key tile (scores, then
probabilities × values) run in the pool at the rate of the machine's matrix products. Measured on SmolLM2 at a 6K
prompt, 2 threads: a decode step of 8 rows 278 → 155 ms, of 64 rows 599 → 460 ms (bench/README.md, "The step at its
floor").

Forward, per key tile of at most `TILE_ELEMENTS` scores: S = (q · scale) kᵀ `[B·Hkv, g·R, n]`, its row maxima, P =
exp(S − max), the tile's output P v and log-sum-exp, merged across tiles by log-sum-exp (one tile for a prompt of
up to 2^21 / (B·Hkv·g·R) keys). Backward, per tile: P = exp(q kᵀ · scale − lse), dP = dO vᵀ, dS = P ∘ (dP − rowsum(dO ∘
O)), dq += dS k · scale; dk = dSᵀ q · scale and dv = Pᵀ dO only when the keys' gradients are wanted (exact mode).
float32 only (the scores are a product's output: in bf16 they would round to 8 bits). Memory: one tile of scores
(`TILE_ELEMENTS` floats, 8 MiB) at a time. Replays (several positions per sequence) keep to `simd_cpu` / `flash_cpu`,
whose backward keeps its score tiles in cache: measured no faster as products, and their transient scores would grow
with a segmented replay's trajectory.
"""

from __future__ import annotations

import torch

from .fused import FusedKernel
from .part import TILE_ELEMENTS, Part, mask_free_mode

#: query rows per key head (folded: G sequences × the query heads of one key head × their positions) up to which
#: `gemm_cpu` is chosen over `simd_cpu`; above it (a replay of G · R rows) the SIMD kernel's register blocking wins
#: (bench/README.md, "The step at its floor")
GEMM_MAX_ROWS = 256


class GemmCPU(FusedKernel):
    """The 'full' parts of few query rows as `torch.bmm` products (see the module doc)."""

    name = "gemm_cpu"
    device_type = "cpu"
    dtypes = (torch.float32,)

    def available(self) -> bool:
        return True

    def why_not(self, q, k, v, part: Part) -> str | None:
        reason = super().why_not(q, k, v, part)
        if reason is not None:
            return reason
        if mask_free_mode(part, q.shape[2], k.shape[2]) != "full":
            return "a part some query does not see whole (a square causal block: flash_cpu's)"
        if not (isinstance(k, torch.Tensor) and k.device == q.device):
            return "keys that are not a plain tensor on the queries' device (8-bit or host state: simd_cpu's)"
        if k.shape[0] != q.shape[0]:
            return f"key batch {k.shape[0]} is not the query batch {q.shape[0]} (fold the queries first)"
        if q.shape[2] != 1 and part.q_period != 1:
            return "more than one query position per sequence (a replay's: simd_cpu's, whose backward tiles its scores)"
        rows = (q.shape[1] // k.shape[1]) * q.shape[2]
        if rows > GEMM_MAX_ROWS:
            return f"{rows} query rows per key head, more than {GEMM_MAX_ROWS}: simd_cpu's"
        return None

    @staticmethod
    def _flat(q, k, v):
        """q `[B·Hkv, g·R, D]`, k `[B·Hkv, T, D]`, v `[B·Hkv, T, Dv]` (query heads of one key head as rows)."""
        b, h, r, d = q.shape
        hkv = k.shape[1]
        return (
            q.reshape(b * hkv, (h // hkv) * r, d),
            k.reshape(b * hkv, k.shape[2], d),
            v.reshape(b * hkv, v.shape[2], v.shape[3]),
        )

    @staticmethod
    def _tile(heads: int, rows: int, t: int, block: int) -> int:
        """Keys per tile: the scores of all `heads` × `rows` within `TILE_ELEMENTS`, at least one key block."""
        return max(1, min(t, max(block, TILE_ELEMENTS // max(heads * rows, 1))))

    def forward(self, q, k, v, part: Part):
        b, h, r, _ = q.shape
        qf, kf, vf = self._flat(q, k, v)
        qf = qf * part.scale  # the scale on the queries: one pass over g·R × D, not over every score
        t = kf.shape[1]
        n = self._tile(qf.shape[0], qf.shape[1], t, part.block)
        out = lse = None
        for s0 in range(0, t, n):
            s = torch.bmm(qf, kf[:, s0 : s0 + n].transpose(1, 2))
            m = s.amax(-1, keepdim=True)
            p = s.sub_(m).exp_()
            total = p.sum(-1, keepdim=True)
            o = torch.bmm(p, vf[:, s0 : s0 + n]).div_(total)
            tile_lse = m + total.log()
            if out is None or lse is None:
                out, lse = o, tile_lse
            else:  # merged by log-sum-exp with the tiles before
                merged = torch.logaddexp(lse, tile_lse)
                out = out * (lse - merged).exp() + o * (tile_lse - merged).exp()
                lse = merged
        assert out is not None and lse is not None  # t >= 1
        return out.reshape(b, h, r, -1), lse.reshape(b, h, r)

    def backward(self, g_out, q, k, v, out, lse, part: Part, need_kv: bool):
        qf, kf, vf = self._flat(q, k, v)
        hkv, rows, t = kf.shape[0], qf.shape[1], kf.shape[1]
        gf = g_out.reshape(hkv, rows, -1).to(qf.dtype)
        of = out.reshape(hkv, rows, -1).to(qf.dtype)
        lf = lse.reshape(hkv, rows, 1).float()
        delta = (gf * of).sum(-1, keepdim=True)  # rowsum(dO ∘ O) `[B·Hkv, g·R, 1]`
        dq = torch.zeros_like(qf)
        dk = torch.empty_like(kf) if need_kv else None
        dv = torch.empty_like(vf) if need_kv else None
        n = self._tile(hkv, rows, t, part.block)
        qs = qf * part.scale  # the scale on the queries, not on every score
        for s0 in range(0, t, n):
            kb, vb = kf[:, s0 : s0 + n], vf[:, s0 : s0 + n]
            p = torch.bmm(qs, kb.transpose(1, 2)).sub_(lf).exp_()
            ds = torch.bmm(gf, vb.transpose(1, 2)).sub_(delta).mul_(p)
            dq.baddbmm_(ds, kb, alpha=part.scale)
            if dk is not None and dv is not None:
                dv[:, s0 : s0 + n] = torch.bmm(p.transpose(1, 2), gf)
                dk[:, s0 : s0 + n] = torch.bmm(ds.transpose(1, 2), qf).mul_(part.scale)
        dq = dq.reshape(q.shape)
        if dk is None or dv is None:
            return dq, None, None
        return dq, dk.reshape(k.shape), dv.reshape(v.shape)


GEMM_CPU = GemmCPU()
