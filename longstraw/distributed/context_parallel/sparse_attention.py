"""DeepSeek sparse attention (DSA) over a context-parallel state: the selection and the sparse attention, collectively.

A DSA layer's query attends to its `index_topk` best keys by the indexer's score. With the prompt sliced over the
ranks (`longstraw.distributed`), rank j holds the latents and indexer keys of its slice [s_j, e_j). For a block of
query rows owned by rank i (its branch in a replay, a chunk of its slice in capture):

1. **Selection.** Every rank j scores rank i's indexer queries against the keys of its slice that those rows may see
   (the whole slice when it lies before rank i's own keys, nothing otherwise) and keeps its local top-k; the
   candidates go back to rank i (queries to the keys: the indexer keys never move), which merges them with the
   top-k of its own keys. Every list is ordered by (score descending, position ascending) and merged by a stable
   sort in slice order, so ties go to the earlier position and the selection is the same for any number of ranks
   (`local_topk`, `merge_topk`). Cost per rank: the indexer scores of every rank's rows against its slice (the
   single process's R · P split N ways) and N · rows · top-k (score, position) pairs on the wire.
2. **Attention.** Rank i's latent queries and their selected positions go to every rank; rank j returns (out, lse)
   of the rows over the selected keys that lie in its slice (`sparse_partial`: gathers rows × top-k latents per
   block of rows, never more); rank i folds the partials in slice order and merges its own part, as the dense
   exchange does. The backward sends (q, dO, lse, Δ = rowsum(dO · O), positions) to every rank, which returns dq of
   its share: the gradient of the flash-style surrogate Σ_k exp(s_k − lse) · (dO · v_k − Δ) (`sparse_partial_grad`).

The latents are keys and values alike (MLA in latent space, `longstraw.ops.latent_attention`); outputs carry the full
latent width and the caller keeps the first `kv_lora_rank` columns. In exact mode the slices' latents get their
gradient (every rank's rows that selected them, summed in rank order); the indexer keys get none (transformers runs
the indexer without grad, as the single process does).
"""

from __future__ import annotations

import torch

from ...ops.attention import TILE_ELEMENTS
from ...ops.latent_attention import Selection, index_scores
from ...ops.quant import QuantizedTokens
from ..collectives import Group
from ..merge import fold, pad_rows

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------- selection


def local_topk(q, weights, scale: float, keys, key_start: int, q_pos: torch.Tensor, topk: int, block: int):
    """(scores `[B, S, k]` float32, positions `[B, S, k]` int64) of each query's `topk` best keys among `keys`
    `[1|B, n, Di]` at positions key_start.., those with position ≤ `q_pos` `[S]` only; ordered by (score descending,
    position ascending); −inf / −1 fill where a query sees fewer than `topk` keys. q `[B, S, Hi, Di]`, weights
    `[B, S, Hi]`. Keys are scored in tiles of at most `block` keys (fewer where B · S · Hi · keys would pass
    `TILE_ELEMENTS`): memory O(B · S · (top-k + tile))."""
    b, s = q.shape[:2]
    n = 0 if keys is None else keys.shape[-2]
    vals = q.new_full((b, s, 0), NEG_INF, dtype=torch.float32)
    pos = torch.empty((b, s, 0), dtype=torch.long, device=q.device)
    tile = max(1, min(block, TILE_ELEMENTS // max(1, b * s * q.shape[2])))
    for a in range(0, n, tile):
        m = min(tile, n - a)
        sc = index_scores(q, weights, keys[:, a : a + m], scale)
        kpos = torch.arange(key_start + a, key_start + a + m, device=q.device)
        sc = sc.masked_fill(kpos[None, None, :] > q_pos[None, :, None], NEG_INF)
        # kept candidates (earlier positions) first: the stable sort keeps ties in position order
        vals = torch.cat([vals, sc], dim=-1)
        pos = torch.cat([pos, kpos.expand(b, s, m)], dim=-1)
        order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[..., :topk]
        vals, pos = vals.gather(-1, order), pos.gather(-1, order)
    return _fill(vals, pos, topk)


def merge_topk(candidates, topk: int):
    """The `topk` best of candidate lists `[(scores, positions)]` given in position order (slice 0 first, own keys
    last), each ordered by (score descending, position ascending): the same order, ties to the earlier position."""
    vals = torch.cat([c[0] for c in candidates], dim=-1)
    pos = torch.cat([c[1] for c in candidates], dim=-1)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[..., :topk]
    return _fill(vals.gather(-1, order), pos.gather(-1, order), topk)


def _fill(vals, pos, topk: int):
    """Pad to `topk` columns with (−inf, −1); positions of −inf entries become −1."""
    pos = torch.where(vals > NEG_INF, pos, torch.full_like(pos, -1))
    short = topk - vals.shape[-1]
    if short > 0:
        vals = torch.cat([vals, vals.new_full((*vals.shape[:-1], short), NEG_INF)], dim=-1)
        pos = torch.cat([pos, pos.new_full((*pos.shape[:-1], short), -1)], dim=-1)
    return vals, pos


def as_selection(pos: torch.Tensor, own_start: int) -> Selection:
    """A `longstraw.ops.latent_attention.Selection` whose indices are positions (the prompt's first `own_start`
    positions, then the branch's own keys), `valid` where a key was selected."""
    valid = pos >= 0
    return Selection(pos.clamp(min=0), valid, own_start)


# ----------------------------------------------------------------------------------------------- attention


def _row_block(b: int, s: int, k: int, d: int, h: int) -> int:
    """Rows per block so that the gathered latents (rows × top-k × width) and the scores (heads × rows × top-k)
    stay within a quarter of `TILE_ELEMENTS` each."""
    return max(1, min(s, TILE_ELEMENTS // max(1, 4 * b * k * max(d, h))))


def _gathered(latents, start: int, idx, valid, limit: int | None):
    """Latents `[B, n_rows, K, D]` at the selected positions `idx` that lie in [start, start + n) (and below `limit`),
    with the mask of those that do. `latents` `[1|B, 1, n, D]`."""
    n = latents.shape[-2]
    local = idx - start
    mask = valid & (local >= 0) & (local < n)
    if limit is not None:
        mask = mask & (idx < limit)
    local = local.clamp(0, max(n - 1, 0))
    if isinstance(latents, QuantizedTokens):  # an 8-bit slice: only the selected rows are dequantized
        return latents.gather_rows(local, torch.float32), mask
    lb = latents.shape[0]
    flat = latents[:, 0].reshape(lb * n, -1)
    if lb > 1:
        local = local + (torch.arange(lb, device=idx.device) * n)[:, None, None]
    return flat[local], mask


def sparse_partial(q, latents, start: int, idx, valid, scale: float, limit: int | None = None):
    """(out `[B, H, S, D]`, lse `[B, H, S]`), float32, of latent queries q `[B, H, S, D]` over the selected keys
    (positions `idx` `[B, S, K]` where `valid`) that lie in `latents` `[1|B, 1, n, D]` at positions start.. (and below
    `limit`); keys and values are the latents. lse −inf and out 0 for rows with no such key. Rows run in blocks
    (`_row_block`)."""
    b, h, s, d = q.shape
    out = q.new_zeros((b, h, s, d), dtype=torch.float32)
    lse = q.new_full((b, h, s), NEG_INF, dtype=torch.float32)
    if latents is None or latents.shape[-2] == 0 or s == 0:
        return out, lse
    rows = _row_block(b, s, idx.shape[-1], d, h)
    for a in range(0, s, rows):
        z = slice(a, a + rows)
        keys, mask = _gathered(latents, start, idx[:, z], valid[:, z], limit)
        keys = keys.float()
        sc = torch.einsum("bhnd,bnkd->bhnk", q[:, :, z].float(), keys) * scale
        sc = sc.masked_fill(~mask[:, None], NEG_INF)
        l = torch.logsumexp(sc, dim=-1)
        safe = torch.where(torch.isinf(l), torch.zeros_like(l), l)
        p = torch.exp(sc - safe[..., None])
        out[:, :, z] = torch.einsum("bhnk,bnkd->bhnd", p, keys)
        lse[:, :, z] = l
    return out, lse


def sparse_partial_grad(
    q, latents, start: int, idx, valid, scale: float, dout, lse, delta, need_keys: bool, limit: int | None = None
):
    """(dq `[B, H, S, D]` float32, d latents or None) of the part `sparse_partial` computes, given the merged
    attention's incoming gradient `dout`, its log-sum-exp over all parts `lse` and Δ = rowsum(dout · out) `delta`:
    the gradient of Σ_k exp(s_k − lse) · (dout · v_k − Δ), which is the part's share of the softmax backward
    (dS = P ⊙ (dO·Vᵀ − Δ), dV = Pᵀ dO). Rows run in blocks, each block's graph freed before the next."""
    b, h, s, d = q.shape
    dq = torch.zeros((b, h, s, d), dtype=torch.float32, device=q.device)
    if latents is None or latents.shape[-2] == 0 or s == 0:  # nothing to attend to (a rank short of rows)
        return dq, (
            torch.zeros(latents.shape, dtype=torch.float32, device=q.device)
            if need_keys and latents is not None
            else None
        )
    dlat = None
    if isinstance(latents, QuantizedTokens):  # a constant (detached mode only)
        if need_keys:
            raise ValueError("an 8-bit prompt state gets no gradient (exact mode needs the model's dtype)")
        lat = latents
    else:
        lat = latents.detach().float().requires_grad_(need_keys)
        dlat = torch.zeros_like(lat) if need_keys else None
    rows = _row_block(b, s, idx.shape[-1], d, h)
    for a in range(0, s, rows):
        z = slice(a, a + rows)
        with torch.enable_grad():
            qq = q[:, :, z].detach().float().requires_grad_(True)
            keys, mask = _gathered(lat, start, idx[:, z], valid[:, z], limit)
            sc = torch.einsum("bhnd,bnkd->bhnk", qq, keys) * scale
            l = lse[:, :, z].float()
            safe = torch.where(torch.isinf(l), torch.zeros_like(l), l)
            p = torch.exp(sc - safe[..., None]).masked_fill(~mask[:, None], 0.0)
            dv = torch.einsum("bhnd,bnkd->bhnk", dout[:, :, z].float(), keys)
            g = (p * (dv - delta[:, :, z, None].float())).sum()
            grads = torch.autograd.grad(g, [qq, lat] if need_keys else [qq])
        dq[:, :, z] = grads[0]
        if dlat is not None:  # need_keys
            dlat += grads[1]
    return dq, dlat


# ----------------------------------------------------------------------------------------------- exchanges


def rows_to_slices(
    g: Group, name: str, mine: list[tuple[torch.Tensor, int]], lengths: list[int], compute, replicated: bool = False
) -> list[list[torch.Tensor]]:
    """Run `compute(rank i, [its tensors, cut to its rows]) -> [tensors with rows padded to max(lengths)]` on every
    rank for every rank's rows and return what each slice computed for this rank's rows, in slice order.

    `mine`: this rank's row tensors, each with the dim that holds its rows; `lengths`: every rank's row count.
    `replicated`: every rank has the same rows (sampling): each computes its slice's result once and an all-gather
    brings every slice's to every rank. Otherwise the rows are all-gathered (padded) and an all-to-all returns the
    results to the rows' owners."""
    rmax = max(lengths)
    if replicated:
        return g.all_gather(f"{name}: partials", compute(g.rank, [t for t, _ in mine]))
    got = g.all_gather(f"{name}: rows", [pad_rows(t, rmax, dim) for t, dim in mine])
    send = []
    for i, tensors in enumerate(got):
        cut = [t.narrow(dim, 0, lengths[i]) for t, (_, dim) in zip(tensors, mine)]
        send.append(compute(i, cut))
    return g.all_to_all(f"{name}: results", send)


def select(
    g: Group,
    name: str,
    q,
    weights,
    scale: float,
    own_keys,
    own_start: int,
    q_pos,
    topk: int,
    block: int,
    *,
    slice_keys,
    slice_bounds: tuple[int, int],
    lengths: list[int],
    limits: list[int],
    replicated: bool = False,
):
    """`as_selection` of this rank's rows: every slice's local top-k of the rows it lies before (`limits[i]`: the first
    position rank i's rows take from their own keys, not from the slices), merged in slice order with the top-k of
    the rows' own keys (`own_keys` at positions own_start..). q `[B, S, Hi, Di]`, weights `[B, S, Hi]`, q_pos `[S]`."""
    s0, e0 = slice_bounds
    rmax = max(lengths)

    def compute(i, tensors):
        qi, wi, pi = tensors
        if slice_keys is None or e0 > limits[i]:
            vals, pos = _fill(
                qi.new_full((*qi.shape[:2], 0), NEG_INF, dtype=torch.float32),
                torch.empty((*qi.shape[:2], 0), dtype=torch.long, device=qi.device),
                topk,
            )
        else:
            vals, pos = local_topk(qi, wi, scale, slice_keys, s0, pi, topk, block)
        return [pad_rows(vals, rmax, 1), pad_rows(pos, rmax, 1)]

    got = rows_to_slices(g, name, [(q, 1), (weights, 1), (q_pos, 0)], lengths, compute, replicated)
    s = q.shape[1]
    candidates = [(v[:, :s], p[:, :s]) for v, p in got]
    candidates.append(local_topk(q, weights, scale, own_keys, own_start, q_pos, topk, block))
    _, pos = merge_topk(candidates, topk)
    return as_selection(pos, own_start)


def slice_partials(
    g: Group,
    name: str,
    query,
    selection: Selection,
    scale: float,
    *,
    slice_latents,
    slice_start: int,
    lengths: list[int],
    limits: list[int],
    replicated: bool = False,
):
    """(out, lse) float32 of this rank's latent query rows `[B, H, S, D]` over the selected keys in every slice, folded
    in slice order (positions at or after `limits[i]` belong to rank i's own keys and are left out)."""
    rmax = max(lengths)
    assert selection.indices is not None and selection.valid is not None  # a sparse selection (`select`)

    def compute(i, tensors):
        qi, idx, valid = tensors
        o, l = sparse_partial(qi, slice_latents, slice_start, idx, valid, scale, limit=limits[i])
        return [pad_rows(o, rmax, 2), pad_rows(l, rmax, 2)]

    got = rows_to_slices(
        g, name, [(query, 2), (selection.indices, 1), (selection.valid, 1)], lengths, compute, replicated
    )
    s = query.shape[2]
    acc = None
    for o, l in got:  # slice order
        acc = fold(acc, (o[:, :, :s], l[:, :, :s]))
    return acc


def slice_partials_grad(
    g: Group,
    name: str,
    q,
    dout,
    lse,
    delta,
    selection: Selection,
    scale: float,
    *,
    slice_latents,
    slice_start: int,
    lengths: list[int],
    limits: list[int],
    need_keys: bool,
):
    """The backward of `slice_partials`: (dq `[B, H, S, D]` float32 of this rank's rows, summed over the slices in
    slice order; the gradient of this rank's `slice_latents` from every rank's rows, summed in rank order, or None).
    `lse` is the merged attention's over all keys, `delta` = rowsum(dout · out) (`sparse_partial_grad`)."""
    rmax = max(lengths)
    total = None
    assert selection.indices is not None and selection.valid is not None  # a sparse selection (`select`)

    def compute(i, tensors):  # called for i = 0, 1, ... in rank order
        nonlocal total
        qi, gi, li, di, ii, vi = tensors
        dqi, dlat = sparse_partial_grad(
            qi, slice_latents, slice_start, ii, vi, scale, gi, li, di, need_keys, limit=limits[i]
        )
        if dlat is not None:
            total = dlat if total is None else total + dlat
        return [pad_rows(dqi, rmax, 2)]

    back = rows_to_slices(
        g,
        name,
        [(q, 2), (dout, 2), (lse, 2), (delta, 2), (selection.indices, 1), (selection.valid, 1)],
        lengths,
        compute,
    )
    r = q.shape[2]
    dq = None
    for (dqj,) in back:  # slice order
        dq = dqj[:, :, :r] if dq is None else dq + dqj[:, :, :r]
    return dq, total


class SparseReplayAttention(torch.autograd.Function):
    """DSA attention of this rank's branch `[1, H, R, D]` over the selected keys in [every rank's slice | its own
    latents], a collective with a collective backward (see the module). Saves q, the own latents, the selection, the
    merged output and lse (float32): O(R · (H · D + top-k))."""

    @staticmethod
    def forward(ctx, q, own, slice_latents, selection: Selection, scale: float, info):
        g, lengths, layer = info.group, info.lengths, info.layer
        name = f"replay forward layer {layer.layer_idx} (sparse)"
        limits = [selection.prompt_length] * g.size
        acc = slice_partials(
            g,
            name,
            q,
            selection,
            scale,
            slice_latents=slice_latents,
            slice_start=layer.start,
            lengths=lengths,
            limits=limits,
        )
        o_own = sparse_partial(q, own, selection.prompt_length, selection.indices, selection.valid, scale)
        out, lse = fold(acc, o_own)
        quantized = isinstance(slice_latents, QuantizedTokens)  # a constant, kept on ctx (not a tensor to save)
        ctx.slice_latents = slice_latents if quantized else None
        ctx.save_for_backward(
            q, own, None if quantized else slice_latents, selection.indices, selection.valid, out, lse
        )
        ctx.scale, ctx.info, ctx.own_start = scale, info, selection.prompt_length
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, own, slice_latents, idx, valid, out, lse = ctx.saved_tensors
        if ctx.slice_latents is not None:
            slice_latents = ctx.slice_latents
        g, lengths, layer = ctx.info.group, ctx.info.lengths, ctx.info.layer
        scale, own_start = ctx.scale, ctx.own_start
        delta = (dout.float() * out).sum(-1)
        dq, d_own = sparse_partial_grad(
            q, own, own_start, idx, valid, scale, dout, lse, delta, need_keys=ctx.needs_input_grad[1]
        )
        need_slice = ctx.needs_input_grad[2]  # exact mode: the slice's latents collect every branch's gradient
        dq_s, d_slice = slice_partials_grad(
            g,
            f"replay backward layer {layer.layer_idx} (sparse)",
            q,
            dout,
            lse,
            delta,
            Selection(idx, valid, own_start),
            scale,
            slice_latents=slice_latents,
            slice_start=layer.start,
            lengths=lengths,
            limits=[own_start] * g.size,
            need_keys=need_slice,
        )
        dq = dq + dq_s
        return (
            dq.to(q.dtype),
            None if d_own is None else d_own.to(own.dtype),
            None if d_slice is None else d_slice.to(slice_latents.dtype),
            None,
            None,
            None,
        )


class SparseCaptureAttention(torch.autograd.Function):
    """A DSA layer of exact mode's reverse pass: this rank's slice rows over their selected keys in the earlier slices
    and in its own, `chunk` rows per step as capture runs them (`_DsaCaptureBranchLayer`); the backward returns dq
    and the gradient of the slice's latents, as own keys of its rows and as keys the later ranks' rows selected."""

    @staticmethod
    def forward(ctx, q, own, idx, valid, own_start: int, scale: float, layer):
        out, lse = layer.sparse_forward(q, own, Selection(idx, valid, own_start), scale)
        ctx.save_for_backward(q, own, idx, valid, out, lse)
        ctx.own_start, ctx.scale, ctx.layer = own_start, scale, layer
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, own, idx, valid, out, lse = ctx.saved_tensors
        layer, scale, own_start = ctx.layer, ctx.scale, ctx.own_start
        limits = [s for s, _ in layer.bounds]
        delta = (dout.float() * out).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        d_own = torch.zeros_like(own, dtype=torch.float32)
        for step, lo, hi, counts in layer.steps():
            z = slice(lo, hi)
            sel = Selection(idx[:, z], valid[:, z], own_start)
            dq_o, d_o = sparse_partial_grad(
                q[:, :, z],
                own,
                own_start,
                sel.indices,
                sel.valid,
                scale,
                dout[:, :, z],
                lse[:, :, z],
                delta[:, :, z],
                need_keys=True,
            )
            dq_s, d_s = slice_partials_grad(
                layer.group,
                f"reverse pass layer {layer.layer_idx}: sparse attention, step {step}",
                q[:, :, z],
                dout[:, :, z],
                lse[:, :, z],
                delta[:, :, z],
                sel,
                scale,
                slice_latents=own,
                slice_start=own_start,
                lengths=counts,
                limits=limits,
                need_keys=True,
            )
            dq[:, :, z] = dq_o + dq_s
            d_own += d_o + d_s
        return dq.to(q.dtype), d_own.to(own.dtype), None, None, None, None, None
