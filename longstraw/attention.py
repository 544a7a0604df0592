"""Split attention: response queries over [prompt K/V | own K/V] without concatenating them.

A replayed branch of R tokens attends to the P durable prompt keys and to its own R keys. Concatenating
the two (what `DynamicLayer.update` does) puts a copy of the whole prompt K/V into every branch's
autograd graph, and an eager softmax saves an R×P probability matrix for backward. Here each part is
computed by `BlockAttention`, a custom autograd function that walks the keys in blocks with an online
softmax, saves only its inputs (references, not copies), its output and the log-sum-exp, and recomputes
the blocks in backward. The two parts are merged by their log-sum-exps.

Shapes: q `[B, H, R, D]`, k `[B, Hkv, T, D]`, v `[B, Hkv, T, Dv]` with H a multiple of Hkv (GQA is
handled by grouping query heads, never by repeating K/V). Positions are contiguous: query i sits at
`q_start + i`, key j at `k_start + j`; a key is visible when it is not in the future and, with a
sliding window W, when `q_pos - k_pos < W` (W keys including the query's own, as transformers counts).

Memory: forward and backward hold O(H·R·block) transient floats; the graph holds O(H·R·(D + 1)) beyond
the inputs. Compute is in float32 for 16- and 32-bit inputs (float64 for float64).

`reference_attention` is the plain version (materialise all scores, mask, softmax) that the tests hold
`split_attention` equal to.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = 1024


def _visible(q_start: int, r: int, k_start: int, n: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean mask `[R, n]` of visible keys, or None when every key of the block is visible."""
    q_lo, q_hi = q_start, q_start + r - 1
    k_lo, k_hi = k_start, k_start + n - 1
    if k_hi <= q_lo and (window is None or k_lo > q_hi - window):
        return None
    qp = torch.arange(q_lo, q_hi + 1, device=device)[:, None]
    kp = torch.arange(k_lo, k_hi + 1, device=device)[None, :]
    vis = kp <= qp
    if window is not None:
        vis = vis & (kp > qp - window)
    return vis


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs (gradient checks), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scores(q, kb, scale, softcap, mask, groups):
    """Scores `[B, Hkv, g·R, n]` (float32) and the tanh of the softcap (for backward) or None."""
    s = torch.matmul(q, kb.transpose(-1, -2)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if mask is not None:
        s = s.masked_fill(~mask.repeat(groups, 1), float("-inf"))
    return s, t


class BlockAttention(torch.autograd.Function):
    """softmax(q·kᵀ·scale + mask)·v over the keys of one part, blockwise; returns (out, lse).

    out `[B, H, R, Dv]` in q's dtype, lse `[B, H, R]` in the accumulation dtype (−inf for a query that sees no key of
    this part, whose out is then 0). Saves q, k, v (by reference), out and lse; nothing of size R×T.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_start: int, k_start: int, scale: float, window, softcap, block: int):
        b, h, r, d = q.shape
        hkv, t, dv = k.shape[1], k.shape[2], v.shape[-1]
        g = h // hkv
        acc_dtype = _acc_dtype(q)
        qf = q.reshape(b, hkv, g * r, d).to(acc_dtype)
        m = torch.full((b, hkv, g * r), float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros((b, hkv, g * r), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((b, hkv, g * r, dv), dtype=acc_dtype, device=q.device)
        for s0 in range(0, t, block):
            n = min(block, t - s0)
            mask = _visible(q_start, r, k_start + s0, n, window, q.device)
            if mask is not None and not bool(mask.any()):
                continue
            s, _ = _scores(qf, k[:, :, s0 : s0 + n].to(acc_dtype), scale, softcap, mask, g)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_safe)
            p = torch.exp(s - m_safe[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(p, v[:, :, s0 : s0 + n].to(acc_dtype))
            m = m_new
        empty = l == 0
        out = acc / torch.where(empty, torch.ones_like(l), l)[..., None]
        lse = torch.where(empty, torch.full_like(l, float("-inf")), m + torch.log(l))
        out = out.reshape(b, h, r, dv).to(q.dtype)
        lse = lse.reshape(b, h, r)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (q_start, k_start, scale, window, softcap, block)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        q_start, k_start, scale, window, softcap, block = ctx.args
        b, h, r, d = q.shape
        hkv, t, dv = k.shape[1], k.shape[2], v.shape[-1]
        g = h // hkv
        acc_dtype = _acc_dtype(q)
        qf = q.reshape(b, hkv, g * r, d).to(acc_dtype)
        if dout is None:
            dout = torch.zeros_like(out)
        do = dout.reshape(b, hkv, g * r, dv).to(acc_dtype)
        delta = (do * out.reshape(b, hkv, g * r, dv).to(acc_dtype)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.reshape(b, hkv, g * r).to(acc_dtype)
        lse_f = lse.reshape(b, hkv, g * r)
        lse_safe = torch.where(torch.isinf(lse_f), torch.zeros_like(lse_f), lse_f)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq = torch.zeros_like(qf) if need_q else None
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device) if need_k else None
        dvv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device) if need_v else None
        for s0 in range(0, t, block):
            n = min(block, t - s0)
            mask = _visible(q_start, r, k_start + s0, n, window, q.device)
            if mask is not None and not bool(mask.any()):
                continue
            kb = k[:, :, s0 : s0 + n].to(acc_dtype)
            vb = v[:, :, s0 : s0 + n].to(acc_dtype)
            s, tanh = _scores(qf, kb, scale, softcap, mask, g)
            p = torch.exp(s - lse_safe[..., None])
            if dvv is not None:
                dvv[:, :, s0 : s0 + n] = torch.matmul(p.transpose(-1, -2), do)
            ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[..., None])
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)
            if dq is not None:
                dq += torch.matmul(ds, kb) * scale
            if dk is not None:
                dk[:, :, s0 : s0 + n] = torch.matmul(ds.transpose(-1, -2), qf) * scale
        if dq is not None:
            dq = dq.reshape(b, h, r, d).to(q.dtype)
        if dk is not None:
            dk = dk.to(k.dtype)
        if dvv is not None:
            dvv = dvv.to(v.dtype)
        return dq, dk, dvv, None, None, None, None, None, None


def block_attention(q, k, v, q_start, k_start, scale, window=None, softcap=None, block=DEFAULT_BLOCK):
    """`BlockAttention` with keyword defaults: returns (out `[B, H, R, Dv]`, lse `[B, H, R]`)."""
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a positive multiple of key heads ({k.shape[1]})")
    return BlockAttention.apply(q, k, v, int(q_start), int(k_start), float(scale), window, softcap, int(block))


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Combine two softmax-attention parts over disjoint key sets into the attention over their union.

    out = (e^lse_a·out_a + e^lse_b·out_b) / (e^lse_a + e^lse_b). `lse_b` must be finite (the own part,
    where every query sees at least itself); `lse_a` may be −inf (no visible key), giving out_b.
    """
    w = torch.sigmoid(lse_a - lse_b)[..., None].to(out_a.dtype)
    return out_b + w * (out_a - out_b)


def split_attention(
    q,
    own_k,
    own_v,
    prompt_k=None,
    prompt_v=None,
    *,
    q_start: int,
    own_start: int,
    prompt_start: int = 0,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    block: int = DEFAULT_BLOCK,
):
    """Attention of q over [prompt | own] keys: out `[B, H, R, Dv]`.

    The prompt part holds only references to `prompt_k` / `prompt_v`; gradients reach them only if
    they require grad (exact mode), never a copy.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = block_attention(q, own_k, own_v, q_start, own_start, scale, window, softcap, block)
    if prompt_k is None or prompt_k.shape[-2] == 0:
        return out
    out_p, lse_p = block_attention(q, prompt_k, prompt_v, q_start, prompt_start, scale, window, softcap, block)
    return merge_by_lse(out_p, lse_p, out, lse)


def reference_attention(q, k, v, q_start, k_start, scale=None, window=None, softcap=None):
    """Plain masked softmax attention (all scores materialised, K/V repeated per query head)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1).to(acc_dtype)
    v = v.repeat_interleave(g, dim=1).to(acc_dtype)
    s = torch.matmul(q.to(acc_dtype), k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    r, t = q.shape[2], k.shape[2]
    qp = torch.arange(q_start, q_start + r, device=q.device)[:, None]
    kp = torch.arange(k_start, k_start + t, device=q.device)[None, :]
    vis = kp <= qp
    if window is not None:
        vis = vis & (kp > qp - window)
    s = s.masked_fill(~vis, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v).to(q.dtype)

