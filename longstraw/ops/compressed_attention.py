"""DeepSeek-V4 compressed attention: pooling of compression windows, and attention over compressed entries.

A DeepSeek-V4 CSA / HCA layer (transformers 5.24, `DeepseekV4CSACompressor` / `DeepseekV4HCACompressor`)
attends, besides its sliding window, to *compressed entries*: every `m` source tokens (one window) are
pooled into one entry `kv_norm(Σ_j softmax_j(Z_j + B_j) ⊙ C_j)` with RoPE at position `w · m` (`w` the
entry's index). HCA pools each window alone (`C, Z` of width D). CSA projects to 2·D: entry `w` pools the
first half (Ca) of window `w − 1` with the second half (Cb) of window `w` over 2·m slots, so what
crosses a window boundary is window `w − 1`'s Ca slice (the *overlap*, its gate already biased). Entry
`w` is visible to a query at position `t` once its window is complete: `(w + 1) · m − 1 ≤ t`. CSA
queries see only the entries their Lightning Indexer picks (top-k of `Σ_h w_h · relu(q_h · K^I)`, an
indexer-sized copy of the same pooling); HCA queries see every visible entry. Entries, sliding window
and the attention sink share one softmax.

Here: `pool_windows` (one call per batch of complete windows, exactly transformers' operations),
`entry_part` (all-visible prompt entries, blockwise through `longstraw.ops.attention`'s kernels, saves
only (out, lse)), `dense_entry_part` (a branch's own few entries, O(R · R/m)), `gathered_entry_part`
(CSA: the selected entries gathered per block of queries, O(rows · top-k · D), recomputed in backward)
and `merge_parts`. Nothing of size queries × P exists. `reference_pool` / `reference_compressed_attention`
are the plain versions the tests hold these equal to.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .attention import (
    TILE_ELEMENTS,
    Part,
    acc_dtype,
    fold_batch,
    merge_by_lse,
    part_backward,
    part_forward,
    unfold_batch,
)
from .latent_attention import Selection, gather_latents


def check_rate(layer_type: str, rate) -> int:
    """The compression rate of `layer_type` if the kernels handle it (a positive int), else a clear error."""
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
        raise ValueError(
            f"DeepSeek-V4 compress_rates[{layer_type!r}] = {rate!r}: longstraw's compressed attention "
            "pools windows of a positive integer number of tokens"
        )
    return rate


def pool_windows(kv, gate, position_bias, prior_kv, prior_gate, head_dim: int, overlap: bool):
    """Raw pooled entries `[B, n, D]` (before `kv_norm` and RoPE) of n complete windows `kv`, `gate` `[B, n·m, F]`
    (F = 2·D with `overlap` (CSA), else D), and the overlap the next window needs: (Ca `[B, m, D]`, its biased
    gate) of the last window, or (None, None) without `overlap`. `prior_kv`, `prior_gate` `[B|1, m, D]`: the
    overlap of the window before the first (None: the stream's first window, whose Ca slots get weight 0).

    Same operations as transformers 5.24's compressors, so that entries agree with the full-sequence forward."""
    b = kv.shape[0]
    m = position_bias.shape[0]
    n = kv.shape[1] // m
    chunk_kv = kv.view(b, n, m, -1)
    chunk_gate = gate.view(b, n, m, -1) + position_bias
    if not overlap:
        pooled = (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)
        return pooled, (None, None)
    new_kv = chunk_kv.new_zeros((b, n, 2 * m, head_dim))
    new_gate = chunk_gate.new_full((b, n, 2 * m, head_dim), float("-inf"))
    new_kv[:, :, m:] = chunk_kv[..., head_dim:]
    new_gate[:, :, m:] = chunk_gate[..., head_dim:]
    if n > 1:
        new_kv[:, 1:, :m] = chunk_kv[:, :-1, :, :head_dim]
        new_gate[:, 1:, :m] = chunk_gate[:, :-1, :, :head_dim]
    if prior_kv is not None:
        new_kv[:, 0, :m] = prior_kv.to(new_kv.dtype)
        new_gate[:, 0, :m] = prior_gate.to(new_gate.dtype)
    pooled = (new_kv * new_gate.softmax(dim=2, dtype=torch.float32).to(new_kv.dtype)).sum(dim=2)
    return pooled, (chunk_kv[:, -1, :, :head_dim], chunk_gate[:, -1, :, :head_dim])


def entry_positions(first: int, n: int, rate: int, device) -> torch.Tensor:
    """Position from which entries `first .. first + n − 1` are visible: the last token of their window."""
    return (torch.arange(first, first + n, device=device) + 1) * rate - 1


# ----------------------------------------------------------------------------------------- attention parts


class _EntryPart(torch.autograd.Function):
    """Attention of q `[B, H, S, D]` over entries `[1|B, 1, n, D]` (K = V) that every query sees: (out, lse)."""

    @staticmethod
    def forward(ctx, q, entries, part: Part):
        b = q.shape[0]
        fold = b > 1 and entries.shape[0] == 1
        qq = fold_batch(q) if fold else q
        out, lse = part_forward(qq, entries, entries, part)
        if fold:
            out, lse = unfold_batch(out, b), unfold_batch(lse, b)
        ctx.save_for_backward(q, entries, out, lse)
        ctx.part, ctx.fold = part, fold
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, entries, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        b = q.shape[0]
        f = fold_batch if ctx.fold else (lambda x: x)
        dq, dk, dv = part_backward(
            f(dout),
            f(q),
            entries,
            entries,
            f(out),
            f(lse),
            ctx.part,
            need_kv=ctx.needs_input_grad[1],
            g_lse=None if dlse is None else f(dlse),
        )
        if ctx.fold:
            dq = unfold_batch(dq, b)
        return dq, (None if dk is None else dk + dv), None


def entry_part(q, entries, scale: float, block: int):
    """(out `[B, H, S, D]`, lse `[B, H, S]` float) of q over prompt entries `[1|B, 1, n, D]`, all visible, blockwise:
    saves its inputs by reference, out and lse; transient memory O(H · S · block)."""
    n = entries.shape[-2]
    part = Part(q_start=n, k_start=0, window=None, softcap=None, scale=float(scale), block=int(block))
    return _EntryPart.apply(q, entries, part)


def _safe_softmax_part(scores, valid, weigh):
    """(out, lse) of scores `[..., K]` masked by `valid`, out = `weigh(p) / Σ p`: rows with no valid key give out 0
    and lse −inf, with finite gradients (the merge then gives them weight 0)."""
    scores = scores.masked_fill(~valid, float("-inf"))
    mx = scores.amax(-1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    p = torch.exp(scores - mx)
    total = p.sum(-1)
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), mx[..., 0] + torch.log(safe))
    return weigh(p) / safe[..., None], lse


def dense_entry_part(q, entries, positions, q_start: int, scale: float):
    """(out, lse) of q `[B, H, S, D]` over a branch's own entries `[B, 1, k, D]` visible from `positions` `[k]`
    (plain autograd: S × k scores, k ≤ S / m + 1)."""
    acc = acc_dtype(q)
    s = q.shape[2]
    scores = torch.matmul(q.to(acc), entries.to(acc).transpose(-1, -2)) * scale
    qpos = torch.arange(q_start, q_start + s, device=q.device)
    valid = positions[None, :] <= qpos[:, None]
    values = entries.to(acc)
    out, lse = _safe_softmax_part(scores, valid, lambda p: torch.matmul(p, values))
    return out.to(q.dtype), lse


def _gathered_block(q, prompt, own, idx, valid, n_prompt: int, scale: float):
    keys = gather_latents(own, (idx - n_prompt).clamp(min=0)) if own is not None else None
    if prompt is not None and n_prompt:
        from_prompt = gather_latents(prompt, idx.clamp(max=n_prompt - 1))
        keys = from_prompt if keys is None else torch.where((idx < n_prompt)[..., None], from_prompt, keys)
    acc = acc_dtype(q)
    assert keys is not None  # a selection picks from the prompt's entries or the own ones
    keys = keys.to(acc)
    scores = torch.einsum("bhnd,bnkd->bhnk", q.to(acc), keys) * scale
    out, lse = _safe_softmax_part(scores, valid[:, None], lambda p: torch.einsum("bhnk,bnkd->bhnd", p, keys))
    return out.to(q.dtype), lse


def gathered_entry_part(q, prompt, own, selection: Selection, scale: float):
    """(out, lse) of q `[B, H, S, D]` over the entries `selection` picks from [prompt entries `[1|B, 1, n, D]` |
    own entries `[B, 1, k, D]`]. Queries run in blocks whose gathered keys fit a quarter of `TILE_ELEMENTS`;
    with grad each block is checkpointed (saves its query rows and indices, gathers again in backward)."""
    assert selection.indices is not None and selection.valid is not None  # callers take the dense parts otherwise
    b, h, s, d = q.shape
    kk = selection.indices.shape[-1]
    rows = max(1, min(s, TILE_ELEMENTS // max(1, 4 * b * kk * max(d, h))))
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, prompt, own))
    outs, lses = [], []
    for r0 in range(0, s, rows):
        args = (
            q[:, :, r0 : r0 + rows],
            prompt,
            own,
            selection.indices[:, r0 : r0 + rows],
            selection.valid[:, r0 : r0 + rows],
            selection.prompt_length,
            scale,
        )
        o, l = checkpoint(_gathered_block, *args, use_reentrant=False) if grad else _gathered_block(*args)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def merge_parts(base, *parts):
    """Merge (out, lse) parts over disjoint key sets into `base`'s (whose lse is finite: the sliding part, which
    holds each query's own key). Returns (out, lse)."""
    out, lse = base
    for o, l in parts:
        out, _ = merge_by_lse(o, l, out, lse)
        lse = torch.logaddexp(l, lse)
    return out, lse


def apply_sinks(out, lse, sinks):
    """Attention sinks `[H]` (a logit per head with no value) after the last merge: out · sigmoid(lse − sink)."""
    keep = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
    return (out.to(keep.dtype) * keep[..., None]).to(out.dtype)


# ------------------------------------------------------------------------------------------- references


def reference_pool(kv, gate, position_bias, head_dim: int, overlap: bool):
    """Raw pooled entries `[B, n, D]` of every complete window of a whole sequence `kv`, `gate` `[B, T, F]`, one
    window at a time, written from the paper's definition (not from transformers' layout)."""
    m = position_bias.shape[0]
    n = kv.shape[1] // m
    out = []
    for w in range(n):
        cur = slice(w * m, (w + 1) * m)
        if overlap:
            c = kv[:, cur, head_dim:]
            z = gate[:, cur, head_dim:] + position_bias[:, head_dim:]
            if w > 0:
                prev = slice((w - 1) * m, w * m)
                c = torch.cat([kv[:, prev, :head_dim], c], dim=1)
                z = torch.cat([gate[:, prev, :head_dim] + position_bias[:, :head_dim], z], dim=1)
        else:
            c, z = kv[:, cur], gate[:, cur] + position_bias
        out.append((c * torch.softmax(z.float(), dim=1).to(c.dtype)).sum(dim=1))
    return torch.stack(out, dim=1) if out else kv.new_zeros((kv.shape[0], 0, head_dim))


def reference_compressed_attention(q, keys, entries, positions, scale: float, window: int, sinks=None, allowed=None):
    """Plain attention of q `[B, H, S, D]` (queries at the last S positions of `keys` `[B, 1, T, D]`, K = V)
    over its sliding window and the `entries` `[B, 1, n, D]` visible from `positions` `[n]` (and `allowed`
    `[B, S, n]` if given), with sinks `[H]`: every score materialised, one softmax."""
    acc = acc_dtype(q)
    t, s = keys.shape[2], q.shape[2]
    kv = torch.cat([keys, entries], dim=2).to(acc)
    scores = torch.matmul(q.to(acc), kv.transpose(-1, -2)) * scale
    qp = torch.arange(t - s, t, device=q.device)[:, None]
    kp = torch.arange(t, device=q.device)[None, :]
    vis_w = (kp <= qp) & (kp > qp - window)
    vis_e = positions[None, :] <= qp
    vis = torch.cat(
        [vis_w.expand(q.shape[0], s, t), vis_e.expand(q.shape[0], s, -1) if allowed is None else vis_e & allowed],
        dim=-1,
    )
    scores = scores.masked_fill(~vis[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, kv).to(q.dtype)
