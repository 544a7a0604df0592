"""Merging attention parts by log-sum-exp, and padding rows for collectives (shapes must agree across ranks)."""

from __future__ import annotations

import torch


def fold(acc, part) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each one's (out, lse); float32. Either side may see no
    key (lse −inf); `acc` None: `part` alone."""
    o_b, l_b = part[0].float(), part[1].float()
    if acc is None:
        return o_b, l_b
    o_a, l_a = acc
    m = torch.maximum(l_a, l_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(l_a - m_safe), torch.exp(l_b - m_safe)
    s = w_a + w_b
    empty = s == 0
    safe = torch.where(empty, torch.ones_like(s), s)
    out = (w_a[..., None] * o_a + w_b[..., None] * o_b) / safe[..., None]
    lse = torch.where(empty, torch.full_like(s, float("-inf")), m_safe + torch.log(safe))
    return out, lse


def pad_rows(x: torch.Tensor, rows: int, dim: int = 2) -> torch.Tensor:
    """`x` zero-padded along `dim` to `rows`."""
    n = x.shape[dim]
    if n == rows:
        return x
    shape = list(x.shape)
    shape[dim] = rows - n
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    """Attention sinks (gpt-oss: a learned logit per head in the softmax denominator with no value) folded in as one
    more key of score `sinks[h]` and value 0: (out · sigmoid(lse − sink), logaddexp(lse, sink)), float32. out
    `[B, H, R, D]`, lse `[B, H, R]`, sinks `[H]`; None: (out, lse) unchanged."""
    out, lse = out.float(), lse.float()
    if sinks is None:
        return out, lse
    s = sinks.detach().float()[None, :, None]
    return out * torch.sigmoid(lse - s)[..., None], torch.logaddexp(lse, s)
