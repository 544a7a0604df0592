"""Full attention over a process group: each rank keeps the K/V of its slice of the prompt (`SliceKVState`); capture,
replay and sampling attend across the slices collectively (`CaptureBranchLayer`, `ReplayBranchLayer`,
`SampleBranchLayer`), each rank's partial outputs folded in slice order."""

from __future__ import annotations

import torch

from ...kinds import base
from ...kinds.base import LayerState
from ...kinds.full_attention import AttentionBranchLayer
from ...ops.attention import Part, part_backward, part_forward, prompt_backward, prompt_forward
from ...ops.quant import QuantizedTokens
from ..collectives import Group
from ..merge import fold as _fold
from ..merge import fold_sinks
from ..merge import pad_rows as _pad_rows
from .slices import make_part, prompt_part


class SliceKVState(LayerState):
    """Post-RoPE K/V of one full-attention layer for this rank's slice `[start, end)` of the captured positions:
    keys `[1, Hkv, end − start, D]`, values `[1, Hkv, end − start, Dv]` (not registered as a layer kind: built by
    the context-parallel capture in place of `KVState`)."""

    window: int | None = None

    def __init__(self, config, layer_idx: int, start: int, end: int):
        super().__init__(config, layer_idx, end - start)
        self.start, self.end = start, end
        #: plain tensors, or 8-bit `QuantizedTokens` with `capture(state_dtype=...)`
        self.keys: torch.Tensor | QuantizedTokens | None = None
        self.values: torch.Tensor | QuantizedTokens | None = None

    def branch(self, batch: int = 1):
        raise RuntimeError("a context-parallel state is read through ContextParallelState.replay (a collective)")

    def commit(self, branch_layer, n: int) -> None:
        k, v = branch_layer.keys, branch_layer.values
        if n != self.end - self.start or k.shape[-2] != n:
            raise RuntimeError(
                f"layer {self.layer_idx}: slice of {self.end - self.start} tokens, chunk of {n} "
                f"produced {k.shape[-2]} keys"
            )
        self.keys, self.values = self._store(k), self._store(v)
        self.length = self.end

    def _store(self, x: torch.Tensor) -> torch.Tensor | QuantizedTokens:
        """The slice's copy of `x`: in the model's dtype, or in 8 bits with `capture(state_dtype=...)` (blocks of
        `QUANT_BLOCK` positions counted from position 0: the slices start on block boundaries, so the blocks and
        their scales are those of one process)."""
        if self.state_dtype is not None:
            quantized = QuantizedTokens(x, x.shape[-2], self.state_dtype)
            quantized.append(x)
            return quantized
        stored = base.empty_state(x, tuple(x.shape))
        stored.copy_(x)
        return stored

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for x in (self.keys, self.values)
            if x is not None
            for t in (x.tensors() if isinstance(x, QuantizedTokens) else [x])
        ]

    def release(self) -> None:
        self.keys = self.values = None

    supports_exact = True

    def require_grad(self) -> None:
        """Exact mode: the slice's K/V become leaves; every rank's replays accumulate their gradient here."""
        # committed at capture; exact mode refuses a quantized state
        assert isinstance(self.keys, torch.Tensor) and isinstance(self.values, torch.Tensor)
        self.keys.requires_grad_(True)
        self.values.requires_grad_(True)


class CaptureAttention(torch.autograd.Function):
    """A full-attention layer of the context-parallel capture (`CaptureBranchLayer`): forward under `no_grad` at
    capture; with autograd in exact mode's reverse pass, whose backward is collective too (`backward_parts`).
    Saves q, k, v (the slice's own), the merged output and the log-sum-exp: O(n) per layer."""

    @staticmethod
    def forward(ctx, q, k, v, own: Part, layer: CaptureBranchLayer):
        out, lse = layer.forward_parts(q, k, v, own)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.own, ctx.layer = own, layer
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.layer.backward_parts(dout, q, k, v, out, lse, ctx.own)
        return dq, dk, dv, None, None


class CaptureBranchLayer(AttentionBranchLayer):
    """Branch layer of this rank's slice in a full-attention layer during capture (a collective; every rank is at this
    layer at the same time). Rank r's queries attend to its own slice (causal, local) and to the slices of ranks
    j < r, a block of work shared between the two ranks so that every rank does the same amount:
    - the first half of rank r's query rows get the keys: the ranks all-gather their K/V `chunk` positions per step,
      and rank r folds its first-half rows against the earlier slices' chunks;
    - the second half of its query rows go to the keys: the ranks all-gather `chunk` of their second-half query rows
      per step, each rank j computes (out, lse) of the later ranks' rows against its whole slice, and an all-to-all
      returns them to their owners, which fold them in slice order.
    Both shares run in the same steps, so every rank computes at every step.
    Rank r then does r/2 + (N − 1 − r)/2 = (N − 1)/2 cross blocks of n² plus its causal n²/2: N/2 · n² each, the
    single process's (N·n)²/2 split evenly."""

    #: positions per exchange step (not chunked local attention: `attend` replaces the split attention)
    chunk: int

    def __init__(self, group: Group, bounds, layer_idx: int, chunk: int):
        start = bounds[group.rank][0]
        super().__init__(None, None, prompt_length=start)
        self.group, self.bounds, self.layer_idx, self.chunk = group, bounds, layer_idx, chunk

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = make_part(q_start, own_start, window, softcap, scale, block)
        if sinks is not None:
            if torch.is_grad_enabled():
                raise NotImplementedError(
                    "context-parallel exact mode (the reverse pass) does not support attention sinks yet"
                )
            out, lse = self.forward_parts(q, k, v, own, rounded=False)
            return fold_sinks(out, lse, sinks)[0].to(q.dtype)
        return CaptureAttention.apply(q, k, v, own, self)

    def _layout(self):
        lengths = [e - s for s, e in self.bounds]
        halves = [n // 2 for n in lengths]  # rows [0, half) get the keys, rows [half, n) go to the keys
        return lengths, halves, [n - h for n, h in zip(lengths, halves)]

    def _cross(self, own: Part, r: int, j: int, lo: int, first_half: bool) -> Part:
        """The part of rank r's rows (first half from row 0, else second half from row `lo` of it) against rank j's
        keys from position `lo` of its slice (first half) or its whole slice (second half)."""
        lengths, halves, _ = self._layout()
        if first_half:
            return make_part(own.q_start, self.bounds[j][0] + lo, None, own.softcap, own.scale, own.block)
        return make_part(self.bounds[r][0] + halves[r] + lo, self.bounds[j][0], None, own.softcap, own.scale, own.block)

    def forward_parts(self, q, k, v, own: Part, rounded: bool = True):
        """(out in q's dtype, or float32 where not `rounded`; lse float32 over every key) of this rank's rows; see the
        class."""
        g, me, c = self.group, self.group.rank, self.chunk
        n_me, heads, dv = q.shape[2], q.shape[1], v.shape[-1]
        lengths, halves, second = self._layout()
        half = halves[me]
        acc_o = q.new_zeros((1, heads, n_me, dv), dtype=torch.float32)
        acc_l = q.new_full((1, heads, n_me), float("-inf"), dtype=torch.float32)

        def fold_rows(a: int, b: int, partial) -> None:
            o, l = _fold((acc_o[:, :, a:b], acc_l[:, :, a:b]), partial)
            acc_o[:, :, a:b], acc_l[:, :, a:b] = o, l

        # Both halves of the cross work in one loop, so that every rank computes at every step: the key owner's
        # share (other ranks' second-half rows against this slice) and the query owner's (this rank's first-half
        # rows against earlier slices). Rows of the two halves are disjoint, and each row still folds its partials
        # in slice order, so the result is the same as running the halves one after the other.
        # keys to queries: the last rank's slice is read by no one
        steps_k = list(range(0, max(lengths[:-1], default=0), c))
        # queries to keys: rank 0's rows have no earlier slice
        steps_q = list(range(0, max(second[1:], default=0), c))
        for step in range(max(len(steps_k), len(steps_q))):
            got_k = got_q = None
            if step < len(steps_k):
                lo = steps_k[step]
                hi = max(lo, min(lo + c, n_me))
                got_k = _gather_kv(g, f"capture layer {self.layer_idx}: keys and values, step {step}", k, v, lo, hi, c)
            if step < len(steps_q):
                lo_q = steps_q[step]
                name = f"capture layer {self.layer_idx}: queries to the keys, step {step}"
                hi_q = max(half + lo_q, min(half + lo_q + c, n_me))
                got_q = g.all_gather(name, [_pad_rows(q[:, :, half + lo_q : hi_q], c)])
                send = []  # the key owner's share first: the other ranks wait for it
                for r, (qr,) in enumerate(got_q):
                    m = min(c, second[r] - lo_q)
                    o = qr.new_zeros((1, heads, c, dv), dtype=torch.float32)
                    l = qr.new_full((1, heads, c), float("-inf"), dtype=torch.float32)
                    if r > me and m > 0:
                        po, pl = part_forward(qr[:, :, :m], k, v, self._cross(own, r, me, lo_q, False))
                        o[:, :, :m], l[:, :, :m] = po.float(), pl.float()
                    send.append([o, l])
            if got_k is not None:
                for j in range(me):
                    n = min(c, lengths[j] - lo)
                    if n > 0 and half > 0:
                        kj, vj = got_k[j]
                        fold_rows(
                            0,
                            half,
                            part_forward(q[:, :, :half], kj[:, :, :n], vj[:, :, :n], self._cross(own, me, j, lo, True)),
                        )
            if got_q is not None:
                back = g.all_to_all(f"{name}: partial outputs", send)
                m = min(c, second[me] - lo_q)
                if m > 0:
                    for j in range(me):  # slice order
                        oj, lj = back[j]
                        fold_rows(half + lo_q, half + lo_q + m, (oj[:, :, :m], lj[:, :, :m]))
        out, lse = _fold((acc_o, acc_l), part_forward(q, k, v, own))
        return (out.to(q.dtype) if rounded else out), lse

    def backward_parts(self, dout, q, k, v, out, lse, own: Part):
        """(dq, dk, dv) of this rank's rows and slice (exact mode's reverse pass), the forward's exchanges run again
        with gradients travelling back: dK/dV of an earlier slice's chunk to its owner, dq of a later rank's rows to
        theirs. Every part's backward reads the merged output and the log-sum-exp over all keys, so no part needs its
        own (out, lse). Sums run in a fixed order (own part, then keys-to-queries by step and rank, then
        queries-to-keys by rank)."""
        g, me, c = self.group, self.group.rank, self.chunk
        n_me = q.shape[2]
        lengths, halves, second = self._layout()
        half = halves[me]
        dq, dk, dv = (t.float() for t in part_backward(dout, q, k, v, out, lse, own, need_kv=True))
        dq, dk, dv = dq.clone(), dk.clone(), dv.clone()
        for step, lo in enumerate(range(0, max(lengths[:-1], default=0), c)):
            name = f"capture backward layer {self.layer_idx}: keys and values, step {step}"
            hi = max(lo, min(lo + c, n_me))
            got = _gather_kv(g, name, k, v, lo, hi, c)
            send = []
            for j, (kj, vj) in enumerate(got):
                dkj, dvj = torch.zeros_like(kj, dtype=torch.float32), torch.zeros_like(vj, dtype=torch.float32)
                n = min(c, lengths[j] - lo)
                if j < me and n > 0 and half > 0:
                    dqa, dka, dva = part_backward(
                        dout[:, :, :half],
                        q[:, :, :half],
                        kj[:, :, :n],
                        vj[:, :, :n],
                        out[:, :, :half],
                        lse[:, :, :half],
                        self._cross(own, me, j, lo, True),
                        need_kv=True,
                    )
                    dq[:, :, :half] += dqa.float()
                    dkj[:, :, :n], dvj[:, :, :n] = dka.float(), dva.float()
                send.append([dkj, dvj])
            back = g.all_to_all(f"{name}: their gradients", send)
            for r in range(me + 1, g.size):  # rank order
                dkr, dvr = back[r]
                dk[:, :, lo:hi] += dkr[:, :, : hi - lo]
                dv[:, :, lo:hi] += dvr[:, :, : hi - lo]
        for step, lo in enumerate(range(0, max(second[1:], default=0), c)):
            name = f"capture backward layer {self.layer_idx}: queries to the keys, step {step}"
            a, b = half + lo, max(half + lo, min(half + lo + c, n_me))
            got = g.all_gather(name, [_pad_rows(t[:, :, a:b], c) for t in (q, dout, out, lse)])
            send = []
            for r, (qr, gr, outr, lser) in enumerate(got):
                dqr = torch.zeros_like(qr, dtype=torch.float32)
                m = min(c, second[r] - lo)
                if r > me and m > 0:
                    dqb, dkb, dvb = part_backward(
                        gr[:, :, :m],
                        qr[:, :, :m],
                        k,
                        v,
                        outr[:, :, :m],
                        lser[:, :, :m],
                        self._cross(own, r, me, lo, False),
                        need_kv=True,
                    )
                    dqr[:, :, :m] = dqb.float()
                    dk += dkb.float()
                    dv += dvb.float()
                send.append([dqr])
            back = g.all_to_all(f"{name}: query gradients", send)
            for j in range(me):  # slice order
                dq[:, :, a:b] += back[j][0][:, :, : b - a]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gather_kv(g: Group, name: str, k, v, lo: int, hi: int, c: int) -> list[list[torch.Tensor]]:
    """Every rank's K/V rows [lo, hi) of its slice, padded to `c` rows: `[[k_j, v_j]]` in rank order. Where `v` is `k`
    (an MLA layer's latents) the rows travel once."""
    if v is k:
        return [[kj, kj] for (kj,) in g.all_gather(name, [_pad_rows(k[:, :, lo:hi], c)])]
    return g.all_gather(name, [_pad_rows(k[:, :, lo:hi], c), _pad_rows(v[:, :, lo:hi], c)])


class ReplayInfo:
    """What one layer's replay attention needs besides its tensors: the group, every rank's query count, this rank's
    slice K/V and start, the layer (for collective names)."""

    def __init__(self, group: Group, lengths: list[int], layer: SliceKVState):
        self.group, self.lengths, self.layer = group, lengths, layer


class ReplayAttention(torch.autograd.Function):
    """Attention of this rank's branch queries over [every rank's prompt slice | its own K/V], a collective. The
    queries `[B, H, R, D]`: B responses replayed together (the same B on every rank, `checked_batch`), folded into
    one row block against a slice (`prompt_forward`), so each slice is read once for the batch.

    Forward: queries all-gathered (padded to the longest branch); each rank computes (out, lse) of every rank's
    queries against its own slice; an all-to-all returns them to their owners, which fold them in slice order
    0..N−1 (float32) and merge the result with the branch's own causal part. Saves q, own K/V, the merged output
    and the two log-sum-exps, as `longstraw.ops.attention.SplitAttention` does.

    Backward: the prompt part's incoming gradient w_p·dO, the merged output and the prompt part's lse go to every rank
    with the queries (one all-gather); each rank computes dq of every rank's queries against its slice (the prompt
    K/V never move; detached: no dK/dV), an all-to-all returns them, and the owner sums them in slice order."""

    @staticmethod
    def forward(ctx, q, own_k, own_v, slice_k, slice_v, own: Part, info: ReplayInfo, sinks=None):
        g, lengths, layer = info.group, info.lengths, info.layer
        rmax = max(lengths)
        name = f"replay forward layer {layer.layer_idx}"
        qs = g.all_gather(f"{name}: queries", [_pad_rows(q, rmax)])
        prompt = prompt_part(own, layer.start)
        send = []
        for j, (qj,) in enumerate(qs):  # a rank's batch of rows folded against the slice: its K/V read once
            o, l = prompt_forward(qj[:, :, : lengths[j]], slice_k, slice_v, prompt)
            send.append([_pad_rows(o.float(), rmax), _pad_rows(l.float(), rmax)])
        got = g.all_to_all(f"{name}: partial outputs", send)
        r = q.shape[2]
        acc = None
        for o, l in got:  # slice order: the same fold whatever rank computed it
            acc = _fold(acc, (o[:, :, :r], l[:, :, :r]))
        assert acc is not None  # one partial per rank
        out_p, lse_p = acc
        out_o, lse_o = part_forward(q, own_k, own_v, own)
        out, lse = fold_sinks(*_fold((out_p, lse_p), (out_o, lse_o)), sinks)
        out = out.to(q.dtype)
        quantized = isinstance(slice_k, QuantizedTokens)  # a constant, kept on ctx (not a tensor to save)
        ctx.slice_kv = (slice_k, slice_v) if quantized else None
        ctx.save_for_backward(
            q,
            own_k,
            own_v,
            None if quantized else slice_k,
            None if quantized else slice_v,
            out,
            lse_o.float(),
            lse_p,
            lse,
            sinks,
        )
        ctx.own, ctx.info = own, info
        return out

    @staticmethod
    def backward(ctx, dout):
        q, own_k, own_v, slice_k, slice_v, out, lse_o, lse_p, lse, sinks = ctx.saved_tensors
        if ctx.slice_kv is not None:
            slice_k, slice_v = ctx.slice_kv
        need_kv = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]  # exact mode: the slice's state gradient
        own, info = ctx.own, ctx.info
        g, lengths, layer = info.group, info.lengths, info.layer
        rmax, r = max(lengths), q.shape[2]
        # each part's share of the softmax mass over every key (and the sink): exp(lse_part − lse); without a sink
        # the two shares are sigmoid(lse_p − lse_o) and its complement, as `longstraw.ops.attention` computes them
        if sinks is None:
            w_p = torch.sigmoid(lse_p - lse_o)[..., None]
            w_o = 1 - w_p
        else:
            w_p, w_o = torch.exp(lse_p - lse)[..., None], torch.exp(lse_o - lse)[..., None]
        g_p = (dout.float() * w_p).to(dout.dtype)
        g_o = (dout.float() * w_o).to(dout.dtype)
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[7]:  # the sink is a key of value 0: dS = −P_sink · (dO · O)
            p_sink = torch.exp(sinks.float()[None, :, None] - lse)
            d_sinks = -(p_sink * (dout.float() * out.float()).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)
        dq_o, dk, dv = part_backward(g_o, q, own_k, own_v, out, lse_o, own, need_kv=True)
        name = f"replay backward layer {layer.layer_idx}"
        got = g.all_gather(
            f"{name}: queries and gradients", [_pad_rows(t, rmax) for t in (q, g_p, out)] + [_pad_rows(lse_p, rmax)]
        )
        prompt = prompt_part(own, layer.start)
        send, dk_s, dv_s = [], None, None
        for j, (qj, gj, oj, lj) in enumerate(got):
            n = lengths[j]
            dqj, dkj, dvj = prompt_backward(
                gj[:, :, :n], qj[:, :, :n], slice_k, slice_v, oj[:, :, :n], lj[:, :, :n], prompt, need_kv, None
            )
            send.append([_pad_rows(dqj.float(), rmax)])
            if need_kv:  # every branch's gradient of this slice, summed in rank order
                dk_s = dkj.float() if dk_s is None else dk_s + dkj.float()
                dv_s = dvj.float() if dv_s is None else dv_s + dvj.float()
        back = g.all_to_all(f"{name}: query gradients", send)
        dq_p = back[0][0][:, :, :r]
        for (dqi,) in back[1:]:  # slice order
            dq_p = dq_p + dqi[:, :, :r]
        if need_kv:
            dk_s, dv_s = dk_s.to(slice_k.dtype), dv_s.to(slice_v.dtype)
        return (dq_o.float() + dq_p).to(q.dtype), dk, dv, dk_s, dv_s, None, None, d_sinks


class ReplayBranchLayer(AttentionBranchLayer):
    """Branch layer of a context-parallel replay: own K/V kept here, the prompt part read collectively."""

    def __init__(self, info: ReplayInfo, prompt_length: int):
        super().__init__(None, None, prompt_length=prompt_length)
        self.info = info

    def adopt(self, grown: AttentionBranchLayer) -> ReplayBranchLayer:
        """Start after what a branch added to this layer (`grown`: the branch's `SampleBranchLayer`, its own K/V
        `[1, Hkv, T, D]`): a replay after a branch reads those K/V as constants, the response's appended after them.
        Returns self."""
        self.keys, self.values, self.own_offset = grown.keys, grown.values, grown.own_offset
        return self

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = make_part(q_start, own_start, window, softcap, scale, block)
        layer = self.info.layer
        return ReplayAttention.apply(q, k, v, layer.keys, layer.values, own, self.info, sinks)


class SampleBranchLayer(AttentionBranchLayer):
    """Branch layer of context-parallel sampling. Every rank decodes all the sequences alike (the same inputs, the same
    generator: the same tokens as one process), so the queries are already everywhere: each rank computes (out, lse)
    of all the rows against its slice, one all-gather brings every slice's partials to every rank, and each folds
    them in slice order (bitwise the same on every rank) and merges its own part. The attention against the prompt,
    what grows with P, is split N ways; the rest of a decode step is repeated on every rank."""

    def __init__(self, group: Group, layer: SliceKVState, prompt_length: int):
        super().__init__(None, None, prompt_length=prompt_length)
        self.group, self.layer = group, layer

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        b, h, r, d = q.shape
        dv = v.shape[-1]
        scale = float(d**-0.5 if scale is None else scale)
        own = make_part(q_start, own_start, window, softcap, scale, block)
        # the b sequences' rows folded into one row block against the one slice (as SplitAttention does)
        qf = q.transpose(0, 1).reshape(1, h, b * r, d)
        prompt = make_part(q_start, self.layer.start, None, softcap, scale, block, q_period=r if b > 1 else None)
        o, l = part_forward(qf, self.layer.keys, self.layer.values, prompt)
        got = self.group.all_gather(f"sample layer {self.layer.layer_idx}: partial outputs", [o.float(), l.float()])
        acc = None
        for oj, lj in got:  # slice order
            acc = _fold(acc, (oj, lj))
        out_p = acc[0].reshape(h, b, r, dv).transpose(0, 1)
        lse_p = acc[1].reshape(h, b, r).transpose(0, 1)
        out, _ = fold_sinks(*_fold((out_p, lse_p), part_forward(q, k, v, own)), sinks)
        return out.to(q.dtype)


class SlicedKind:
    """The context parallelism of a kind whose state grows with P (full attention; MLA and DSA latents,
    `longstraw.distributed.context_parallel.latent_attention`): each rank keeps its slice of the positions
    (`slice_class`), which its capture, replay and sampling branch layers read across the ranks (`CollectiveKind`,
    `longstraw.distributed.context_parallel.kinds`)."""

    chunked = False
    sliced = True

    def __init__(
        self, slice_class: type[SliceKVState], capture: type, replay: type, sample: type, batched: bool = True
    ):
        self.slice_class, self.capture, self.replay, self.sample = slice_class, capture, replay, sample
        self.batches_replays = batched

    def slice_state(self, layer: LayerState, config, i: int, s: int, e: int, compressed) -> SliceKVState:
        state = self.slice_class(config, i, s, e)
        state.state_dtype = compressed
        return state

    def capture_branch(self, state, g: Group, bounds, i: int, chunk: int):
        return self.capture(g, bounds, i, chunk)

    def capture_relay(self, state, g: Group, cache, i: int, device):
        return None

    def finish_capture(self, state, branch, g: Group, bounds, captured: int, i: int) -> None:
        s, e = bounds[g.rank]
        state.commit(branch, e - s)

    def replay_branch(self, state, g: Group, lengths: list[int], start: int, grown, batch: int = 1):
        replay = self.replay(ReplayInfo(g, lengths, state), start)
        return replay if grown is None else replay.adopt(grown)

    def sample_branch(self, state, g: Group, start: int, batch: int):
        return self.sample(g, state, start)

    def reverse_gradient(self, state, g: Group, i: int):
        return None

    def reverse_relay(self, state, g: Group, cache, i: int, device, gathered):
        return None

    def reverse_roots(self, state, branch, gathered, s: int, e: int, prompt_length: int) -> list:
        """(output, gradient) pairs of the slice's recomputed K/V: the gradient every rank's replays accumulated on
        the slice's leaves (MLA: one leaf, read as keys and values)."""
        # committed at capture; exact mode refuses a quantized state
        assert isinstance(state.keys, torch.Tensor) and isinstance(state.values, torch.Tensor)
        pairs = (
            ((branch.keys, state.keys),)
            if state.values is state.keys
            else ((branch.keys, state.keys), (branch.values, state.values))
        )
        roots = []
        for own, leaf in pairs:
            assert own is not None  # the slice ran through the layer
            if own.requires_grad and leaf.grad is not None:
                roots.append((own, leaf.grad.to(own.dtype)))
        return roots
