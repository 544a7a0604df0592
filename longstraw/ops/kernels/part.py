"""Where one attention part's keys sit relative to its queries, and which keys each query sees.

Positions are contiguous: query i sits at `q_start + i` (or `q_start + i mod q_period` when several
sequences' queries are folded into one batch row), key j at `k_start + j`. A key is visible when it
is not in the future and, with a sliding window W, when `q_pos − k_pos < W` (W keys including the
query's own, as transformers counts); with chunked local attention (Llama 4) only keys of the
query's own attention chunk are visible.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

#: Upper bound on the elements of one blockwise score tile (query rows × keys): 8 MiB in float32.
TILE_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class Part:
    """Where one part's keys sit relative to the queries, and how it is masked."""

    q_start: int
    k_start: int
    window: int | None
    softcap: float | None
    scale: float
    block: int
    #: query positions repeat every `q_period` rows (queries of several sequences folded into one
    #: batch row, see `longstraw.ops.attention.SplitAttention`); None: all rows are consecutive positions.
    q_period: int | None = None
    #: chunked local attention (Llama 4): a query at p sees only keys of its own attention chunk,
    #: positions ≥ (p // chunk) · chunk; None: no such bound
    chunk: int | None = None

    def q_positions(self, r: int, device) -> torch.Tensor:
        idx = torch.arange(r, device=device)
        return self.q_start + (idx if self.q_period is None else idx % self.q_period)

    def q_last(self, r: int) -> int:
        return self.q_start + min(r, self.q_period or r) - 1


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs (gradient checks), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mask_free_mode(part: Part, r: int, t: int) -> str | None:
    """'full' when every query sees every key of the part (no mask), 'causal' when the part is a square
    causal block (the own part: queries and keys at the same positions), else None (a mask is needed)."""
    if part.window is not None or part.chunk is not None:
        return None
    if part.k_start + t - 1 <= part.q_start:
        return "full"
    if r == t and part.q_start == part.k_start and part.q_period is None:
        return "causal"
    return None


def may_see(part: Part, r: int, k_lo: int, k_hi: int) -> bool:
    """Whether some query of the part may see a key at positions k_lo … k_hi (host arithmetic only: no
    device synchronisation). Exact without an attention chunk; with one, it may answer True for a
    block none sees, which only costs the block's (fully masked, hence zero) work."""
    q_lo, q_hi = part.q_start, part.q_last(r)
    lo = k_lo if part.window is None else max(k_lo, q_lo - part.window + 1)
    return lo <= min(k_hi, q_hi)


def visible(part: Part, r: int, s0: int, n: int, device) -> torch.Tensor | None:
    """Boolean mask `[R, n]` of visible keys s0..s0+n of the part, or None when all are visible."""
    q_lo, q_hi = part.q_start, part.q_last(r)
    k_lo, k_hi = part.k_start + s0, part.k_start + s0 + n - 1
    w, c = part.window, part.chunk
    if k_hi <= q_lo and (w is None or k_lo > q_hi - w) and (c is None or k_lo >= (q_hi // c) * c):
        return None
    qp = part.q_positions(r, device)[:, None]
    kp = torch.arange(k_lo, k_hi + 1, device=device)[None, :]
    vis = kp <= qp
    if w is not None:
        vis = vis & (kp > qp - w)
    if c is not None:
        vis = vis & (kp >= torch.div(qp, c, rounding_mode="floor") * c)
    return vis


#: Bounds of the query tile of a windowed or chunked part: the window (or chunk) clamped to this range. A tile of
#: Q rows over a window W reads at most W + Q − 1 keys; a small window gets tiles of 64 rows, enough for the matrix
#: products to outweigh the loop's per-tile cost (a window of 5 over a 504-query chunk: 3.0× faster than one tile)
QUERY_TILE = (64, 1024)


def query_tiles(part: Part, r: int):
    """Yield (i0, i1, sub-part) over row tiles of a part's R queries: one tile (the part itself) unless the part has
    a window or an attention chunk, consecutive query positions and R over twice the tile."""
    span = part.window if part.window is not None else part.chunk
    tile = None if span is None else min(max(span, QUERY_TILE[0]), QUERY_TILE[1])
    if tile is None or part.q_period is not None or r <= 2 * tile:
        yield 0, r, part
        return
    for i0 in range(0, r, tile):
        yield i0, min(i0 + tile, r), replace(part, q_start=part.q_start + i0)


def key_range(part: Part, r: int, t: int) -> tuple[int, int]:
    """[first, end) of the key offsets some query of the part may see: past keys within the window (or the first
    query's attention chunk), none in the queries' future."""
    first = 0
    if part.window is not None:
        first = max(first, part.q_start - part.window + 1 - part.k_start)
    if part.chunk is not None:
        first = max(first, (part.q_start // part.chunk) * part.chunk - part.k_start)
    return min(first, t), max(0, min(t, part.q_last(r) - part.k_start + 1))
