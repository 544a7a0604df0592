"""Attention of one batch whose rows have different own lengths: a ragged decode step (`longstraw.ragged`), or the
responses of several rows replayed together with autograd (`longstraw.replay.batched.replay_branches`).

Rows are branches of one prompt that grew apart (the rows of a step sharing a document, each after its own question;
the G trajectories of an agent, each after its own turns and tool output). Their own K/V are held right-aligned in
one tensor `[B, Hkv, L, D]`: row b's keys are columns `pads[b]:`, the first at position `own_starts[b]`, the last R
its queries' own (every row appends the same number of tokens per forward, so the alignment holds).

- The prompt part (batch 1) is read once for the whole batch when every row sees all of it (no window, no chunk:
  every prompt key is before every query), the rows' queries folded into one row block as `SplitAttention` folds
  them; else (a sliding window or an attention chunk, whose prompt part is at most a window or a chunk) every row's
  scores against it are masked by that row's positions.
- The own part is one masked batch: scores `[B, H, R, L]` with the padding, causality, the window and the chunk
  masked per row.
The parts merge by log-sum-exp, then attention sinks apply, as in `split_attention`. Memory: the folded prompt
kernel's tiles + O(B · H · R · (L + window)) scores; time per row as the single-row decode's.

With autograd (q or the own K/V require grad; the prompt K/V are constants, as in the detached replay), backward
recomputes the own part (and a masked prompt part) under autograd and takes the whole-prompt part's gradient from
its kernel (`prompt_backward`): nothing of size R × T is kept.

`reference` is the plain version (each row on its own through `split_attention`) the tests hold this one equal to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import fold_batch, merge_by_lse, prompt_backward, prompt_forward, split_attention, unfold_batch
from .kernels import Part
from .kernels.part import acc_dtype
from .quant import read_block


def _masked_part(q, k, v, q_pos, k_pos, valid, window, chunk, softcap, scale):
    """(out `[B, H, R, Dv]` in q's dtype, lse `[B, H, R]` float) of q over keys `k` `[Bk, Hkv, T, D]` (Bk = B or 1)
    at positions `k_pos` `[Bk, T]`, `valid` `[Bk, T]`, for queries at `q_pos` `[B, R]`; lse −inf and out 0 for a query
    that sees no key. Keys of batch 1 shared by B > 1 rows are read once: the rows' queries folded into one row block
    (`fold_batch`), each query masked by its own position. The query heads of one key head are rows of one product
    (`[B, Hkv, g·R, D]`): the keys are never repeated per query head."""
    b, h, r, _ = q.shape
    shared = k.shape[0] == 1 and b > 1
    if shared:
        q, q_pos = fold_batch(q), q_pos.reshape(1, b * r)
    acc = acc_dtype(q)
    bq, _, rq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.reshape(bq, hkv, g * rq, d).to(acc)  # query head j·g + i of key head j: rows i·R … (i + 1)·R − 1
    kf = read_block(k, 0, k.shape[2], acc, q.device)
    vf = read_block(v, 0, v.shape[2], acc, q.device)
    s = torch.matmul(qg, kf.transpose(-1, -2)) * scale  # [B, Hkv, g·R, T]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qp, kp = q_pos.repeat(1, g)[:, None, :, None], k_pos[:, None, None, :]  # [B, 1, g·R, 1], [Bk, 1, 1, T]
    vis = (kp <= qp) & valid[:, None, None, :]
    if window is not None:
        vis = vis & (kp > qp - window)
    if chunk is not None:
        vis = vis & (kp // chunk == qp // chunk)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.matmul(p, vf).to(q.dtype).reshape(bq, h, rq, -1)
    lse = lse.reshape(bq, h, rq)
    if shared:
        return unfold_batch(out, b), unfold_batch(lse, b)
    return out, lse


@dataclass(frozen=True)
class _Layout:
    """Where a ragged batch's keys and queries sit (see `ragged_attention`): own keys' positions `k_pos` `[B, L]` and
    which are real `valid` `[B, L]`, the queries' positions `q_pos` `[B, R]`, the prompt part's kernel `Part` when
    every row sees the whole prompt (else None: the prompt is masked per row, `p_pos` `[1, T]` its positions)."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    valid: torch.Tensor
    part: Part | None
    p_pos: torch.Tensor | None
    window: int | None
    chunk: int | None
    softcap: float | None
    scale: float


def _parts(q, own_k, own_v, prompt_k, prompt_v, at: _Layout):
    """(out, lse) of the own part, and of the prompt part (None, None without one)."""
    out_o, lse_o = _masked_part(
        q, own_k, own_v, at.q_pos, at.k_pos, at.valid, at.window, at.chunk, at.softcap, at.scale
    )
    if prompt_k is None:
        return out_o, lse_o, None, None
    if at.part is not None:  # every row sees every prompt key: one folded read of the prompt
        out_p, lse_p = prompt_forward(q, prompt_k, prompt_v, at.part)
    else:
        assert at.p_pos is not None  # set with part None and a prompt
        every = torch.ones_like(at.p_pos, dtype=torch.bool)
        out_p, lse_p = _masked_part(
            q, prompt_k, prompt_v, at.q_pos, at.p_pos, every, at.window, at.chunk, at.softcap, at.scale
        )
    return out_o, lse_o, out_p, lse_p


def _merged(out_o, lse_o, out_p, lse_p):
    """(out, lse) of the own part merged with the prompt part by log-sum-exp (the own part alone when out_p is None)."""
    if out_p is None:
        return out_o, lse_o
    out, _ = merge_by_lse(out_p, lse_p, out_o, lse_o)
    return out, torch.logaddexp(lse_p, lse_o)


class _RaggedSplit(torch.autograd.Function):
    """The ragged attention with autograd (a replay of several rows' responses together, `longstraw.replay.batched`):
    forward as without; backward recomputes the own part (and a masked prompt part: at most a window or a chunk) with
    autograd, and takes the whole-prompt part's gradient from its kernel (`prompt_backward`, the merged output in its
    correction term, as `SplitAttention` does). Saves q, the own K/V, the merged output and the parts' log-sum-exps;
    the prompt K/V by reference (constants: the detached replay)."""

    @staticmethod
    def forward(ctx, q, own_k, own_v, prompt_k, prompt_v, at: _Layout):
        ctx.set_materialize_grads(False)
        out_o, lse_o, out_p, lse_p = _parts(q, own_k, own_v, prompt_k, prompt_v, at)
        out, lse = _merged(out_o, lse_o, out_p, lse_p)
        ctx.save_for_backward(q, own_k, own_v, out, out_p, lse_p)
        ctx.prompt, ctx.at = (prompt_k, prompt_v), at
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, own_k, own_v, out, out_p, lse_p = ctx.saved_tensors
        prompt_k, prompt_v = ctx.prompt
        at = ctx.at
        if dout is None:
            dout = torch.zeros_like(out)
        kernel = prompt_k is not None and at.part is not None
        with torch.enable_grad():
            qd, kd, vd = (x.detach().requires_grad_() for x in (q, own_k, own_v))
            if kernel:  # the prompt part a constant here: its own gradient comes from its kernel below
                out_o, lse_o, _, _ = _parts(qd, kd, vd, None, None, at)
                merged, lse = _merged(out_o, lse_o, out_p, lse_p)
            else:
                out_o, lse_o, part_out, part_lse = _parts(qd, kd, vd, prompt_k, prompt_v, at)
                merged, lse = _merged(out_o, lse_o, part_out, part_lse)
            outs, grads = [merged], [dout]
            if dlse is not None:
                outs.append(lse)
                grads.append(dlse)
            dq, dk, dv = torch.autograd.grad(outs, (qd, kd, vd), grads, allow_unused=True)
        if kernel:
            w_p = torch.sigmoid(lse_p - lse_o.detach())[..., None]
            g_p = (dout.to(w_p.dtype) * w_p).to(dout.dtype)
            gl_p = None if dlse is None else dlse * w_p[..., 0]
            dq_p, _, _ = prompt_backward(g_p, q, prompt_k, prompt_v, out, lse_p, at.part, False, gl_p)
            dq = dq_p if dq is None else dq + dq_p
        return dq, dk, dv, None, None, None


def ragged_attention(
    q: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    prompt_k,
    prompt_v,
    *,
    pads: Sequence[int],
    own_starts: Sequence[int],
    prompt_start: int = 0,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    block: int = 1024,
) -> torch.Tensor:
    """Attention of q `[B, H, R, D]` over [prompt | each row's own keys]: `[B, H, R, Dv]` (see the module doc).

    `own_k` / `own_v` `[B, Hkv, L, D]` right-aligned: row b's own keys are `[:, pads[b]:]`, the first at position
    `own_starts[b]`, and its R queries sit at its last R own positions. `prompt_k` / `prompt_v` `[1, Hkv, T, D]`
    (a tensor, 8-bit `QuantizedTokens` or host memory) from `prompt_start`, or None: constants (a replay through it
    differentiates q and the own K/V, `_RaggedSplit`)."""
    b, _, r, _ = q.shape
    width = own_k.shape[-2]
    if len(pads) != b or len(own_starts) != b:
        raise ValueError(f"pads and own_starts must have one entry per row ({b}); got {len(pads)}, {len(own_starts)}")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    dev = q.device
    pad = torch.tensor(list(pads), device=dev)
    first = torch.tensor(list(own_starts), device=dev)
    col = torch.arange(width, device=dev)
    k_pos = first[:, None] + col[None, :] - pad[:, None]  # [B, L]
    q_pos = k_pos[:, width - r :]  # [B, R]: the last R own positions
    if prompt_k is not None and prompt_k.shape[-2] == 0:
        prompt_k = prompt_v = None
    part = p_pos = None
    if prompt_k is not None:
        if window is None and chunk is None:  # every row sees every prompt key
            part = Part(int(q_pos.min()), int(prompt_start), None, softcap, scale, int(block), r if b > 1 else None)
        else:
            p_pos = torch.arange(prompt_start, prompt_start + prompt_k.shape[-2], device=dev)[None]
    at = _Layout(q_pos, k_pos, col[None, :] >= pad[:, None], part, p_pos, window, chunk, softcap, scale)
    graph = torch.is_grad_enabled() and any(x.requires_grad for x in (q, own_k, own_v))
    if graph:
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in (prompt_k, prompt_v)):
            raise ValueError("ragged_attention differentiates q and the own K/V: the prompt K/V must be constants")
        out, lse = _RaggedSplit.apply(q, own_k, own_v, prompt_k, prompt_v, at)
    else:
        with torch.no_grad():
            out, lse = _merged(*_parts(q, own_k, own_v, prompt_k, prompt_v, at))
    if sinks is not None:
        keep = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
        out = (out.to(keep.dtype) * keep[..., None]).to(out.dtype)
    return out


def reference(q, own_k, own_v, prompt_k, prompt_v, *, pads, own_starts, prompt_start=0, **kw) -> torch.Tensor:
    """`ragged_attention` row by row: each row's own keys sliced out and attended through `split_attention`."""
    width, r = own_k.shape[-2], q.shape[2]
    rows = []
    for i, (p, s) in enumerate(zip(pads, own_starts)):
        rows.append(
            split_attention(
                q[i : i + 1],
                own_k[i : i + 1, :, p:],
                own_v[i : i + 1, :, p:],
                prompt_k,
                prompt_v,
                q_start=s + width - p - r,
                own_start=s,
                prompt_start=prompt_start,
                **kw,
            )
        )
    return torch.cat(rows)
