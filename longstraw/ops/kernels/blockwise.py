"""The blockwise PyTorch kernel: any device, any mask (causal, sliding window, attention chunk), softcap,
compressed or host-resident keys.

Walks the keys in blocks with an online softmax, in float32 (float64 for float64 inputs). Which
blocks hold a visible key is decided from the positions on the host, so the walk never waits on the
device. Transient memory O(heads · R · block); backward recomputes each block's scores (nothing of
size R × T is kept).

With a sliding window W (or an attention chunk C) the queries are walked in tiles too (`query_tiles`), each over
only the keys its own rows may see: a part of R consecutive queries costs O(R · (W + tile)) instead of O(R · T),
which is what makes a long capture chunk of a sliding-window layer as cheap as its window.
"""

from __future__ import annotations

import torch

from ..quant import read_block

# the query tiles and key ranges are `part`'s (the masked fused kernel walks the same tiles); named here as well
from .part import QUERY_TILE, TILE_ELEMENTS, Part, acc_dtype, key_range, may_see, query_tiles, visible  # noqa: F401


def blocks(part: Part, rows: int, r: int, t: int, device):
    """Yield (s0, n, mask) over the key blocks some query may see (mask None: all visible), from the first key
    any query sees."""
    block = min(part.block, max(16, TILE_ELEMENTS // max(rows, 1)))
    first, end = key_range(part, r, t)
    for s0 in range(first, end, block):
        n = min(block, end - s0)
        if may_see(part, r, part.k_start + s0, part.k_start + s0 + n - 1):
            yield s0, n, visible(part, r, s0, n, device)


def scores(qf, kb, part: Part, mask, groups):
    """Scores `[B, Hkv, g·R, n]` in the accumulation dtype, and tanh of the softcap (or None)."""
    s = torch.matmul(qf, kb.transpose(-1, -2)) * part.scale
    t = None
    if part.softcap is not None:
        t = torch.tanh(s / part.softcap)
        s = t * part.softcap
    if mask is not None:
        s = s.masked_fill(~mask.repeat(groups, 1), float("-inf"))
    return s, t


def grouped(x: torch.Tensor, hkv: int, dtype) -> torch.Tensor:
    """`[B, H, R, D]` → `[B, Hkv, g·R, D]`: query heads grouped under their key head (no K/V repeat)."""
    b, h, r, d = x.shape
    return x.reshape(b, hkv, (h // hkv) * r, d).to(dtype)


def forward(q, k, v, part: Part):
    """One part's (out `[B, H, R, Dv]` in q's dtype, lse `[B, H, R]` float) by blocks over the keys, tile by tile
    over the queries of a windowed or chunked part (`query_tiles`).

    A query that sees no key of the part gets out 0 and lse −inf.
    """
    tiles = list(query_tiles(part, q.shape[2]))
    if len(tiles) == 1:
        return _forward_rows(q, k, v, part)
    outs, lses = zip(*(_forward_rows(q[:, :, i0:i1], k, v, sub) for i0, i1, sub in tiles))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _forward_rows(q, k, v, part: Part):
    b, h, r, _ = q.shape
    hkv, t, dv = k.shape[1], k.shape[2], v.shape[-1]
    acc = acc_dtype(q)
    qf = grouped(q, hkv, acc)
    rows = qf.shape[2]
    m = torch.full((b, hkv, rows), float("-inf"), dtype=acc, device=q.device)
    l = torch.zeros((b, hkv, rows), dtype=acc, device=q.device)
    o = torch.zeros((b, hkv, rows, dv), dtype=acc, device=q.device)
    for s0, n, mask in blocks(part, b * h * r, r, t, q.device):
        s, _ = scores(qf, read_block(k, s0, n, acc, q.device), part, mask, h // hkv)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        o = o * alpha[..., None] + torch.matmul(p, read_block(v, s0, n, acc, q.device))
        m = m_new
    empty = l == 0
    out = o / torch.where(empty, torch.ones_like(l), l)[..., None]
    lse = torch.where(empty, torch.full_like(l, float("-inf")), m + torch.log(l))
    return out.reshape(b, h, r, dv).to(q.dtype), lse.reshape(b, h, r)


def backward(g_out, q, k, v, out, lse, part: Part, need_kv: bool, g_lse=None):
    """Gradients (dq, dk, dv) of one part, given its incoming gradient `g_out` (= w·dO) and the output
    `out` whose correction term applies (the merged output). dk, dv are None unless `need_kv`.

    `g_lse` `[B, H, R]`: the gradient of the merged log-sum-exp (attention sinks read it). Since
    ∂lse/∂s_j = p_j, it enters as a shift of the softmax-correction term: ds_j = p_j (dO·v_j − (Δ − g_lse)).
    Tiled over the queries like `forward`; the tiles' key gradients add up."""
    acc = acc_dtype(q)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device) if need_kv else None
    dvv = torch.zeros(v.shape, dtype=acc, device=q.device) if need_kv else None
    tiles = list(query_tiles(part, q.shape[2]))
    if len(tiles) == 1:
        dq = _backward_rows(g_out, q, k, v, out, lse, part, dk, dvv, g_lse)
    else:
        dq = torch.cat(
            [
                _backward_rows(
                    g_out[:, :, i0:i1],
                    q[:, :, i0:i1],
                    k,
                    v,
                    out[:, :, i0:i1],
                    lse[:, :, i0:i1],
                    sub,
                    dk,
                    dvv,
                    None if g_lse is None else g_lse[:, :, i0:i1],
                )
                for i0, i1, sub in tiles
            ],
            2,
        )
    if need_kv:
        assert dk is not None and dvv is not None  # allocated when need_kv
        dk, dvv = dk.to(k.dtype), dvv.to(v.dtype)
    return dq, dk, dvv


def _backward_rows(g_out, q, k, v, out, lse, part: Part, dk, dvv, g_lse):
    """dq of the part's rows; adds their key gradients into `dk` / `dvv` (float accumulators, or None)."""
    b, h, r, _ = q.shape
    hkv, t = k.shape[1], k.shape[2]
    acc = acc_dtype(q)
    qf = grouped(q, hkv, acc)
    do = grouped(g_out, hkv, acc)
    delta = (do * grouped(out, hkv, acc)).sum(-1)
    if g_lse is not None:
        delta = delta - g_lse.reshape(b, hkv, -1).to(acc)
    lse_f = lse.reshape(b, hkv, -1).to(acc)
    lse_safe = torch.where(torch.isinf(lse_f), torch.zeros_like(lse_f), lse_f)
    dq = torch.zeros_like(qf)
    for s0, n, mask in blocks(part, b * h * r, r, t, q.device):
        kb = read_block(k, s0, n, acc, q.device)
        vb = read_block(v, s0, n, acc, q.device)
        s, tanh = scores(qf, kb, part, mask, h // hkv)
        p = torch.exp(s - lse_safe[..., None])
        ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[..., None])
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dq += torch.matmul(ds, kb) * part.scale
        if dk is not None:
            dvv[:, :, s0 : s0 + n] += torch.matmul(p.transpose(-1, -2), do)
            dk[:, :, s0 : s0 + n] += torch.matmul(ds.transpose(-1, -2), qf) * part.scale
    return dq.reshape(q.shape).to(q.dtype)
