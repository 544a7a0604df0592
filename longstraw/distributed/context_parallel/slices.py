"""How a prompt is sliced over the ranks, and the attention parts and sums every kind's collective builds on."""

from __future__ import annotations

import torch

from ...ops.attention import Part


def slice_bounds(total: int, size: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous slices `[(start, end)]` of `total` positions over `size` ranks, every boundary a multiple of `align`
    (but the last end, `total`): the ⌈total / align⌉ units are split as evenly as they go, the first ranks holding one
    more. align 1: the first `total % size` ranks hold one position more than the others."""
    units = -(-total // align)
    base_len, extra = divmod(units, size)
    bounds, s = [], 0
    for r in range(size):
        e = min(total, s + (base_len + (1 if r < extra else 0)) * align)
        bounds.append((s, e))
        s = e
    return bounds


def make_part(q_start, k_start, window, softcap, scale, block, q_period=None) -> Part:
    """A `longstraw.ops.attention.Part`, built by field name (the kernel interface is being reorganised)."""
    return Part(
        q_start=int(q_start),
        k_start=int(k_start),
        window=window,
        softcap=softcap,
        scale=float(scale),
        block=int(block),
        q_period=q_period,
    )


def prompt_part(part: Part, k_start: int) -> Part:
    return make_part(part.q_start, k_start, part.window, part.softcap, part.scale, part.block)


def rank_sum(got: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Element-wise sums of every rank's tensors (an all-gather's result), added in rank order from rank 0."""
    total = list(got[0])
    for parts in got[1:]:
        total = [t + p for t, p in zip(total, parts)]
    return total
