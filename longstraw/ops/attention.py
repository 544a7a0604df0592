"""Split attention: response queries over [prompt K/V | own K/V] without concatenating them.

A replayed branch of R tokens attends to the durable prompt keys and to its own R keys.
Concatenating the two (what `DynamicLayer.update` does) puts a copy of the whole prompt K/V into
every branch's autograd graph, and an eager softmax saves an R×P probability matrix for backward.
`SplitAttention` computes each part separately, returning its output and log-sum-exp, merges them by
log-sum-exp, and saves only its inputs (references, not copies), the merged output and the two
log-sum-exps. Backward recomputes each part: with w_a the merge weight of part a, the gradient of
part a is ordinary attention backward with incoming gradient w_a·dO and the *merged* output in the
softmax-correction term, so each part needs only its own (out, lse) kernel pair.

The kernels that compute one part (`longstraw.ops.kernels`: reference, blockwise, fused CPU and CUDA flash
attention) and the table that picks one per part live in `longstraw.ops.kernels`.

Shapes: q `[B, H, R, D]`, k `[B, Hkv, T, D]`, v `[B, Hkv, T, Dv]`, H a multiple of Hkv. The prompt part's
k / v may also be a compressed state (`longstraw.ops.quant.QuantizedTokens`) or live in host memory; the
kernels read it tile by tile. Positions: see `longstraw.ops.kernels.part`.

`reference_attention` is the plain version (materialise all scores, mask, softmax) that the tests
hold the kernels equal to.
"""

from __future__ import annotations

import torch

# re-exported: the compressed and latent attention modules and the planner use them
from .kernels import TILE_ELEMENTS, Part, part_backward, part_forward  # noqa: F401
from .kernels.part import acc_dtype as acc_dtype  # noqa: F401

DEFAULT_BLOCK = 1024


# ----------------------------------------------------------------------------------------- the Function


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Combine two attention parts over disjoint key sets into the attention over their union.

    out = (e^lse_a·out_a + e^lse_b·out_b) / (e^lse_a + e^lse_b); returns (out, w_a) with w_a the
    weight of part a `[B, H, R]`. `lse_b` must be finite (every query sees itself in the own part);
    `lse_a` may be −inf (no visible key), giving out_b. The merge runs in float32 (float64 for float64
    inputs) and returns out in out_b's dtype: a half-precision merge would round each part once more.
    """
    w_a = torch.sigmoid(lse_a - lse_b)
    acc = w_a.dtype
    out = out_b.to(acc) + w_a[..., None] * (out_a.to(acc) - out_b.to(acc))
    return out.to(out_b.dtype), w_a


def fold_batch(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, R, ...]` → `[1, H, B·R, ...]`: B sequences' queries as rows against one shared prompt."""
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def unfold_batch(x: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of `fold_batch` for a batch of `b`."""
    return x.reshape(x.shape[1], b, x.shape[2] // b, *x.shape[3:]).transpose(0, 1)


class SplitAttention(torch.autograd.Function):
    """Attention of q over [prompt part | own part] → (out `[B, H, R, Dv]`, lse `[B, H, R]` float32 of the
    merged scores); saves inputs by reference, the merged output and the two log-sum-exps: nothing of
    size R×T and no copy of the prompt K/V. Both outputs are differentiable (sinks read the lse).

    A prompt part of batch 1 serves queries of batch B (G sequences sampled from one prompt): their
    rows are folded into one batch row, so the prompt K/V is read once and never repeated."""

    @staticmethod
    def forward(
        ctx,
        q,
        own_k,
        own_v,
        prompt_k,
        prompt_v,
        own: Part,
        prompt: Part | None,
        carried_k=None,
        carried_v=None,
        carried: Part | None = None,
    ):
        ctx.set_materialize_grads(False)
        if carried is not None:
            return _CarriedParts.forward(
                ctx, q, own_k, own_v, prompt_k, prompt_v, own, prompt, carried_k, carried_v, carried
            )
        ctx.carried = None
        out_o, lse_o = part_forward(q, own_k, own_v, own)
        if prompt is None:
            out, lse_p, lse = out_o, None, lse_o
        else:
            out_p, lse_p = prompt_forward(q, prompt_k, prompt_v, prompt)
            out, _ = merge_by_lse(out_p, lse_p, out_o, lse_o)
            lse = torch.logaddexp(lse_p, lse_o)
        stored = isinstance(prompt_k, torch.Tensor)  # else a compressed state: a constant, kept by reference
        ctx.save_for_backward(
            q, own_k, own_v, prompt_k if stored else None, prompt_v if stored else None, out, lse_o, lse_p
        )
        ctx.compressed = None if stored else (prompt_k, prompt_v)
        ctx.parts = (own, prompt)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if ctx.carried is not None:
            return _CarriedParts.backward(ctx, dout, dlse)
        q, own_k, own_v, prompt_k, prompt_v, out, lse_o, lse_p = ctx.saved_tensors
        if ctx.compressed is not None:
            prompt_k, prompt_v = ctx.compressed
        own, prompt = ctx.parts
        need = ctx.needs_input_grad
        if dout is None:
            dout = torch.zeros_like(out)
        if prompt is None:
            dq, dk, dv = part_backward(dout, q, own_k, own_v, out, lse_o, own, need_kv=True, g_lse=dlse)
            return dq, dk, dv, None, None, None, None, None, None, None
        w_p = torch.sigmoid(lse_p - lse_o)[..., None]
        g_p = (dout.to(w_p.dtype) * w_p).to(dout.dtype)
        g_o = (dout.to(w_p.dtype) * (1 - w_p)).to(dout.dtype)
        # the merged lse's gradient reaches part a with weight w_a, and w_a · (Δ − g_lse) is what the
        # part's correction term needs: pass g_lse itself (each part's dO is already weighted by w_a,
        # so its Δ is too; the lse shift is weighted by w_a here)
        gl_p = None if dlse is None else dlse * w_p[..., 0]
        gl_o = None if dlse is None else dlse * (1 - w_p[..., 0])
        dq_o, dk, dv = part_backward(g_o, q, own_k, own_v, out, lse_o, own, need_kv=True, g_lse=gl_o)
        dq_p, dkp, dvp = prompt_backward(g_p, q, prompt_k, prompt_v, out, lse_p, prompt, need[3] or need[4], gl_p)
        return dq_o + dq_p, dk, dv, dkp, dvp, None, None, None, None, None


def prompt_forward(q, prompt_k, prompt_v, prompt: Part):
    """(out, lse) of the prompt part; a prompt of batch 1 read by B > 1 query rows serves them folded into one row
    block (`fold_batch`), so its K/V are read once."""
    b = q.shape[0]
    if b > 1 and prompt_k.shape[0] == 1:
        out_p, lse_p = part_forward(fold_batch(q), prompt_k, prompt_v, prompt)
        return unfold_batch(out_p, b), unfold_batch(lse_p, b)
    return part_forward(q, prompt_k, prompt_v, prompt)


def prompt_backward(g, q, prompt_k, prompt_v, out, lse, prompt: Part, need_kv: bool, g_lse):
    """(dq, dk, dv) of the prompt part (`part_backward`), folded as `prompt_forward` folded it."""
    b = q.shape[0]
    if b > 1 and prompt_k.shape[0] == 1:
        dq, dk, dv = part_backward(
            fold_batch(g),
            fold_batch(q),
            prompt_k,
            prompt_v,
            fold_batch(out),
            fold_batch(lse),
            prompt,
            need_kv=need_kv,
            g_lse=None if g_lse is None else fold_batch(g_lse),
        )
        return unfold_batch(dq, b), dk, dv
    return part_backward(g, q, prompt_k, prompt_v, out, lse, prompt, need_kv=need_kv, g_lse=g_lse)


class _CarriedParts:
    """`SplitAttention` with a third part between the prompt and the own keys: a segmented replay's earlier own K/V
    (`carried_k` / `carried_v` `[1, Hkv, C, D]`, `longstraw.replay.segments`), read in place instead of concatenated
    with the forward's own. Every part's (out, lse) is merged by log-sum-exp in float32; the backward runs each part
    with dO weighted by its share of the softmax mass, w_i = exp(lse_i − lse), and the merged output (the split-softmax
    identity: P = w_i · P_i), so no part's log-sum-exp needs a gradient and the fused kernels serve every part.
    Saves inputs by reference, the merged output and the log-sum-exps: nothing of size R × T."""

    @staticmethod
    def forward(ctx, q, own_k, own_v, prompt_k, prompt_v, own, prompt, carried_k, carried_v, carried):
        pieces = [part_forward(q, own_k, own_v, own), part_forward(q, carried_k, carried_v, carried)]
        if prompt is not None:
            pieces.append(prompt_forward(q, prompt_k, prompt_v, prompt))
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        lses = torch.stack([lse.to(acc) for _, lse in pieces])
        lse = torch.logsumexp(lses, 0)
        out = sum(torch.exp(li - lse)[..., None] * o.to(acc) for (o, _), li in zip(pieces, lses))
        out = out.to(q.dtype)
        stored = prompt is None or isinstance(prompt_k, torch.Tensor)
        ctx.save_for_backward(
            q,
            own_k,
            own_v,
            carried_k,
            carried_v,
            prompt_k if stored else None,
            prompt_v if stored else None,
            out,
            lses,
            lse,
        )
        ctx.compressed = None if stored else (prompt_k, prompt_v)
        ctx.parts = (own, prompt)
        ctx.carried = carried
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, own_k, own_v, carried_k, carried_v, prompt_k, prompt_v, out, lses, lse = ctx.saved_tensors
        if ctx.compressed is not None:
            prompt_k, prompt_v = ctx.compressed
        own, prompt = ctx.parts
        need = ctx.needs_input_grad
        if dout is None:
            dout = torch.zeros_like(out)
        w = torch.exp(lses - lse)  # [parts, B, H, R]: each part's share of the softmax mass

        def weighted(i):  # part i's dO and log-sum-exp gradient: weighted by its share of the softmax mass
            g = (dout.to(w.dtype) * w[i][..., None]).to(dout.dtype)
            return g, None if dlse is None else dlse * w[i]

        g, gl = weighted(0)
        dq, dk, dv = part_backward(g, q, own_k, own_v, out, lses[0], own, need_kv=True, g_lse=gl)
        g, gl = weighted(1)
        dq_c, dkc, dvc = part_backward(g, q, carried_k, carried_v, out, lses[1], ctx.carried, need[8] or need[9], gl)
        dq = dq + dq_c
        dkp = dvp = None
        if prompt is not None:
            g, gl = weighted(2)
            dq_p, dkp, dvp = prompt_backward(g, q, prompt_k, prompt_v, out, lses[2], prompt, need[3] or need[4], gl)
            dq = dq + dq_p
        return dq, dk, dv, dkp, dvp, None, None, dkc, dvc, None


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
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    with_lse: bool = False,
    carried: tuple[torch.Tensor, torch.Tensor, int] | None = None,
):
    """Attention of q `[B, H, R, D]` over [prompt | own] keys: out `[B, H, R, Dv]`.

    `carried` (keys `[1, Hkv, C, D]`, values, the position of the first): a third part between the prompt and the
    own keys, read in place (`_CarriedParts`: a segmented replay's earlier own K/V); None: none.

    own K/V have batch B; the prompt K/V batch B or 1 (shared by all B sequences).
    Gradients reach `prompt_k` / `prompt_v` only if they require grad (exact mode).
    `chunk`: chunked local attention (`Part.chunk`). `sinks` `[H]`: a learned logit per head in the
    softmax denominator with no value (gpt-oss): a third part with lse = sink and output 0, merged by
    log-sum-exp, out · sigmoid(lse − sink); the sinks get their gradient from autograd.
    `with_lse`: return (out, lse `[B, H, R]` float) without sinks, for a caller that merges more parts
    (DeepSeek-V4's compressed entries, `longstraw.ops.compressed_attention`); both are differentiable.
    """
    for k in (own_k, prompt_k):
        if k is not None and (k.shape[1] == 0 or q.shape[1] % k.shape[1]):
            raise ValueError(f"query heads ({q.shape[1]}) must be a positive multiple of key heads ({k.shape[1]})")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    own = Part(int(q_start), int(own_start), window, softcap, scale, int(block), chunk=chunk)
    prompt = None
    if prompt_k is not None and prompt_k.shape[-2] > 0:
        if prompt_k.shape[0] not in (1, q.shape[0]):
            raise ValueError(f"prompt batch {prompt_k.shape[0]} must be 1 or the query batch {q.shape[0]}")
        period = q.shape[2] if prompt_k.shape[0] == 1 and q.shape[0] > 1 else None
        prompt = Part(int(q_start), int(prompt_start), window, softcap, scale, int(block), period, chunk)
        last = prompt_start + prompt_k.shape[-2] - 1
        # a sliding window or an attention chunk may leave no prompt key visible to any query
        if window is not None and last <= q_start - window:
            prompt = None
        if chunk is not None and last < (q_start // chunk) * chunk:
            prompt = None
    if prompt is None:
        prompt_k = prompt_v = None
    carried_k = carried_v = carried_part = None
    if carried is not None and carried[0].shape[-2] > 0:
        carried_k, carried_v, carried_start = carried
        carried_part = Part(int(q_start), int(carried_start), window, softcap, scale, int(block), chunk=chunk)
    out, lse = SplitAttention.apply(
        q, own_k, own_v, prompt_k, prompt_v, own, prompt, carried_k, carried_v, carried_part
    )
    if with_lse:
        if sinks is not None:
            raise ValueError("with_lse returns the parts' merge before sinks: apply the sinks after the last merge")
        return out, lse
    if sinks is not None:
        keep = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
        out = (out.to(keep.dtype) * keep[..., None]).to(out.dtype)
    return out


def reference_attention(q, k, v, q_start, k_start, scale=None, window=None, softcap=None, chunk=None, sinks=None):
    """Plain masked softmax attention (all scores materialised, K/V repeated per query head); `sinks` `[H]`
    as an extra column of the softmax whose value is 0."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = acc_dtype(q)
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1).to(dtype)
    v = v.repeat_interleave(g, dim=1).to(dtype)
    s = torch.matmul(q.to(dtype), k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    r, t = q.shape[2], k.shape[2]
    qp = torch.arange(q_start, q_start + r, device=q.device)[:, None]
    kp = torch.arange(k_start, k_start + t, device=q.device)[None, :]
    vis = kp <= qp
    if window is not None:
        vis = vis & (kp > qp - window)
    if chunk is not None:
        vis = vis & (kp // chunk == qp // chunk)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).reshape(1, -1, 1, 1).expand(s.shape[0], -1, r, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v).to(q.dtype)
