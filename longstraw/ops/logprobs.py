"""Token log-probs (and entropies) through the LM head in chunks: never a `[T, vocab]` tensor for all T.

`chunked_logprobs(hidden, lm_head, targets)` returns log p(target_t) `[T]` of the distribution
softmax(z_t), z_t = softcap(scale · lm_head(h_t)) / temperature (temperature as in TRL: the logits
are divided by it; `scale` is what the causal-LM class multiplies the logits by, e.g. Cohere's
`logit_scale`; the optional tanh softcap is the model's `final_logit_softcapping`).

For an `nn.Linear` head `ChunkedLogprobs` walks token chunks and, within each, vocabulary chunks
with an online log-sum-exp; it saves only its inputs (references), the log-sum-exp and the entropy,
and recomputes the logits chunk by chunk in backward. A frozen head (LoRA: no gradient to the head)
goes through `LogprobsGradInForward`: the log-probs' gradient w.r.t. the hidden states accumulated in
the same walk, so that backward does no product (two per tile in all, not three: a third of a Gemma 3
replay's LM head), and the entropies' gradient, when a loss reads them, through `EntropyGrad`.
Memory: O(token_chunk · vocab_chunk) floats transient, O(T) saved (O(T · H) for a frozen head), instead
of O(T · V) saved by `log_softmax(logits)`. Any other head module
(e.g. a PEFT-wrapped one) goes through activation checkpointing per token chunk: O(token_chunk · V)
transient.

Precision: logits of a half-precision model come from the head's matrix product in that dtype (as the
model computes them), then everything — log-sum-exp, log-probs, entropies, gradients' accumulation — is
float32; float32 / float64 models compute in their own dtype throughout. Nothing in the walk reads a
device value on the host (no synchronisation per chunk).

Gradients: with z the logits of one token, ∂logp_y/∂z_k = 1[k=y] − p_k and
∂H/∂z_k = −p_k (log p_k + H), where H = −Σ p log p is the token entropy.

`reference_logprobs` is the plain version the tests hold this equal to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_TOKEN_CHUNK = 1024
DEFAULT_VOCAB_CHUNK = 32768


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs (gradient checks), float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _mm_dtype(h: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """dtype of the head's matrix products: the model's when hidden and head are both half precision (as the
    model itself computes its logits: tensor-core speed, no float32 copy of a weight tile), else float32 / 64."""
    half = (torch.bfloat16, torch.float16)
    return h.dtype if h.dtype in half and w.dtype == h.dtype else _acc(h)


def _logits(h, w, b, temperature, softcap, scale=None):
    """Logits of one tile in the accumulation dtype, and tanh of the softcap (for backward) or None."""
    acc, mm = _acc(h), _mm_dtype(h, w)
    u = F.linear(h.to(mm), w.to(mm), None if b is None else b.to(mm)).to(acc)
    if scale is not None:
        u = u * scale
    t = None
    if softcap is not None:
        t = torch.tanh(u / softcap)
        u = t * softcap
    return (u if temperature == 1.0 else u / temperature), t  # x / 1 is x: no pass over the tile for it


def _walk(hidden, weight, bias, targets, temperature, softcap, token_chunk, vocab_chunk, scale, grad=False):
    """The forward walk over token chunks and vocabulary tiles with an online log-sum-exp: (logp, lse, entropy `[T]`,
    extra). With `grad`, extra = (Σ_k p_k (1 − t_k²) W_k `[T, H]`, tanh at the target `[T]` or None) accumulated in
    the same walk (`LogprobsGradInForward`); else None."""
    t_total, v_total = hidden.shape[0], weight.shape[0]
    f = dict(device=hidden.device, dtype=_acc(hidden))
    logp, lse, ent = torch.empty(t_total, **f), torch.empty(t_total, **f), torch.empty(t_total, **f)
    pw = torch.empty(hidden.shape, **f) if grad else None  # Σ_k p_k (1 − t_k²) W_k
    ty = torch.empty(t_total, **f) if grad and softcap is not None else None  # tanh at the target
    for t0 in range(0, t_total, token_chunk):
        h = hidden[t0 : t0 + token_chunk]
        y = targets[t0 : t0 + token_chunk]
        n = h.shape[0]
        m = torch.full((n,), float("-inf"), **f)
        l, zy = torch.zeros(n, **f), torch.zeros(n, **f)
        s = torch.zeros(n, **f)  # Σ e^{z−m} z, for the entropy
        acc = torch.zeros(n, hidden.shape[1], **f) if pw is not None else None
        for v0 in range(0, v_total, vocab_chunk):
            w = weight[v0 : v0 + vocab_chunk]
            z, tanh = _logits(h, w, None if bias is None else bias[v0 : v0 + vocab_chunk], temperature, softcap, scale)
            m_new = torch.maximum(m, z.amax(-1))
            alpha = torch.exp(m - m_new)
            inside = (y >= v0) & (y < v0 + z.shape[1])
            idx = (y - v0).clamp(0, z.shape[1] - 1)
            zy = torch.where(inside, z.gather(1, idx[:, None]).squeeze(1), zy)
            e = torch.sub(z, m_new[:, None]).exp_()
            l = l * alpha + e.sum(-1)
            if acc is not None:
                ew = e if tanh is None else e * (1 - tanh * tanh)
                mm = _mm_dtype(h, w)
                acc.mul_(alpha[:, None]).add_((ew.to(mm) @ w.to(mm)).to(acc.dtype))
            s = s * alpha + e.mul_(z).sum(-1)  # e · z in e's place: e is not read again
            m = m_new
        lse_c = m + torch.log(l)
        lse[t0 : t0 + n] = lse_c
        logp[t0 : t0 + n] = zy - lse_c
        ent[t0 : t0 + n] = lse_c - s / l
        if pw is not None and acc is not None:
            pw[t0 : t0 + n] = acc / l[:, None]
        if ty is not None:
            ty[t0 : t0 + n] = zy * temperature / softcap
    return logp, lse, ent, ((pw, ty) if grad else None)


class ChunkedLogprobs(torch.autograd.Function):
    """(logp `[T]`, entropy `[T]`) for an `nn.Linear` head (weight `[V, H]`, bias `[V]`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, token_chunk, vocab_chunk, scale=None):
        logp, lse, ent, _ = _walk(hidden, weight, bias, targets, temperature, softcap, token_chunk, vocab_chunk, scale)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.args = (temperature, softcap, token_chunk, vocab_chunk, scale)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        dh, dw, db = _tiles_backward(
            hidden, weight, bias, targets, lse, ent, g_logp, g_ent, ctx.args, ctx.needs_input_grad[:3]
        )
        return dh, dw, db, None, None, None, None, None, None


class LogprobsGradInForward(torch.autograd.Function):
    """(logp, lse, entropy `[T]`) for a frozen `nn.Linear` head (no gradient to its weight or bias) whose hidden states
    need one: ∂logp_t/∂h_t is computed in the forward walk, so backward is elementwise.

    With u = scale · (W h + b), z = softcap · tanh(u / softcap) / temperature (each part optional),
    ∂logp_y/∂h = (scale / temperature) · ((1 − t_y²) W_y − Σ_k p_k (1 − t_k²) W_k), t = tanh(u / softcap). The sum
    is accumulated tile by tile beside the online log-sum-exp (Σ e^{z_k − m} (1 − t_k²) W_k, rescaled as m grows,
    divided by Σ e^{z − m} at the end): one more product per tile in forward, none in backward, where
    `ChunkedLogprobs` recomputes each tile's logits and multiplies back (two). Saves `[T, H]` floats. The entropy's
    gradient is `EntropyGrad`'s, paid only when the loss reads the entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, token_chunk, vocab_chunk, scale=None):
        logp, lse, ent, (pw, ty) = _walk(
            hidden, weight, bias, targets, temperature, softcap, token_chunk, vocab_chunk, scale, grad=True
        )
        ctx.save_for_backward(weight, targets, pw, ty)
        ctx.factor = (1.0 if scale is None else scale) / temperature
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(lse, ent)
        ctx.set_materialize_grads(False)
        return logp, lse, ent

    @staticmethod
    def backward(ctx, g_logp, g_lse, g_ent):
        if g_logp is None:
            return (None,) * 9
        weight, targets, pw, ty = ctx.saved_tensors
        wy = weight[targets].to(pw.dtype)
        if ty is not None:
            wy = wy * (1 - ty * ty)[:, None]
        dh = (wy - pw).mul_((g_logp.to(pw.dtype) * ctx.factor)[:, None])
        return dh.to(ctx.hidden_dtype), None, None, None, None, None, None, None, None


class EntropyGrad(torch.autograd.Function):
    """The entropies of `LogprobsGradInForward` (`ent`, computed there) with their gradient w.r.t. the hidden states:
    the logits recomputed tile by tile in backward (`_tiles_backward`), only when the loss reads the entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, lse, ent, args):
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.args = args
        return ent.clone()

    @staticmethod
    def backward(ctx, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        dh, dw, db = _tiles_backward(
            hidden, weight, bias, targets, lse, ent, None, g_ent, ctx.args, ctx.needs_input_grad[:3]
        )
        return dh, dw, db, None, None, None, None


def _tiles_backward(hidden, weight, bias, targets, lse, ent, g_logp, g_ent, args, needs):
    """(dh, dw, db) of `ChunkedLogprobs`: the logits recomputed tile by tile, ∂/∂z of the log-probs and entropies."""
    temperature, softcap, token_chunk, vocab_chunk, scale = args
    need_h, need_w, need_b = needs
    t_total, v_total = hidden.shape[0], weight.shape[0]
    f = dict(device=hidden.device, dtype=_acc(hidden))
    dh = torch.zeros(hidden.shape, **f) if need_h else None
    dw = torch.zeros(weight.shape, **f) if need_w else None
    db = torch.zeros(v_total, **f) if need_b else None
    for t0 in range(0, t_total, token_chunk):
        sl = slice(t0, t0 + token_chunk)
        h, y = hidden[sl], targets[sl]
        glp = g_logp[sl].to(f["dtype"]) if g_logp is not None else None
        gen = g_ent[sl].to(f["dtype"]) if g_ent is not None else None
        for v0 in range(0, v_total, vocab_chunk):
            w = weight[v0 : v0 + vocab_chunk]
            b = None if bias is None else bias[v0 : v0 + vocab_chunk]
            z, tanh = _logits(h, w, b, temperature, softcap, scale)
            logp_tile = z.sub_(lse[sl, None])  # z is not read again
            p = torch.exp(logp_tile)
            # dz = −p · (g_logp + g_ent · (log p + H)) + g_logp at the target, written into p's and log p's place
            if gen is not None:
                coef = logp_tile.add_(ent[sl, None]).mul_(gen[:, None])
                if glp is not None:
                    coef.add_(glp[:, None])
                dz = p.mul_(coef).neg_()
            elif glp is not None:
                dz = p.mul_(glp[:, None]).neg_()
            else:
                dz = p.zero_()
            if glp is not None:  # (no data-dependent indexing: nothing waits on the device)
                inside = (y >= v0) & (y < v0 + z.shape[1])
                idx = (y - v0).clamp(0, z.shape[1] - 1)
                dz.scatter_add_(1, idx[:, None], torch.where(inside, glp, torch.zeros_like(glp))[:, None])
            du = dz if temperature == 1.0 else dz / temperature
            if tanh is not None:
                du = du * (1 - tanh * tanh)
            if scale is not None:
                du = du * scale
            mm = _mm_dtype(h, w)
            if need_h:
                dh[sl] += (du.to(mm) @ w.to(mm)).to(dh.dtype)
            if need_w:
                dw[v0 : v0 + vocab_chunk] += (du.t().to(mm) @ h.to(mm)).to(dw.dtype)
            if need_b:
                db[v0 : v0 + vocab_chunk] += du.sum(0)
    return (
        None if dh is None else dh.to(hidden.dtype),
        None if dw is None else dw.to(weight.dtype),
        None if db is None else db.to(bias.dtype),
    )


def _module_chunk(lm_head, h, y, temperature, softcap, scale=None):
    u = lm_head(h)
    u = u.to(_acc(u))
    if scale is not None:
        u = u * scale
    if softcap is not None:
        u = torch.tanh(u / softcap) * softcap
    logp_all = torch.log_softmax(u / temperature, dim=-1)
    logp = logp_all.gather(-1, y[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def chunked_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    scale: float | None = None,
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) `[T]`, token entropy `[T]`), differentiable w.r.t. hidden and the head.

    float32 (float64 for float64 inputs) whatever the input dtype.

    hidden `[T, H]`, targets `[T]` (int64). Memory O(token_chunk · vocab_chunk) transient for an
    `nn.Linear` head, O(token_chunk · V) for any other module (checkpointed per token chunk).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs; got {temperature}")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError("token_chunk and vocab_chunk must be >= 1")
    if type(lm_head) is torch.nn.Linear:
        weight, bias = lm_head.weight, lm_head.bias
        args = (float(temperature), softcap, int(token_chunk), int(vocab_chunk), scale)
        frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
        if frozen and hidden.requires_grad and torch.is_grad_enabled():
            logp, lse, ent = LogprobsGradInForward.apply(hidden, weight, bias, targets, *args)
            return logp, EntropyGrad.apply(hidden, weight, bias, targets, lse, ent, args)
        return ChunkedLogprobs.apply(hidden, weight, bias, targets, *args)
    parts = [
        checkpoint(
            _module_chunk,
            lm_head,
            hidden[t0 : t0 + token_chunk],
            targets[t0 : t0 + token_chunk],
            temperature,
            softcap,
            scale,
            use_reentrant=False,
        )
        for t0 in range(0, hidden.shape[0], token_chunk)
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def reference_logprobs(
    hidden, lm_head, targets, *, temperature: float = 1.0, softcap: float | None = None, scale: float | None = None
):
    """Plain version: the whole `[T, V]` log-softmax at once. Returns (logp, entropy)."""
    return _module_chunk(lm_head, hidden, targets, temperature, softcap, scale)
