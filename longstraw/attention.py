"""Split attention: response queries over [prompt K/V | own K/V] without concatenating them.

A replayed branch of R tokens attends to the durable prompt keys and to its own R keys.
Concatenating the two (what `DynamicLayer.update` does) puts a copy of the whole prompt K/V into
every branch's autograd graph, and an eager softmax saves an R×P probability matrix for backward.
`SplitAttention` computes each part separately, returning its output and log-sum-exp, merges them by
log-sum-exp, and saves only its inputs (references, not copies), the merged output and the two
log-sum-exps. Backward recomputes each part: with w_a the merge weight of part a, the gradient of
part a is ordinary attention backward with incoming gradient w_a·dO and the *merged* output in the
softmax-correction term, so each part needs only its own (out, lse) kernel pair.

Kernels for one part (out, lse) and its backward:
- `blockwise`: plain PyTorch, any device, any mask (causal, sliding window), softcap. Walks the keys
  in blocks with an online softmax; transient memory O(heads · R · block).
- `flash_cpu`: PyTorch's fused CPU flash-attention kernel (`aten._scaled_dot_product_flash_attention_for_cpu`,
  present in torch 2.11–2.13), used on CPU when the part needs no mask (the prompt part of a
  full-attention layer) or a square causal mask (the own part), without softcap.

Shapes: q `[B, H, R, D]`, k `[B, Hkv, T, D]`, v `[B, Hkv, T, Dv]`, H a multiple of Hkv. The prompt part's
k / v may also be a compressed state (`longstraw.quant.QuantizedTokens`), which the blockwise kernel
dequantizes one key block at a time. Positions are
contiguous: query i sits at `q_start + i`, key j at `k_start + j`; a key is visible when it is not in
the future and, with a sliding window W, when `q_pos − k_pos < W` (W keys including the query's own,
as transformers counts).

`reference_attention` is the plain version (materialise all scores, mask, softmax) that the tests
hold both kernels equal to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import read_block

DEFAULT_BLOCK = 1024
#: Upper bound on the elements of one blockwise score tile (query rows × keys): 8 MiB in float32.
TILE_ELEMENTS = 1 << 21

_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_cpu_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


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
    #: batch row, see `SplitAttention`); None: all rows are consecutive positions.
    q_period: int | None = None
    #: chunked local attention (Llama 4): a query at p sees only keys of its own attention chunk,
    #: positions ≥ (p // chunk) · chunk; None: no such bound
    chunk: int | None = None

    def q_positions(self, r: int, device) -> torch.Tensor:
        idx = torch.arange(r, device=device)
        return self.q_start + (idx if self.q_period is None else idx % self.q_period)

    def q_last(self, r: int) -> int:
        return self.q_start + min(r, self.q_period or r) - 1


# ----------------------------------------------------------------------------------------- blockwise kernel


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs (gradient checks), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _visible(part: Part, r: int, s0: int, n: int, device) -> torch.Tensor | None:
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


def _blocks(part: Part, rows: int, r: int, t: int, device):
    """Yield (s0, n, mask) over the key blocks that hold at least one visible key."""
    block = min(part.block, max(16, TILE_ELEMENTS // max(rows, 1)))
    for s0 in range(0, t, block):
        n = min(block, t - s0)
        mask = _visible(part, r, s0, n, device)
        if mask is None or bool(mask.any()):
            yield s0, n, mask


def _scores(qf, kb, part: Part, mask, groups):
    """Scores `[B, Hkv, g·R, n]` in the accumulation dtype, and tanh of the softcap (or None)."""
    s = torch.matmul(qf, kb.transpose(-1, -2)) * part.scale
    t = None
    if part.softcap is not None:
        t = torch.tanh(s / part.softcap)
        s = t * part.softcap
    if mask is not None:
        s = s.masked_fill(~mask.repeat(groups, 1), float("-inf"))
    return s, t


def _grouped(x: torch.Tensor, hkv: int, dtype) -> torch.Tensor:
    """`[B, H, R, D]` → `[B, Hkv, g·R, D]`: query heads grouped under their key head (no K/V repeat)."""
    b, h, r, d = x.shape
    return x.reshape(b, hkv, (h // hkv) * r, d).to(dtype)


def blockwise_forward(q, k, v, part: Part):
    """One part's (out `[B, H, R, Dv]` in q's dtype, lse `[B, H, R]` float) by blocks over the keys.

    A query that sees no key of the part gets out 0 and lse −inf.
    """
    b, h, r, _ = q.shape
    hkv, t, dv = k.shape[1], k.shape[2], v.shape[-1]
    acc_dtype = _acc_dtype(q)
    qf = _grouped(q, hkv, acc_dtype)
    rows = qf.shape[2]
    m = torch.full((b, hkv, rows), float("-inf"), dtype=acc_dtype, device=q.device)
    l = torch.zeros((b, hkv, rows), dtype=acc_dtype, device=q.device)
    acc = torch.zeros((b, hkv, rows, dv), dtype=acc_dtype, device=q.device)
    for s0, n, mask in _blocks(part, b * h * r, r, t, q.device):
        s, _ = _scores(qf, read_block(k, s0, n, acc_dtype), part, mask, h // hkv)
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, read_block(v, s0, n, acc_dtype))
        m = m_new
    empty = l == 0
    out = acc / torch.where(empty, torch.ones_like(l), l)[..., None]
    lse = torch.where(empty, torch.full_like(l, float("-inf")), m + torch.log(l))
    return out.reshape(b, h, r, dv).to(q.dtype), lse.reshape(b, h, r)


def blockwise_backward(g_out, q, k, v, out, lse, part: Part, need_kv: bool, g_lse=None):
    """Gradients (dq, dk, dv) of one part, given its incoming gradient `g_out` (= w·dO) and the output
    `out` whose correction term applies (the merged output). dk, dv are None unless `need_kv`.

    `g_lse` `[B, H, R]`: the gradient of the merged log-sum-exp (attention sinks read it). Since
    ∂lse/∂s_j = p_j, it enters as a shift of the softmax-correction term: ds_j = p_j (dO·v_j − (Δ − g_lse))."""
    b, h, r, _ = q.shape
    hkv, t = k.shape[1], k.shape[2]
    acc_dtype = _acc_dtype(q)
    qf = _grouped(q, hkv, acc_dtype)
    do = _grouped(g_out, hkv, acc_dtype)
    delta = (do * _grouped(out, hkv, acc_dtype)).sum(-1)
    if g_lse is not None:
        delta = delta - g_lse.reshape(b, hkv, -1).to(acc_dtype)
    lse_f = lse.reshape(b, hkv, -1).to(acc_dtype)
    lse_safe = torch.where(torch.isinf(lse_f), torch.zeros_like(lse_f), lse_f)
    dq = torch.zeros_like(qf)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device) if need_kv else None
    dvv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device) if need_kv else None
    for s0, n, mask in _blocks(part, b * h * r, r, t, q.device):
        kb = read_block(k, s0, n, acc_dtype)
        vb = read_block(v, s0, n, acc_dtype)
        s, tanh = _scores(qf, kb, part, mask, h // hkv)
        p = torch.exp(s - lse_safe[..., None])
        ds = p * (torch.matmul(do, vb.transpose(-1, -2)) - delta[..., None])
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dq += torch.matmul(ds, kb) * part.scale
        if need_kv:
            dvv[:, :, s0 : s0 + n] = torch.matmul(p.transpose(-1, -2), do)
            dk[:, :, s0 : s0 + n] = torch.matmul(ds.transpose(-1, -2), qf) * part.scale
    dq = dq.reshape(q.shape).to(q.dtype)
    if need_kv:
        dk, dvv = dk.to(k.dtype), dvv.to(v.dtype)
    return dq, dk, dvv


# ----------------------------------------------------------------------------------------- kernel choice


def _flash_mode(q, k, v, part: Part) -> str | None:
    """'full' / 'causal' when the fused CPU kernel computes this part exactly, else None."""
    if _flash_cpu is None or q.device.type != "cpu" or part.softcap is not None or q.dtype == torch.float64:
        return None
    if part.chunk is not None or not isinstance(k, torch.Tensor):
        return None  # a compressed state (`longstraw.quant`) is read block by block by the blockwise kernel
    if q.dtype != k.dtype or v.shape[-1] != q.shape[-1]:
        return None
    r, t = q.shape[2], k.shape[2]
    if part.window is None and part.k_start + t - 1 <= part.q_start:
        return "full"  # every key precedes every query: no mask
    if part.window is None and r == t and part.q_start == part.k_start and part.q_period is None:
        return "causal"  # own part: square causal mask
    return None


def _compressed_flash(q, k, v, part: Part):
    """(out, lse) of a fully visible compressed prompt part on the fused CPU kernel, one dequantized tile of
    `part.block` keys at a time, merged by log-sum-exp (transient: one tile of K/V); None where the fused
    kernel does not apply."""
    if (_flash_cpu is None or q.device.type != "cpu" or part.softcap is not None or part.chunk is not None
            or part.window is not None or q.dtype == torch.float64 or v.shape[-1] != q.shape[-1]):
        return None
    t = k.shape[2]
    if part.k_start + t - 1 > part.q_start:
        return None
    out = lse = None
    for s0 in range(0, t, part.block):
        n = min(part.block, t - s0)
        o, l = _flash_cpu(q, read_block(k, s0, n, q.dtype), read_block(v, s0, n, q.dtype), 0.0, False,
                          scale=part.scale)
        if out is None:
            out, lse = o, l
        else:
            out, _ = merge_by_lse(o, l, out, lse)
            lse = torch.logaddexp(lse, l)
    return out, lse


def part_forward(q, k, v, part: Part):
    mode = _flash_mode(q, k, v, part)
    if mode is None:
        if not isinstance(k, torch.Tensor):
            fused = _compressed_flash(q, k, v, part)
            if fused is not None:
                return fused
        return blockwise_forward(q, k, v, part)
    out, lse = _flash_cpu(q, k, v, 0.0, mode == "causal", scale=part.scale)
    return out, lse


def part_backward(g_out, q, k, v, out, lse, part: Part, need_kv: bool, g_lse=None):
    mode = _flash_mode(q, k, v, part)
    if mode is None or not need_kv or g_lse is not None:
        # the fused kernel always materialises dk, dv of the part's full size (skip it when unused) and
        # takes no log-sum-exp gradient
        return blockwise_backward(g_out, q, k, v, out, lse, part, need_kv, g_lse)
    dq, dk, dv = _flash_cpu_backward(g_out.contiguous(), q, k, v, out, lse.contiguous(), 0.0, mode == "causal",
                                     scale=part.scale)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------- the Function


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Combine two attention parts over disjoint key sets into the attention over their union.

    out = (e^lse_a·out_a + e^lse_b·out_b) / (e^lse_a + e^lse_b); returns (out, w_a) with w_a the
    weight of part a `[B, H, R]`. `lse_b` must be finite (every query sees itself in the own part);
    `lse_a` may be −inf (no visible key), giving out_b.
    """
    w_a = torch.sigmoid(lse_a - lse_b)
    out = out_b + w_a[..., None].to(out_b.dtype) * (out_a - out_b)
    return out, w_a


def _fold(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, R, ...]` → `[1, H, B·R, ...]`: B sequences' queries as rows against one shared prompt."""
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _unfold(x: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse of `_fold` for a batch of `b`."""
    return x.reshape(x.shape[1], b, x.shape[2] // b, *x.shape[3:]).transpose(0, 1)


class SplitAttention(torch.autograd.Function):
    """Attention of q over [prompt part | own part] → (out `[B, H, R, Dv]`, lse `[B, H, R]` float32 of the
    merged scores); saves inputs by reference, the merged output and the two log-sum-exps: nothing of
    size R×T and no copy of the prompt K/V. Both outputs are differentiable (sinks read the lse).

    A prompt part of batch 1 serves queries of batch B (G sequences sampled from one prompt): their
    rows are folded into one batch row, so the prompt K/V is read once and never repeated."""

    @staticmethod
    def forward(ctx, q, own_k, own_v, prompt_k, prompt_v, own: Part, prompt: Part | None):
        ctx.set_materialize_grads(False)
        out_o, lse_o = part_forward(q, own_k, own_v, own)
        if prompt is None:
            out, lse_p, lse = out_o, None, lse_o
        else:
            b = q.shape[0]
            if b > 1 and prompt_k.shape[0] == 1:
                out_p, lse_p = part_forward(_fold(q), prompt_k, prompt_v, prompt)
                out_p, lse_p = _unfold(out_p, b), _unfold(lse_p, b)
            else:
                out_p, lse_p = part_forward(q, prompt_k, prompt_v, prompt)
            out, _ = merge_by_lse(out_p, lse_p, out_o, lse_o)
            lse = torch.logaddexp(lse_p, lse_o)
        stored = isinstance(prompt_k, torch.Tensor)  # else a compressed state: a constant, kept by reference
        ctx.save_for_backward(q, own_k, own_v, prompt_k if stored else None, prompt_v if stored else None, out, lse_o,
                              lse_p)
        ctx.compressed = None if stored else (prompt_k, prompt_v)
        ctx.parts = (own, prompt)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, own_k, own_v, prompt_k, prompt_v, out, lse_o, lse_p = ctx.saved_tensors
        if ctx.compressed is not None:
            prompt_k, prompt_v = ctx.compressed
        own, prompt = ctx.parts
        need = ctx.needs_input_grad
        if dout is None:
            dout = torch.zeros_like(out)
        if prompt is None:
            dq, dk, dv = part_backward(dout, q, own_k, own_v, out, lse_o, own, need_kv=True, g_lse=dlse)
            return dq, dk, dv, None, None, None, None
        w_p = torch.sigmoid(lse_p - lse_o)[..., None]
        g_p = (dout.to(w_p.dtype) * w_p).to(dout.dtype)
        g_o = (dout.to(w_p.dtype) * (1 - w_p)).to(dout.dtype)
        # the merged lse's gradient reaches part a with weight w_a, and w_a · (Δ − g_lse) is what the
        # part's correction term needs: pass g_lse itself (each part's dO is already weighted by w_a,
        # so its Δ is too; the lse shift is weighted by w_a here)
        gl_p = None if dlse is None else dlse * w_p[..., 0]
        gl_o = None if dlse is None else dlse * (1 - w_p[..., 0])
        dq_o, dk, dv = part_backward(g_o, q, own_k, own_v, out, lse_o, own, need_kv=True, g_lse=gl_o)
        need_prompt = need[3] or need[4]
        b = q.shape[0]
        if b > 1 and prompt_k.shape[0] == 1:
            dq_p, dkp, dvp = part_backward(_fold(g_p), _fold(q), prompt_k, prompt_v, _fold(out), _fold(lse_p), prompt,
                                           need_kv=need_prompt, g_lse=None if gl_p is None else _fold(gl_p))
            dq_p = _unfold(dq_p, b)
        else:
            dq_p, dkp, dvp = part_backward(g_p, q, prompt_k, prompt_v, out, lse_p, prompt, need_kv=need_prompt,
                                           g_lse=gl_p)
        return dq_o + dq_p, dk, dv, dkp, dvp, None, None


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
):
    """Attention of q `[B, H, R, D]` over [prompt | own] keys: out `[B, H, R, Dv]`.

    own K/V have batch B; the prompt K/V batch B or 1 (shared by all B sequences).
    Gradients reach `prompt_k` / `prompt_v` only if they require grad (exact mode).
    `chunk`: chunked local attention (`Part.chunk`). `sinks` `[H]`: a learned logit per head in the
    softmax denominator with no value (gpt-oss): a third part with lse = sink and output 0, merged by
    log-sum-exp, out · sigmoid(lse − sink); the sinks get their gradient from autograd.
    `with_lse`: return (out, lse `[B, H, R]` float) without sinks, for a caller that merges more parts
    (DeepSeek-V4's compressed entries, `longstraw.compressed_attention`); both are differentiable.
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
    out, lse = SplitAttention.apply(q, own_k, own_v, prompt_k, prompt_v, own, prompt)
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
    dtype = _acc_dtype(q)
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
