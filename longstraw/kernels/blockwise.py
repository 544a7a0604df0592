"""The blockwise PyTorch kernel: any device, any mask (causal, sliding window, attention chunk), softcap,
compressed or host-resident keys.

Walks the keys in blocks with an online softmax, in float32 (float64 for float64 inputs). Which
blocks hold a visible key is decided from the positions on the host, so the walk never waits on the
device. Transient memory O(heads · R · block); backward recomputes each block's scores (nothing of
size R × T is kept).
"""

from __future__ import annotations

import torch

from ..quant import read_block
from .part import TILE_ELEMENTS, Part, acc_dtype, may_see, visible


def blocks(part: Part, rows: int, r: int, t: int, device):
    """Yield (s0, n, mask) over the key blocks some query may see (mask None: all visible)."""
    block = min(part.block, max(16, TILE_ELEMENTS // max(rows, 1)))
    for s0 in range(0, t, block):
        n = min(block, t - s0)
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
    """One part's (out `[B, H, R, Dv]` in q's dtype, lse `[B, H, R]` float) by blocks over the keys.

    A query that sees no key of the part gets out 0 and lse −inf.
    """
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
    ∂lse/∂s_j = p_j, it enters as a shift of the softmax-correction term: ds_j = p_j (dO·v_j − (Δ − g_lse))."""
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
    dk = torch.zeros(k.shape, dtype=acc, device=q.device) if need_kv else None
    dvv = torch.zeros(v.shape, dtype=acc, device=q.device) if need_kv else None
    for s0, n, mask in blocks(part, b * h * r, r, t, q.device):
        kb = read_block(k, s0, n, acc, q.device)
        vb = read_block(v, s0, n, acc, q.device)
        s, tanh = scores(qf, kb, part, mask, h // hkv)
        p = torch.exp(s - lse_safe[..., None])
        ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[..., None])
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dq += torch.matmul(ds, kb) * part.scale
        if need_kv:
            dvv[:, :, s0 : s0 + n] = torch.matmul(p.transpose(-1, -2), do)
            dk[:, :, s0 : s0 + n] = torch.matmul(ds.transpose(-1, -2), qf) * part.scale
    dq = dq.reshape(q.shape).to(q.dtype)
    if need_kv:
        dk, dvv = dk.to(k.dtype), dvv.to(v.dtype)
    return dq, dk, dvv
