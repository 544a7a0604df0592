"""Context-parallel capture and branch replay over a process group (the design is in `longstraw.distributed`).

`capture(model, prompt_ids, ..., group=pg)` is `longstraw.capture` with a group: every rank of the group calls it
with the same arguments and gets a `ContextParallelState` holding the durable state of its own slice of the prompt.
`state.replay(response_ids)` is then a collective in which every rank brings its own branch.
"""

from __future__ import annotations

import torch

from ..attention import DEFAULT_BLOCK, Part, part_backward, part_forward
from ..hf_attention import BranchCache
from ..layers import base
from ..layers.base import LayerState
from ..layers.full_attention import AttentionBranchLayer, KVState
from ..logprobs import chunked_logprobs
from ..models import ModelParts, base_model
from ..state import PROMPT_GRAD_MODES, PromptState, Replay, _as_ids, _check_length, run_decoder
from .collectives import Group, digest

__all__ = ["ContextParallelState", "SliceKVState", "capture", "slice_bounds"]


def slice_bounds(total: int, size: int) -> list[tuple[int, int]]:
    """Contiguous slices `[(start, end)]` of `total` positions over `size` ranks: the first `total % size` ranks hold
    one position more than the others."""
    base_len, extra = divmod(total, size)
    bounds, s = [], 0
    for r in range(size):
        e = s + base_len + (1 if r < extra else 0)
        bounds.append((s, e))
        s = e
    return bounds


# ----------------------------------------------------------------------------------------- log-sum-exp folding


def _fold(acc, part):
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
    out = (w_a[..., None] * o_a + w_b[..., None] * o_b) / torch.where(empty, torch.ones_like(s), s)[..., None]
    lse = torch.where(empty, torch.full_like(s, float("-inf")), m_safe + torch.log(torch.where(empty, torch.ones_like(s), s)))
    return out, lse


def _pad_rows(x: torch.Tensor, rows: int, dim: int = 2) -> torch.Tensor:
    """`x` zero-padded along `dim` to `rows`."""
    n = x.shape[dim]
    if n == rows:
        return x
    shape = list(x.shape)
    shape[dim] = rows - n
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _prompt_part(part: Part, k_start: int) -> Part:
    return Part(part.q_start, k_start, part.window, part.softcap, part.scale, part.block)


# ----------------------------------------------------------------------------------------- durable state


class SliceKVState(LayerState):
    """Post-RoPE K/V of one full-attention layer for this rank's slice `[start, end)` of the captured positions:
    keys `[1, Hkv, end − start, D]`, values `[1, Hkv, end − start, Dv]` (not registered as a layer kind: built by
    the context-parallel capture in place of `KVState`)."""

    window: int | None = None

    def __init__(self, config, layer_idx: int, start: int, end: int):
        super().__init__(config, layer_idx, end - start)
        self.start, self.end = start, end
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def branch(self, batch: int = 1):
        raise RuntimeError("a context-parallel state is read through ContextParallelState.replay (a collective)")

    def commit(self, branch_layer, n: int) -> None:
        k, v = branch_layer.keys, branch_layer.values
        if n != self.end - self.start or k.shape[-2] != n:
            raise RuntimeError(f"layer {self.layer_idx}: slice of {self.end - self.start} tokens, chunk of {n} produced "
                               f"{k.shape[-2]} keys")
        self.keys = base.empty_state(k, tuple(k.shape))
        self.values = base.empty_state(v, tuple(v.shape))
        self.keys.copy_(k)
        self.values.copy_(v)
        self.length = self.end

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def release(self) -> None:
        self.keys = self.values = None


# ----------------------------------------------------------------------------------------- capture


class _CaptureBranchLayer(AttentionBranchLayer):
    """Branch layer of this rank's slice during capture: the slice's own K/V (causal) plus the K/V of the earlier
    ranks' slices at the same layer, all-gathered `chunk` tokens per step while every rank is at this layer."""

    def __init__(self, group: Group, bounds, layer_idx: int, chunk: int):
        start = bounds[group.rank][0]
        super().__init__(None, None, prompt_length=start)
        self.group, self.bounds, self.layer_idx, self.chunk = group, bounds, layer_idx, chunk

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        if sinks is not None:
            raise NotImplementedError("context-parallel capture does not support attention sinks yet")
        g, me = self.group, self.group.rank
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = Part(int(q_start), int(own_start), window, softcap, scale, int(block))
        acc = None
        # the last rank's slice is read by no one: steps cover the longest of the other slices
        longest = max(e - s for s, e in self.bounds[:-1])
        c = self.chunk
        n_me = k.shape[-2]
        for step, lo in enumerate(range(0, longest, c)):
            hi = min(lo + c, n_me)
            kc = _pad_rows(k[:, :, lo:max(hi, lo)], c)
            vc = _pad_rows(v[:, :, lo:max(hi, lo)], c)
            got = g.all_gather(f"capture layer {self.layer_idx}: keys and values, step {step}", [kc, vc])
            for j in range(me):
                sj, ej = self.bounds[j]
                n = min(c, ej - sj - lo)
                if n > 0:
                    kj, vj = got[j]
                    acc = _fold(acc, part_forward(q, kj[:, :, :n], vj[:, :, :n], _prompt_part(own, sj + lo)))
        out, _ = _fold(acc, part_forward(q, k, v, own))
        return out.to(q.dtype)


def capture(model, prompt_ids, chunk_size: int = 4096, prompt_grad: str = "detached", block_size: int = DEFAULT_BLOCK,
            verify: bool | None = None, state_dtype=None, *, group) -> "ContextParallelState":
    """`longstraw.capture(..., group=group)`: a collective of every rank of `group` (a `torch.distributed` process
    group; the default group for `group=torch.distributed.group.WORLD`).

    The arguments are compared across ranks first (one small all-gather of hashes) and a mismatch is refused on every
    rank with the same `MismatchError`. `chunk_size`: keys exchanged per all-gather step (each rank runs its whole
    slice through the decoder in one forward; see `longstraw.distributed`)."""
    g = Group(group)
    try:
        raw = torch.as_tensor(prompt_ids).detach()
        length = raw.numel()
    except Exception:  # noqa: BLE001 - invalid input is refused below, on every rank alike
        raw, length = repr(prompt_ids), -1
    bm = base_model(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    g.agree("longstraw.capture", {
        "prompt length": length, "prompt_ids": raw, "chunk_size": chunk_size if isinstance(chunk_size, int) else repr(chunk_size),
        "prompt_grad": prompt_grad, "block_size": block_size if isinstance(block_size, int) else repr(block_size),
        "verify": verify, "state_dtype": str(state_dtype), "model config": bm.config.to_json_string(use_diff=False),
        "trainable parameters": trainable,
    })
    if prompt_grad not in PROMPT_GRAD_MODES:
        raise ValueError(f"prompt_grad must be one of {PROMPT_GRAD_MODES}; got {prompt_grad!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    if prompt_grad == "exact":
        raise NotImplementedError("context-parallel capture (group=...) supports prompt_grad='detached' only so far")
    if state_dtype is not None:
        raise NotImplementedError("context-parallel capture (group=...) keeps the state in the model's dtype so far; "
                                  "state_dtype is not supported with group=")
    from ..prepare import prepare
    from ..support import layer_plan, model_parts
    from ..archs import family
    from ..layers import layer_kind

    parts: ModelParts = model_parts(model)
    kinds = {layer_kind(kind) for kind in layer_plan(parts.config)}
    if kinds != {KVState}:
        other = sorted(k.__name__ for k in kinds - {KVState})
        raise NotImplementedError(f"context-parallel capture (group=...) supports full-attention layers only so far; "
                                  f"{parts.config.model_type!r} has layer kinds {other}")
    device = next(parts.model.parameters()).device
    prompt = _as_ids(prompt_ids, "prompt_ids", parts.config.vocab_size, device)
    _check_length(parts.config, prompt.numel())
    captured = prompt.numel() - 1
    if captured < g.size:
        raise ValueError(f"a prompt of {prompt.numel()} tokens ({captured} captured) cannot give each of the {g.size} "
                         "ranks a slice; use fewer ranks or capture without group=")
    prepare(model)
    if verify or (verify is None and family(parts.config.model_type) is None):
        from ..self_check import ensure_verified

        ensure_verified(model)
    bounds = slice_bounds(captured, g.size)
    s, e = bounds[g.rank]
    layers = [SliceKVState(parts.config, i, s, e) for i in range(len(parts.decoder.layers))]
    with torch.no_grad():
        cache = BranchCache([_CaptureBranchLayer(g, bounds, i, chunk_size) for i in range(len(layers))],
                            block=block_size)
        run_decoder(parts, prompt[None, s:e], torch.arange(s, e, device=device), cache)
        for layer, branch in zip(layers, cache.layers):
            layer.commit(branch, e - s)
        del cache
    key = digest(prompt, chunk_size, block_size, prompt_grad, g.size)
    return ContextParallelState(parts, layers, prompt[-1:], prompt.numel(), chunk_size, prompt_grad, block_size,
                                group=g, bounds=bounds, key=key)


# ----------------------------------------------------------------------------------------- replay


class _ReplayInfo:
    """What one layer's replay attention needs besides its tensors: the group, every rank's query count, this rank's
    slice K/V and start, the layer (for collective names)."""

    def __init__(self, group: Group, lengths: list[int], layer: SliceKVState):
        self.group, self.lengths, self.layer = group, lengths, layer


class ReplayAttention(torch.autograd.Function):
    """Attention of this rank's branch queries over [every rank's prompt slice | its own K/V], a collective.

    Forward: queries all-gathered (padded to the longest branch); each rank computes (out, lse) of every rank's
    queries against its own slice; an all-to-all returns them to their owners, which fold them in slice order
    0..N−1 (float32) and merge the result with the branch's own causal part. Saves q, own K/V, the merged output
    and the two log-sum-exps, as `longstraw.attention.SplitAttention` does.

    Backward: the prompt part's incoming gradient w_p·dO, the merged output and the prompt part's lse go to every rank
    with the queries (one all-gather); each rank computes dq of every rank's queries against its slice (the prompt
    K/V never move; detached: no dK/dV), an all-to-all returns them, and the owner sums them in slice order."""

    @staticmethod
    def forward(ctx, q, own_k, own_v, own: Part, info: _ReplayInfo):
        g, lengths, layer = info.group, info.lengths, info.layer
        rmax = max(lengths)
        name = f"replay forward layer {layer.layer_idx}"
        qs = g.all_gather(f"{name}: queries", [_pad_rows(q, rmax)])
        prompt = _prompt_part(own, layer.start)
        send = []
        for j, (qj,) in enumerate(qs):
            o, l = part_forward(qj[:, :, :lengths[j]], layer.keys, layer.values, prompt)
            send.append([_pad_rows(o.float(), rmax), _pad_rows(l.float(), rmax)])
        got = g.all_to_all(f"{name}: partial outputs", send)
        r = q.shape[2]
        acc = None
        for o, l in got:  # slice order: the same fold whatever rank computed it
            acc = _fold(acc, (o[:, :, :r], l[:, :, :r]))
        out_p, lse_p = acc
        out_o, lse_o = part_forward(q, own_k, own_v, own)
        out, _ = _fold((out_p, lse_p), (out_o, lse_o))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, own_k, own_v, out, lse_o.float(), lse_p)
        ctx.own, ctx.info = own, info
        return out

    @staticmethod
    def backward(ctx, dout):
        q, own_k, own_v, out, lse_o, lse_p = ctx.saved_tensors
        own, info = ctx.own, ctx.info
        g, lengths, layer = info.group, info.lengths, info.layer
        rmax, r = max(lengths), q.shape[2]
        w_p = torch.sigmoid(lse_p - lse_o)[..., None]
        g_p = (dout.float() * w_p).to(dout.dtype)
        g_o = (dout.float() * (1 - w_p)).to(dout.dtype)
        dq_o, dk, dv = part_backward(g_o, q, own_k, own_v, out, lse_o, own, need_kv=True)
        name = f"replay backward layer {layer.layer_idx}"
        got = g.all_gather(f"{name}: queries and gradients",
                           [_pad_rows(t, rmax) for t in (q, g_p, out)] + [_pad_rows(lse_p, rmax)])
        prompt = _prompt_part(own, layer.start)
        send = []
        for j, (qj, gj, oj, lj) in enumerate(got):
            n = lengths[j]
            dqj, _, _ = part_backward(gj[:, :, :n], qj[:, :, :n], layer.keys, layer.values, oj[:, :, :n], lj[:, :, :n],
                                      prompt, need_kv=False)
            send.append([_pad_rows(dqj.float(), rmax)])
        back = g.all_to_all(f"{name}: query gradients", send)
        dq_p = back[0][0][:, :, :r]
        for (dqi,) in back[1:]:  # slice order
            dq_p = dq_p + dqi[:, :, :r]
        return (dq_o.float() + dq_p).to(q.dtype), dk, dv, None, None


class _ReplayBranchLayer(AttentionBranchLayer):
    """Branch layer of a context-parallel replay: own K/V kept here, the prompt part read collectively."""

    def __init__(self, info: _ReplayInfo, prompt_length: int):
        super().__init__(None, None, prompt_length=prompt_length)
        self.info = info

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        if sinks is not None:
            raise NotImplementedError("context-parallel replay does not support attention sinks yet")
        if q.shape[0] != 1:
            raise NotImplementedError("context-parallel replay runs one branch per rank (query batch 1)")
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = Part(int(q_start), int(own_start), window, softcap, scale, int(block))
        return ReplayAttention.apply(q, k, v, own, self.info)


class ContextParallelState(PromptState):
    """The durable state of this rank's slice of a prompt captured over a process group (`capture(..., group=)`).

    `replay(response_ids)` is a collective: every rank of the group calls it, each with its own response (lengths
    may differ), and gets its own branch's log-probs with grad; so is the backward of what it returns (every rank
    must run it). `nbytes` is this rank's share; `slice` its captured positions `(start, end)`."""

    def __init__(self, parts, layers, last_token, prompt_length, chunk_size, prompt_grad, block, *, group: Group,
                 bounds, key: int):
        super().__init__(parts, layers, last_token, prompt_length, chunk_size, prompt_grad, block)
        self.group = group
        self.bounds = bounds
        self._key = key
        self._replays = 0

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.size

    @property
    def slice(self) -> tuple[int, int]:
        return self.bounds[self.group.rank]

    def __repr__(self) -> str:
        status = "released" if self.layers is None else f"{self.nbytes / 2**20:.2f} MiB here"
        s, e = self.slice
        return (f"ContextParallelState(prompt_length={self.prompt_length}, rank {self.rank} of {self.world_size}, "
                f"positions [{s}, {e}), {status})")

    def replay(self, response_ids, temperature: float = 1.0, checkpoint_layers: bool = False) -> Replay:
        """`PromptState.replay` as a collective (see the class). Every rank must call it the same number of times, with
        the same `checkpoint_layers` and grad mode, and must run the backward of what it returns when the others do."""
        parts = self._parts
        layers = self._live()
        try:
            response = _as_ids(response_ids, "response_ids", parts.config.vocab_size, self.last_token.device)
            _check_length(parts.config, self.prompt_length + response.numel())
            mine, error = response.numel(), None
        except (ValueError, TypeError) as err:
            mine, error = -1, err
        self._replays += 1
        lengths = [row[0] for row in self.group.agree("ContextParallelState.replay", {
            "captured state": self._key, "replay number": self._replays, "checkpoint_layers": bool(checkpoint_layers),
            "grad enabled": torch.is_grad_enabled()}, free=(mine,))]
        bad = [r for r, n in enumerate(lengths) if n < 0]
        if bad:
            raise ValueError(f"ContextParallelState.replay: invalid response_ids on rank(s) {bad}; no rank replays") from error
        inputs = torch.cat([self.last_token, response[:-1]])
        start = self.prompt_length - 1
        positions = torch.arange(start, start + inputs.numel(), device=inputs.device)
        cache = BranchCache([_ReplayBranchLayer(_ReplayInfo(self.group, lengths, layer), start) for layer in layers],
                            block=self.block)
        hidden = run_decoder(parts, inputs[None], positions, cache, checkpoint_layers=checkpoint_layers)
        logprobs, entropy = chunked_logprobs(hidden[0], parts.lm_head, response, temperature=temperature,
                                             softcap=parts.final_logit_softcapping, scale=parts.logit_scale)
        return Replay(logprobs=logprobs, entropy=entropy)

    def sample(self, *args, **kwargs):
        raise NotImplementedError("ContextParallelState.sample (a collective) is not implemented yet")

    def _cache(self, batch: int = 1):
        raise RuntimeError("a context-parallel state is read through ContextParallelState.replay (a collective)")
