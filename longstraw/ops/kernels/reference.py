"""The plain reference kernel: every score materialised, masked, softmaxed. Any device; the oracle the
tests hold every other kernel equal to. Memory O(H · R · T): for tests and small parts only."""

from __future__ import annotations

import torch

from ..quant import read_block
from .part import Part, acc_dtype, visible


def _probs(q, k, part: Part):
    """(scores after softcap and mask `[B, H, R, T]`, tanh of the softcap or None, K/V head repeat)."""
    acc = acc_dtype(q)
    g = q.shape[1] // k.shape[1]
    kf = read_block(k, 0, k.shape[2], acc, q.device).repeat_interleave(g, dim=1)
    s = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * part.scale
    t = None
    if part.softcap is not None:
        t = torch.tanh(s / part.softcap)
        s = t * part.softcap
    mask = visible(part, q.shape[2], 0, k.shape[2], q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s, t, kf, g


def forward(q, k, v, part: Part):
    """(out `[B, H, R, Dv]` in q's dtype, lse `[B, H, R]` float); out 0 and lse −inf for a query that sees no key."""
    s, _, _, g = _probs(q, k, part)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    vf = read_block(v, 0, v.shape[2], s.dtype, q.device).repeat_interleave(g, dim=1)
    return torch.matmul(p, vf).to(q.dtype), lse


def backward(g_out, q, k, v, out, lse, part: Part, need_kv: bool, g_lse=None):
    """(dq, dk, dv) with the kernel interface's convention: `out` is the merged output of all parts (its
    softmax-correction term), `g_out` this part's share of dO, `g_lse` the merged log-sum-exp's gradient."""
    s, t, kf, g = _probs(q, k, part)
    acc = s.dtype
    vf = read_block(v, 0, v.shape[2], acc, q.device).repeat_interleave(g, dim=1)
    lse_f = lse.to(acc)
    p = torch.exp(s - torch.where(torch.isinf(lse_f), torch.zeros_like(lse_f), lse_f)[..., None])
    do = g_out.to(acc)
    delta = (do * out.to(acc)).sum(-1)
    if g_lse is not None:
        delta = delta - g_lse.to(acc)
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = (torch.matmul(ds, kf) * part.scale).to(q.dtype)
    if not need_kv:
        return dq, None, None
    b, h, r, _ = q.shape
    hkv = k.shape[1]
    dk = (torch.matmul(ds.transpose(-1, -2), q.to(acc)) * part.scale).reshape(b, hkv, g, -1, k.shape[-1]).sum(2)
    dv = torch.matmul(p.transpose(-1, -2), do).reshape(b, hkv, g, -1, v.shape[-1]).sum(2)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
