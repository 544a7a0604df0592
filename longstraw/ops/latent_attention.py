"""Multi-head latent attention (MLA) in latent space, and DeepSeek sparse attention (DSA) selection.

MLA (DeepSeek-V2/V3, Kimi, GLM-5) caches per token one compressed latent `c` (`kv_lora_rank`) and
one shared rotary key `k_rot` (`qk_rope_head_dim`); transformers expands them per head with
`kv_b_proj` (W, `[H·(dn + dv), r]`) before attention. Expanding the prompt would cost
heads × P × head_dim per layer. Instead the up-projections are absorbed:

    score(h) = q_nope(h) · W_k(h) c + q_rot(h) · k_rot = [W_k(h)ᵀ q_nope(h) | q_rot(h)] · [c | k_rot]
    out(h)   = Σ p(h) W_v(h) c = W_v(h) (Σ p(h) c)

so attention runs as multi-query attention with one key head of width r + dr (the latent itself) and
values `c` (its first r columns): `latent_attention` below, through the split attention of
`longstraw.ops.attention` (saves only output and log-sum-exp, never an R×P score tensor).

DSA adds an indexer: each query scores every earlier key with its own small multi-head projection
(Σ_h w_h · relu(scale · q_h · k)) and attends only to its `index_topk` best keys. `select_topk`
scores the keys tile by tile and keeps a running top-k (memory O(R · top-k) plus one tile),
`sparse_latent_attention` gathers the selected latents per block of queries (memory O(rows · top-k ·
(r + dr)) per block, recomputed in backward).

`reference_latent_attention` and `reference_topk` are the plain versions (expand, full score
matrix, mask) the tests hold these equal to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from .attention import TILE_ELEMENTS, split_attention


def absorbed_weights(kv_b_proj, heads: int, nope_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_k `[r, H, dn]`, W_v `[r, H, dv]`) of the up-projection `kv_b_proj` (any linear module without bias,
    PEFT adapters included: their effective weight is read by applying the module to the identity, which
    costs r² · H · (dn + dv) per call; a plain `nn.Linear` is read directly). Adapter dropout, if any,
    would apply to the identity's rows rather than to the latents: use LoRA dropout 0 on `kv_b_proj`."""
    if type(kv_b_proj) is torch.nn.Linear and kv_b_proj.bias is None:
        w = kv_b_proj.weight.t()
    else:  # e.g. a PEFT LoRA layer: row i of module(I) is W_eff e_i, i.e. W_effᵀ
        ref = next(kv_b_proj.parameters())
        w = kv_b_proj(torch.eye(kv_b_proj.in_features, dtype=ref.dtype, device=ref.device))
    w = w.reshape(w.shape[0], heads, nope_dim + v_dim)
    return w[..., :nope_dim], w[..., nope_dim:]


def absorb_query(q_nope: torch.Tensor, q_rot: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """Latent-space query `[B, H, S, r + dr]` from q_nope `[B, H, S, dn]`, q_rot `[B, H, S, dr]`."""
    return torch.cat([torch.einsum("bhsd,rhd->bhsr", q_nope, w_k), q_rot], dim=-1)


def expand_output(out_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """Per-head output `[B, S, H·dv]` from the latent-space output `[B, H, S, r]`."""
    b, h, s, _ = out_latent.shape
    return torch.einsum("bhsr,rhv->bshv", out_latent, w_v).reshape(b, s, -1)


def latent_attention(query, own, prompt, rank: int, *, q_start: int, own_start: int, scale: float, block: int):
    """Dense MLA of latent queries `[B, H, S, r + dr]` over [prompt latents `[1|B, 1, P, r + dr]` | own latents
    `[B, 1, T, r + dr]`]; out `[B, H, S, r]` (values are the first `rank` columns of each latent).

    The latents serve as keys and as values whole (the output's last dr columns are dropped): keys and
    values of one width let the fused CPU attention kernel run (`longstraw.ops.attention`), for dr / r more
    value work, and the dropped columns get zero gradient."""
    out = split_attention(
        query, own, own, prompt, prompt, q_start=q_start, own_start=own_start, prompt_start=0, scale=scale, block=block
    )
    return out[..., :rank]


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in the accumulation dtype: float32, or float64 for float64 inputs."""
    return x if x.dtype == torch.float64 else x.float()


# ------------------------------------------------------------------------------------------------- DSA


@dataclass
class Selection:
    """Top-k keys of each query: `indices` `[B, S, K]` into [prompt keys (P) | own keys (T)], `valid`
    `[B, S, K]` (False where a query has fewer than K visible keys). `None` indices: every visible key."""

    indices: torch.Tensor | None
    valid: torch.Tensor | None
    prompt_length: int


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """DSA indexer scores `[B, S, T]` = Σ_h weights[h] · relu(scale · q[h] · k), in float32, computed with the
    same operations as transformers 5.24 (`GlmMoeDsaIndexer` / `DeepseekV32Indexer`) so that the selection
    agrees with a full-sequence forward. q `[B, S, Hi, Di]`, weights `[B, S, Hi]`, keys `[B|1, T, Di]`."""
    s = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))
    s = s.mul_(scale).relu_()  # in place: one [B, S, Hi, T] tile alive, same values as `relu(s * scale)`
    return torch.matmul(weights.float().unsqueeze(-2), s).squeeze(-2)


def select_topk(
    q,
    weights,
    scale: float,
    prompt_keys,
    own_keys,
    topk: int,
    *,
    q_start: int,
    own_start: int,
    block: int,
    own_positions: torch.Tensor | None = None,
) -> Selection:
    """Each query's `topk` best keys over [prompt keys `[1, P, Di]` | own keys `[B, T, Di]`] (own key j is
    visible to query i when `own_start + j ≤ q_start + i`, or with `own_positions` `[T]` when
    `own_positions[j] ≤ q_start + i`: DeepSeek-V4's compressed entries become visible when their window closes).

    Keys are scored in tiles of at most `block` keys (fewer where S · heads · keys would pass `TILE_ELEMENTS`),
    and the head-summed scores of up to min(`TILE_ELEMENTS` / S, 8 · `block`) keys are merged at once into a
    running top-k: no `[S, P]` score tensor exists beyond one such block; memory O(B · S · top-k) plus one
    block. Where `topk` covers all keys, returns `indices=None`."""
    b, s = q.shape[:2]
    p = 0 if prompt_keys is None else prompt_keys.shape[-2]
    t = own_keys.shape[-2]
    k = min(topk, p + t)
    if k >= p + t:
        return Selection(None, None, p)
    qpos = torch.arange(q_start, q_start + s, device=q.device)
    tile = max(1, min(block, TILE_ELEMENTS // max(1, b * s * q.shape[2])))
    merge = max(tile, min(TILE_ELEMENTS // max(1, b * s), 8 * block))
    vals = q.new_empty((b, s, 0), dtype=torch.float32)
    idx = torch.empty((b, s, 0), dtype=torch.long, device=q.device)
    # key spans: the prompt's (all visible), then the own keys' (causal); `first`: index into [prompt | own]
    spans: list[tuple[torch.Tensor, int, int, int, int | None]] = [
        (prompt_keys, m0, min(merge, p - m0), m0, None) for m0 in range(0, p, merge)
    ]
    spans += [(own_keys, m0, min(merge, t - m0), p + m0, own_start + m0) for m0 in range(0, t, merge)]
    for keys, m0, n, first, pos in spans:
        scores = []
        for s0 in range(m0, m0 + n, tile):
            scores.append(index_scores(q, weights, keys[:, s0 : min(s0 + tile, m0 + n)], scale))
        sc = torch.cat([vals] + scores, dim=-1)
        if pos is not None:
            kpos = (
                torch.arange(pos, pos + n, device=q.device)
                if own_positions is None
                else own_positions[pos - own_start : pos - own_start + n]
            )
            sc[..., vals.shape[-1] :].masked_fill_(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        kept = vals.shape[-1]
        vals, pick = sc.topk(min(k, sc.shape[-1]), dim=-1)
        new = pick - kept + first  # candidates past the kept ones are keys first, first + 1, ...
        idx = new if kept == 0 else torch.where(pick < kept, idx.gather(-1, pick.clamp(max=kept - 1)), new)
    return Selection(idx, vals > float("-inf"), p)


def gather_latents(latents, idx: torch.Tensor) -> torch.Tensor:
    """Rows `idx` `[B, n, K]` of latents `[1|B, 1, T, D]` (batch 1 shared by all B) → `[B, n, K, D]`; a compressed
    state (`longstraw.ops.quant.QuantizedTokens`) dequantizes only those rows."""
    if not isinstance(latents, torch.Tensor):
        return latents.gather_rows(idx)
    bl, _, t, d = latents.shape
    flat = latents[:, 0].reshape(bl * t, d)
    if bl > 1:
        idx = idx + (torch.arange(bl, device=idx.device) * t)[:, None, None]
    return flat[idx]


def _sparse_block(query, prompt, own, idx, valid, prompt_length: int, rank: int, scale: float):
    """One block of queries `[B, H, n, D]` over their selected keys `idx` `[B, n, K]`; out `[B, H, n, r]`."""
    keys = gather_latents(own, (idx - prompt_length).clamp(min=0))
    if prompt is not None and prompt_length:
        from_prompt = gather_latents(prompt, idx.clamp(max=prompt_length - 1))
        keys = torch.where((idx < prompt_length)[..., None], from_prompt, keys)
    scores = torch.einsum("bhnd,bnkd->bhnk", _acc(query), _acc(keys)) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhnk,bnkr->bhnr", probs, _acc(keys[..., :rank])).to(query.dtype)


def sparse_latent_attention(
    query, own, prompt, selection: Selection, rank: int, *, q_start: int, own_start: int, scale: float, block: int
):
    """MLA of latent queries `[B, H, S, r + dr]` over the keys `selection` picked from [prompt latents
    `[1|B, 1, P, r + dr]` | own latents `[B, 1, T, r + dr]`]: out `[B, H, S, r]`.

    Queries run in blocks whose gathered keys fit a quarter of `TILE_ELEMENTS`; with grad, each block is checkpointed
    (saves its query rows and indices, recomputes the gather in backward). Where `selection.indices` is
    None (top-k covers every key) this is ordinary dense latent attention."""
    if selection.indices is None:
        return latent_attention(
            query, own, prompt, rank, q_start=q_start, own_start=own_start, scale=scale, block=block
        )
    assert selection.valid is not None  # set with the indices
    b, h, s, d = query.shape
    kk = selection.indices.shape[-1]
    # a block gathers rows × K latents three times (own, prompt, merged): a quarter tile each
    rows = max(1, min(s, TILE_ELEMENTS // max(1, 4 * b * kk * max(d, h))))
    outs = []
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, own, prompt))
    for r0 in range(0, s, rows):
        args = (
            query[:, :, r0 : r0 + rows],
            prompt,
            own,
            selection.indices[:, r0 : r0 + rows],
            selection.valid[:, r0 : r0 + rows],
            selection.prompt_length,
            rank,
            scale,
        )
        outs.append(checkpoint(_sparse_block, *args, use_reentrant=False) if grad else _sparse_block(*args))
    return torch.cat(outs, dim=2)


# ------------------------------------------------------------------------------------------- references


def reference_latent_attention(
    q_nope,
    q_rot,
    latents,
    kv_b_proj,
    heads: int,
    nope_dim: int,
    v_dim: int,
    rank: int,
    *,
    q_start: int,
    scale: float,
    allowed: torch.Tensor | None = None,
):
    """Plain MLA as transformers computes it: expand every latent `[B, 1, T, r + dr]` (keys from position 0) to
    per-head K/V with `kv_b_proj`, full scores, causal mask (and `allowed` `[B, S, T]` if given), softmax.
    Returns `[B, S, H·dv]` (before `o_proj`)."""
    b, _, t, _ = latents.shape
    c, k_rot = latents[..., :rank], latents[..., rank:]
    kv = kv_b_proj(c[:, 0]).view(b, t, heads, nope_dim + v_dim).transpose(1, 2)
    k = torch.cat([kv[..., :nope_dim], k_rot.expand(b, heads, t, -1)], dim=-1)
    v = kv[..., nope_dim:]
    q = torch.cat([q_nope, q_rot], dim=-1)
    s = q.shape[2]
    scores = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    qpos = torch.arange(q_start, q_start + s, device=q.device)
    mask = torch.arange(t, device=q.device)[None, :] <= qpos[:, None]
    mask = mask[None].expand(b, s, t)
    if allowed is not None:
        mask = mask & allowed
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), _acc(v)).to(q.dtype)
    return out.transpose(1, 2).reshape(b, s, -1)


def reference_topk(q, weights, keys, scale: float, topk: int, *, q_start: int) -> torch.Tensor:
    """Boolean `[B, S, T]`: the keys (from position 0) each query selects, from the full score matrix."""
    scores = index_scores(q, weights, keys, scale)
    b, s, t = scores.shape
    qpos = torch.arange(q_start, q_start + s, device=q.device)
    visible = torch.arange(t, device=q.device)[None, :] <= qpos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    idx = scores.topk(min(topk, t), dim=-1).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, idx, True)
    return chosen & visible[None]
