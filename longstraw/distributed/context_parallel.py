"""Context-parallel capture and branch replay over a process group (the design is in `longstraw.distributed`).

`capture(model, prompt_ids, ..., group=pg)` is `longstraw.capture` with a group: every rank of the group calls it
with the same arguments and gets a `ContextParallelState` holding the durable state of its own slice of the prompt.
`state.replay(response_ids)` is then a collective in which every rank brings its own branch.
"""

from __future__ import annotations

import torch

from ..hf.cache import BranchCache
from ..layers import base
from ..layers.base import LayerState
from ..layers.full_attention import AttentionBranchLayer, KVState
from ..layers.latent_attention import IndexedLatentState, LatentOwn, LatentState
from ..layers.linear_attention import RecurrentBranchLayer, RecurrentState
from ..layers.sliding_window import SlidingKVState
from ..models import ModelParts, base_model
from ..ops import quant
from ..ops.attention import DEFAULT_BLOCK, Part, part_backward, part_forward
from ..ops.logprobs import chunked_logprobs
from ..ops.quant import QUANT_BLOCK, QuantizedTokens
from ..state import (
    PromptState,
    Replay,
    as_ids,
    check_capture_options,
    check_length,
    first_trainable_layer,
    model_device,
    run_decoder,
)
from .collectives import Group, digest
from .merge import fold as _fold
from .merge import fold_sinks
from .merge import pad_rows as _pad_rows
from .sparse import SparseCaptureAttention, SparseReplayAttention, as_selection, select, slice_partials, sparse_partial

__all__ = ["ContextParallelState", "SliceIndexedLatentState", "SliceKVState", "SliceLatentState", "capture",
           "slice_bounds"]


def slice_bounds(total: int, size: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous slices `[(start, end)]` of `total` positions over `size` ranks, every boundary a multiple of `align`
    (but the last end, `total`): the ⌈total / align⌉ units are split as evenly as they go, the first ranks holding one
    more. align 1: the first `total % size` ranks hold one position more than the others."""
    units = -(-total // align)
    base_len, extra = divmod(units, size)
    bounds, s = [], 0
    for r in range(size):
        e = min(total, s + (base_len + (1 if r < extra else 0)) * align)
        bounds.append((s, e))
        s = e
    return bounds


# ----------------------------------------------------------------------------------------- log-sum-exp folding


def _part(q_start, k_start, window, softcap, scale, block, q_period=None) -> Part:
    """A `longstraw.ops.attention.Part`, built by field name (the kernel interface is being reorganised)."""
    return Part(q_start=int(q_start), k_start=int(k_start), window=window, softcap=softcap, scale=float(scale),
                block=int(block), q_period=q_period)


def _prompt_part(part: Part, k_start: int) -> Part:
    return _part(part.q_start, k_start, part.window, part.softcap, part.scale, part.block)


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
            raise RuntimeError(f"layer {self.layer_idx}: slice of {self.end - self.start} tokens, chunk of {n} "
                               f"produced {k.shape[-2]} keys")
        self.keys, self.values = self._store(k), self._store(v)
        self.length = self.end

    def _store(self, x: torch.Tensor):
        """The slice's copy of `x`: in the model's dtype, or in 8 bits with `capture(state_dtype=...)` (blocks of
        `QUANT_BLOCK` positions counted from position 0: the slices start on block boundaries, so the blocks and
        their scales are those of one process)."""
        if self.state_dtype is not None:
            stored = QuantizedTokens(x, x.shape[-2], self.state_dtype)
            stored.append(x)
            return stored
        stored = base.empty_state(x, tuple(x.shape))
        stored.copy_(x)
        return stored

    def tensors(self) -> list[torch.Tensor]:
        return [t for x in (self.keys, self.values) if x is not None
                for t in (x.tensors() if isinstance(x, QuantizedTokens) else [x])]

    def release(self) -> None:
        self.keys = self.values = None

    supports_exact = True

    def require_grad(self) -> None:
        """Exact mode: the slice's K/V become leaves; every rank's replays accumulate their gradient here."""
        self.keys.requires_grad_(True)
        self.values.requires_grad_(True)


class SliceLatentState(SliceKVState):
    """Latents `[1, 1, end − start, kv_lora_rank + qk_rope_head_dim]` of one MLA layer for this rank's slice (built by
    the context-parallel capture in place of `LatentState`). The latent attention is multi-query attention with the
    latent as its one key head and as its values (`longstraw.ops.latent_attention`), so the slice is read as K/V with
    `keys` and `values` the same tensor, kept once."""

    def commit(self, branch_layer, n: int) -> None:
        latent = branch_layer.keys
        if n != self.end - self.start or latent.shape[-2] != n:
            raise RuntimeError(f"layer {self.layer_idx}: slice of {self.end - self.start} tokens, chunk of {n} "
                               f"produced {latent.shape[-2]} latents")
        self.keys = self.values = self._store(latent)
        self.length = self.end

    def tensors(self) -> list[torch.Tensor]:
        if self.keys is None:
            return []
        return self.keys.tensors() if isinstance(self.keys, QuantizedTokens) else [self.keys]

    def require_grad(self) -> None:
        self.keys.requires_grad_(True)


class SliceIndexedLatentState(SliceLatentState):
    """`SliceLatentState` of a DSA layer, plus the indexer keys `[1, end − start, index_head_dim]` of the slice (none on
    GLM-5's "shared" layers, which reuse the selection of the layer before)."""

    def __init__(self, config, layer_idx: int, start: int, end: int):
        super().__init__(config, layer_idx, start, end)
        types = getattr(config, "indexer_types", None)
        self.has_indexer = types is None or types[layer_idx] != "shared"
        self.index_keys: torch.Tensor | None = None

    def commit(self, branch_layer, n: int) -> None:
        super().commit(branch_layer, n)
        if self.has_indexer:
            keys = branch_layer.index_keys
            if keys is None or keys.shape[-2] != n:
                raise RuntimeError(f"layer {self.layer_idx}: the indexer produced no keys for the slice")
            self.index_keys = base.empty_state(keys, tuple(keys.shape))
            self.index_keys.copy_(keys)

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + ([] if self.index_keys is None else [self.index_keys])

    def release(self) -> None:
        super().release()
        self.index_keys = None


class _LatentOwn(LatentOwn):
    """What `longstraw.layers.latent_attention.LatentAttention` reads of a branch layer, for the context-parallel branch
    layers of MLA layers: the branch's own latents are its keys and its values (one tensor), there is no local prompt
    part (`prompt` None: the slices are read through `attend`), and the absorbed up-projections are cached per branch.
    """

    prompt = None
    prompt_index = None
    absorbed = None
    index_keys = None
    values_alias = True


# ----------------------------------------------------------------------------------------- capture

#: layer kinds the context-parallel capture serves: full attention (sliced), sliding window and linear attention
#: (replicated O(1) states)
_SERVED = frozenset({KVState, LatentState, IndexedLatentState, SlidingKVState, RecurrentState})
#: layer kinds whose state is sliced by position (the others are replicated): the slice's state kind, per kind
_SLICED = {KVState: SliceKVState, LatentState: SliceLatentState, IndexedLatentState: SliceIndexedLatentState}


class _CaptureBranchLayer(AttentionBranchLayer):
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

    def __init__(self, group: Group, bounds, layer_idx: int, chunk: int):
        start = bounds[group.rank][0]
        super().__init__(None, None, prompt_length=start)
        self.group, self.bounds, self.layer_idx, self.chunk = group, bounds, layer_idx, chunk

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = _part(q_start, own_start, window, softcap, scale, block)
        if sinks is not None:
            if torch.is_grad_enabled():
                raise NotImplementedError("context-parallel exact mode (the reverse pass) does not support attention "
                                          "sinks yet")
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
            return _part(own.q_start, self.bounds[j][0] + lo, None, own.softcap, own.scale, own.block)
        return _part(self.bounds[r][0] + halves[r] + lo, self.bounds[j][0], None, own.softcap, own.scale, own.block)

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
                got_q = g.all_gather(name, [_pad_rows(q[:, :, half + lo_q:hi_q], c)])
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
                        fold_rows(0, half, part_forward(q[:, :, :half], kj[:, :, :n], vj[:, :, :n],
                                                        self._cross(own, me, j, lo, True)))
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
                    dqa, dka, dva = part_backward(dout[:, :, :half], q[:, :, :half], kj[:, :, :n], vj[:, :, :n],
                                                  out[:, :, :half], lse[:, :, :half], self._cross(own, me, j, lo, True),
                                                  need_kv=True)
                    dq[:, :, :half] += dqa.float()
                    dkj[:, :, :n], dvj[:, :, :n] = dka.float(), dva.float()
                send.append([dkj, dvj])
            back = g.all_to_all(f"{name}: their gradients", send)
            for r in range(me + 1, g.size):  # rank order
                dkr, dvr = back[r]
                dk[:, :, lo:hi] += dkr[:, :, :hi - lo]
                dv[:, :, lo:hi] += dvr[:, :, :hi - lo]
        for step, lo in enumerate(range(0, max(second[1:], default=0), c)):
            name = f"capture backward layer {self.layer_idx}: queries to the keys, step {step}"
            a, b = half + lo, max(half + lo, min(half + lo + c, n_me))
            got = g.all_gather(name, [_pad_rows(t[:, :, a:b], c) for t in (q, dout, out, lse)])
            send = []
            for r, (qr, gr, outr, lser) in enumerate(got):
                dqr = torch.zeros_like(qr, dtype=torch.float32)
                m = min(c, second[r] - lo)
                if r > me and m > 0:
                    dqb, dkb, dvb = part_backward(gr[:, :, :m], qr[:, :, :m], k, v, outr[:, :, :m], lser[:, :, :m],
                                                  self._cross(own, r, me, lo, False), need_kv=True)
                    dqr[:, :, :m] = dqb.float()
                    dk += dkb.float()
                    dv += dvb.float()
                send.append([dqr])
            back = g.all_to_all(f"{name}: query gradients", send)
            for j in range(me):  # slice order
                dq[:, :, a:b] += back[j][0][:, :, :b - a]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gather_kv(g: Group, name: str, k, v, lo: int, hi: int, c: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's K/V rows [lo, hi) of its slice, padded to `c` rows: `[(k_j, v_j)]` in rank order. Where `v` is `k`
    (an MLA layer's latents) the rows travel once."""
    if v is k:
        return [(kj, kj) for (kj,) in g.all_gather(name, [_pad_rows(k[:, :, lo:hi], c)])]
    return g.all_gather(name, [_pad_rows(k[:, :, lo:hi], c), _pad_rows(v[:, :, lo:hi], c)])


class _LatentCaptureBranchLayer(_LatentOwn, _CaptureBranchLayer):
    """`_CaptureBranchLayer` of an MLA layer: the latents are the slice's keys and values."""


class CaptureAttention(torch.autograd.Function):
    """A full-attention layer of the context-parallel capture (`_CaptureBranchLayer`): forward under `no_grad` at
    capture; with autograd in exact mode's reverse pass, whose backward is collective too (`backward_parts`).
    Saves q, k, v (the slice's own), the merged output and the log-sum-exp: O(n) per layer."""

    @staticmethod
    def forward(ctx, q, k, v, own: Part, layer: _CaptureBranchLayer):
        out, lse = layer.forward_parts(q, k, v, own)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.own, ctx.layer = own, layer
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.layer.backward_parts(dout, q, k, v, out, lse, ctx.own)
        return dq, dk, dv, None, None


class _DsaCaptureBranchLayer(_LatentCaptureBranchLayer):
    """`_LatentCaptureBranchLayer` of a DSA layer: the selection and the sparse attention of this rank's slice, its
    rows `chunk` at a time (every rank steps alike), against the earlier slices collectively (`longstraw.distributed.
    sparse`) and its own keys locally. No gradient: detached capture only."""

    def steps(self):
        lengths = [e - s for s, e in self.bounds]
        me = self.group.rank
        for step, lo in enumerate(range(0, max(lengths), self.chunk)):
            counts = [max(0, min(self.chunk, n - lo)) for n in lengths]
            yield step, lo, lo + counts[me], counts

    def select_sparse(self, q, weights, scale, own_keys, topk, *, q_start, own_start, block):
        limits = [s for s, _ in self.bounds]
        pos = []
        for step, lo, hi, counts in self.steps():
            q_pos = torch.arange(q_start + lo, q_start + hi, device=q.device)
            sel = select(self.group, f"capture layer {self.layer_idx}: sparse selection, step {step}", q[:, lo:hi],
                         weights[:, lo:hi], scale, own_keys, own_start, q_pos, topk, block, slice_keys=own_keys,
                         slice_bounds=self.bounds[self.group.rank], lengths=counts, limits=limits)
            pos.append(torch.where(sel.valid, sel.indices, torch.full_like(sel.indices, -1)))
        return as_selection(torch.cat(pos, dim=1), own_start)

    def attend_sparse(self, query, own, selection, *, q_start, own_start, scale, block):
        if torch.is_grad_enabled():  # exact mode's reverse pass
            return SparseCaptureAttention.apply(query, own, selection.indices, selection.valid, own_start, scale, self)
        return self.sparse_forward(query, own, selection, scale)[0].to(query.dtype)

    def sparse_forward(self, query, own, selection, scale):
        """(out, lse) float32 of this rank's rows (see the class)."""
        limits = [s for s, _ in self.bounds]
        outs, lses = [], []
        for step, lo, hi, counts in self.steps():
            q = query[:, :, lo:hi]
            idx, valid = selection.indices[:, lo:hi], selection.valid[:, lo:hi]
            sel = type(selection)(idx, valid, selection.prompt_length)
            acc = slice_partials(self.group, f"capture layer {self.layer_idx}: sparse attention, step {step}", q, sel,
                                 scale, slice_latents=own, slice_start=selection.prompt_length, lengths=counts,
                                 limits=limits)
            out, lse = _fold(acc, sparse_partial(q, own, selection.prompt_length, idx, valid, scale))
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _capture_branch(layer, group: Group, bounds, layer_idx: int, chunk: int) -> _CaptureBranchLayer:
    return _BRANCH_KINDS[type(layer)][0](group, bounds, layer_idx, chunk)


def _window_before(tails, bounds, pos: int, keep: int):
    """(keys, values, start) of the captured positions [max(0, pos − keep), pos) from the ranks' slice tails (each the
    last min(keep, slice length) positions of its slice, `tails[j] = (k, v)`)."""
    lo = max(0, pos - keep)
    ks, vs = [], []
    for (s, e), (k, v) in zip(bounds, tails):
        a, b = max(s, lo), min(e, pos)
        if a >= b:
            continue
        first = e - k.shape[-2]  # position of the tail's first row
        if a < first:
            raise RuntimeError(f"positions [{a}, {b}) are not in the tail [{first}, {e}) of their slice")
        ks.append(k[:, :, a - first:b - first])
        vs.append(v[:, :, a - first:b - first])
    if not ks:
        return None, None, lo
    return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2), lo


class _SlidingCaptureBranchLayer(AttentionBranchLayer):
    """Branch layer of this rank's slice in a sliding-window layer during capture: the ranks all-gather the last W − 1
    K/V of their slices once (the most any later query reads), rank r attends to what of them lies in the window
    before its slice, and every rank keeps all tails to assemble the prompt's final window (the durable state, the
    same on every rank) without a further exchange."""

    def __init__(self, group: Group, bounds, layer_idx: int, window: int):
        super().__init__(None, None, prompt_length=bounds[group.rank][0], window=window)
        self.group, self.bounds, self.layer_idx = group, bounds, layer_idx
        self.tails = None

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        if sinks is not None and torch.is_grad_enabled():
            raise NotImplementedError("context-parallel exact mode (the reverse pass) does not support attention "
                                      "sinks yet")
        g = self.group
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = _part(q_start, own_start, window, softcap, scale, block)
        keep = window - 1
        n = k.shape[-2]
        if keep > 0:
            tail = max(0, n - keep)
            got = g.all_gather(f"capture layer {self.layer_idx}: window keys and values",
                               [_pad_rows(k[:, :, tail:], keep), _pad_rows(v[:, :, tail:], keep)])
            lengths = [min(keep, e - s) for s, e in self.bounds]
            self.tails = [(kj[:, :, :m], vj[:, :, :m]) for (kj, vj), m in zip(got, lengths)]
        else:
            self.tails = [(k[:, :, :0], v[:, :, :0])] * g.size
        if torch.is_grad_enabled():  # exact mode's reverse pass: the window's gradient goes back to its owners
            return SlidingCaptureAttention.apply(q, k, v, own, self)
        pk, pv, start = _window_before(self.tails, self.bounds, self.bounds[g.rank][0], keep)
        acc = None if pk is None else part_forward(q, pk, pv, _prompt_part(own, start))
        out, _ = fold_sinks(*_fold(acc, part_forward(q, k, v, own)), sinks)
        return out.to(q.dtype)


class SlidingCaptureAttention(torch.autograd.Function):
    """A sliding-window layer of exact mode's reverse pass (`_SlidingCaptureBranchLayer`, whose `tails` the forward
    has gathered): forward as in capture; backward computes dq and the own dK/dV, and the gradient of the window
    before the slice, which lies in the tails of earlier ranks, goes back to them (one all-to-all of W − 1 rows per
    rank), each owner adding what it receives in rank order to its own tail's rows."""

    @staticmethod
    def forward(ctx, q, k, v, own: Part, layer: _SlidingCaptureBranchLayer):
        g = layer.group
        keep = own.window - 1
        pk, pv, start = _window_before(layer.tails, layer.bounds, layer.bounds[g.rank][0], keep)
        prompt = None if pk is None else _prompt_part(own, start)
        acc = None if pk is None else part_forward(q, pk, pv, prompt)
        out, lse = _fold(acc, part_forward(q, k, v, own))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if pk is None else (pk, pv)))
        ctx.own, ctx.layer, ctx.prompt, ctx.start = own, layer, prompt, start
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *window = ctx.saved_tensors
        layer, own = ctx.layer, ctx.own
        g, bounds = layer.group, layer.bounds
        keep = own.window - 1
        dq, dk, dv = (t.float() for t in part_backward(dout, q, k, v, out, lse, own, need_kv=True))
        send = [[k.new_zeros((*k.shape[:2], keep, k.shape[-1]), dtype=torch.float32),
                 v.new_zeros((*v.shape[:2], keep, v.shape[-1]), dtype=torch.float32)] for _ in range(g.size)]
        if window:
            pk, pv = window
            dqw, dpk, dpv = part_backward(dout, q, pk, pv, out, lse, ctx.prompt, need_kv=True)
            dq = dq + dqw.float()
            row = 0  # rows of the window come from the ranks' tails in position order (`_window_before`)
            for j, ((sj, ej), (kj, _)) in enumerate(zip(bounds, layer.tails)):
                a, b = max(sj, ctx.start), min(ej, bounds[g.rank][0])
                if a >= b:
                    continue
                first = ej - kj.shape[-2]  # position of tail j's first row
                send[j][0][:, :, a - first:b - first] += dpk[:, :, row:row + b - a].float()
                send[j][1][:, :, a - first:b - first] += dpv[:, :, row:row + b - a].float()
                row += b - a
        back = g.all_to_all(f"reverse pass layer {layer.layer_idx}: window gradients", send)
        m = min(keep, k.shape[-2])
        if m > 0:
            for dkr, dvr in back:  # rank order
                dk[:, :, k.shape[-2] - m:] += dkr[:, :, :m]
                dv[:, :, v.shape[-2] - m:] += dvr[:, :, :m]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _slots(branch: RecurrentBranchLayer, number: int) -> list[tuple[dict, int, bool]]:
    """(dict, index, whether set) of a linear-attention branch layer's conv and recurrent state slots, in order."""
    return [(states, i, bool(done[i]) and states.get(i) is not None) for i in range(number)
            for states, done in ((branch.conv_states, branch.is_conv_states_initialized),
                                 (branch.recurrent_states, branch.is_recurrent_states_initialized))]


class _RecurrentRelay:
    """Carries a linear-attention layer's conv and recurrent state across the slice boundaries during capture: rank r
    waits for the state at the end of rank r − 1's slice before its decoder layer runs (a forward pre-hook puts it in
    the branch layer the model reads), and sends its own end state to rank r + 1 after the layer (a forward hook).
    Serial per layer: rank r's layer l starts when rank r − 1's layer l is done; consecutive linear layers pipeline
    (rank r − 1 runs layer l + 1 while rank r runs layer l), an attention layer's all-gather joins them again."""

    def __init__(self, group: Group, cache: BranchCache, layer_idx: int, state: RecurrentState, device):
        self.group, self.cache, self.layer_idx, self.state, self.device = group, cache, layer_idx, state, device
        self.name = f"capture layer {layer_idx}: linear-attention state"

    @staticmethod
    def pack(branch: RecurrentBranchLayer, number: int) -> list[torch.Tensor]:
        slots = _slots(branch, number)
        return [torch.tensor([int(present) for _, _, present in slots], dtype=torch.int64),
                *[states[i] for states, i, present in slots if present]]

    @staticmethod
    def unpack(tensors: list[torch.Tensor], number: int) -> tuple[dict, dict]:
        flags, rest = tensors[0].tolist(), list(tensors[1:])
        conv, rec = {}, {}
        for i in range(number):
            for which, states in ((0, conv), (1, rec)):
                if flags[2 * i + which]:
                    states[i] = rest.pop(0)
        return conv, rec

    def before(self, module, args):
        g, st = self.group, self.state
        if g.rank > 0:
            conv, rec = self.unpack(g.recv(self.name, g.rank - 1, self.device), st.number_of_states)
            self.cache.layers[self.layer_idx] = RecurrentBranchLayer(conv, rec, st.number_of_states, st.conv_trim)

    def after(self, module, args, output):
        g = self.group
        if g.rank < g.size - 1:
            g.send(self.name, self.pack(self.cache.layers[self.layer_idx], self.state.number_of_states), g.rank + 1)


def _present(branch: RecurrentBranchLayer, number: int) -> list[tuple[dict, int]]:
    """(dict, index) of a branch layer's states that are set, in `_RecurrentRelay.pack` order."""
    return [(states, i) for states, i, present in _slots(branch, number) if present]


def _rank_sum(got: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Element-wise sums of every rank's tensors (an all-gather's result), added in rank order from rank 0."""
    total = list(got[0])
    for parts in got[1:]:
        total = [t + p for t, p in zip(total, parts)]
    return total


class _RelayIn(torch.autograd.Function):
    """Exact mode's reverse pass, rank r > 0: the states that rank r − 1's slice ended in enter this rank's layer
    through this function; its backward sends their gradient back to rank r − 1. `anchor` (a scalar that requires
    grad) keeps the function in the graph whatever else requires grad."""

    @staticmethod
    def forward(ctx, relay, anchor, *states):
        ctx.relay = relay
        return tuple(t.view_as(t) for t in states)

    @staticmethod
    def backward(ctx, *grads):
        relay = ctx.relay
        relay.group.send(relay.grad_name, [g if g is not None else torch.zeros_like(t)
                                           for g, t in zip(grads, relay.received)], relay.group.rank - 1)
        return (None, None) + (None,) * len(grads)


class _RelayOut(torch.autograd.Function):
    """Exact mode's reverse pass: the layer's output passes through this function with the states its slice ends in;
    its backward (run when the output's gradient is there) adds their gradient: received from rank r + 1, or on the
    last rank the final states' gradient summed over every rank's replays."""

    @staticmethod
    def forward(ctx, relay, hidden, anchor, *states):
        ctx.relay, ctx.shapes = relay, [(t.shape, t.dtype) for t in states]
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        relay = ctx.relay
        g = relay.group
        if g.rank < g.size - 1:
            got = g.recv(relay.grad_name, g.rank + 1, relay.device)
        else:
            got = relay.final_grads
        return (None, grad, None, *[t.to(dtype) for t, (_, dtype) in zip(got, ctx.shapes)])


class _RecurrentRelayExact(_RecurrentRelay):
    """`_RecurrentRelay` for exact mode's reverse pass: the same forward relay (rank r starts from rank r − 1's end
    states), with the state gradients travelling back rank r + 1 → r through `_RelayOut` / `_RelayIn`. Serial per
    layer, as the forward relay is: rank r's layer l backward completes when rank r + 1's has sent its gradient."""

    def __init__(self, group, cache, layer_idx, state, device, final_grads):
        super().__init__(group, cache, layer_idx, state, device)
        self.grad_name = f"reverse pass layer {layer_idx}: linear-attention state gradient"
        self.final_grads = final_grads
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.received = []

    def before(self, module, args):
        g, st = self.group, self.state
        if g.rank == 0:
            return
        conv, rec = self.unpack(g.recv(self.name, g.rank - 1, self.device), st.number_of_states)
        branch = RecurrentBranchLayer(conv, rec, st.number_of_states, st.conv_trim)
        slots = _present(branch, st.number_of_states)
        self.received = [states[i] for states, i in slots]
        for (states, i), t in zip(slots, _RelayIn.apply(self, self.anchor, *self.received)):
            states[i] = t
        self.cache.layers[self.layer_idx] = branch

    def after(self, module, args, output):
        g, st = self.group, self.state
        branch = self.cache.layers[self.layer_idx]
        ends = [states[i] for states, i in _present(branch, st.number_of_states)]
        if g.rank < g.size - 1:
            g.send(self.name, self.pack(branch, st.number_of_states), g.rank + 1)
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = _RelayOut.apply(self, hidden, self.anchor, *ends)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def capture(model, prompt_ids, chunk_size: int = 4096, prompt_grad: str = "detached", block_size: int = DEFAULT_BLOCK,
            verify: bool | None = None, state_dtype=None, *, group, state_device=None) -> ContextParallelState:
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
        "prompt length": length, "prompt_ids": raw,
        "chunk_size": chunk_size if isinstance(chunk_size, int) else repr(chunk_size),
        "prompt_grad": prompt_grad, "block_size": block_size if isinstance(block_size, int) else repr(block_size),
        "verify": verify, "state_dtype": str(state_dtype), "state_device": str(state_device),
        "model config": bm.config.to_json_string(use_diff=False),
        "trainable parameters": trainable,
    })
    check_capture_options(prompt_grad, chunk_size, block_size)
    compressed = quant.state_dtype(state_dtype)
    if compressed is not None and prompt_grad == "exact":
        raise ValueError("state_dtype (a quantized prompt state) is a constant: prompt_grad='exact' needs the state in "
                         "the model's dtype; use prompt_grad='detached' or state_dtype=None")
    if state_device is not None:
        raise NotImplementedError("context-parallel capture (group=...) keeps the state on the model's device so far; "
                                  "state_device is not supported with group=")
    from ..layers import layer_kind
    from ..prepare import prepare
    from ..support import model_parts, untested_because

    parts: ModelParts = model_parts(model)
    kinds = {layer_kind(kind) for kind in parts.plan}
    if kinds - _SERVED:
        other = sorted(k.__name__ for k in kinds - _SERVED)
        raise NotImplementedError(f"context-parallel capture (group=...) serves {sorted(k.__name__ for k in _SERVED)} "
                                  f"so far; {parts.config.model_type!r} also has layer kinds {other}")
    if prompt_grad == "exact" and not kinds <= {KVState, LatentState, IndexedLatentState, RecurrentState,
                                                SlidingKVState}:
        raise NotImplementedError("context-parallel capture (group=...) supports prompt_grad='exact' for models of "
                                  "full-attention, MLA, DSA, sliding-window and linear-attention layers only so far")
    device = model_device(parts.model)
    prompt = as_ids(prompt_ids, "prompt_ids", parts.config.vocab_size, device)
    check_length(parts.config, prompt.numel())
    captured = prompt.numel() - 1
    # a quantized state's slices start on block boundaries (the blocks of one process)
    align = QUANT_BLOCK if compressed is not None else 1
    if captured < g.size * align:
        raise ValueError(f"a prompt of {prompt.numel()} tokens ({captured} captured) cannot give each of the {g.size} "
                         f"ranks a slice{f' of whole 8-bit blocks of {align} positions' if align > 1 else ''}; "
                         "use fewer ranks or capture without group=")
    prepare(model)
    if verify or (verify is None and untested_because(model, parts) is not None):
        from ..self_check import ensure_verified

        ensure_verified(model)
    bounds = slice_bounds(captured, g.size, align)
    s, e = bounds[g.rank]
    if compressed is not None:
        quant.check_device(compressed, device)
    from ..support import layer_states

    layers, branches = [], []
    for i, layer in enumerate(layer_states(parts.config, captured, parts.plan)):
        if type(layer) in _SLICED:
            layers.append(_SLICED[type(layer)](parts.config, i, s, e))
            layers[-1].state_dtype = compressed
            branches.append(_capture_branch(layers[-1], g, bounds, i, chunk_size))
        elif type(layer) is SlidingKVState:
            layers.append(layer)
            branches.append(_SlidingCaptureBranchLayer(g, bounds, i, layer.window))
        else:  # RecurrentState: the first rank starts from nothing, the others from what the relay brings
            layers.append(layer)
            branches.append(RecurrentBranchLayer({}, {}, layer.number_of_states, layer.conv_trim))
    cache = BranchCache(branches, block=block_size)
    # recurrent layers read nothing of the other ranks but the relayed state: they run chunk_size positions at a
    # time, so their intermediates are a chunk's, not the slice's (attention layers need the slice whole, but not
    # their feed-forward modules)
    cache.layer_chunks = (chunk_size, {i for i, layer in enumerate(layers) if isinstance(layer, RecurrentState)})
    cache.ffn_chunk = chunk_size  # and every layer's feed-forward module (position-wise)
    hooks = []
    for i, layer in enumerate(layers):
        if isinstance(layer, RecurrentState):
            relay = _RecurrentRelay(g, cache, i, layer, device)
            block = parts.decoder.layers[i]
            hooks += [block.register_forward_pre_hook(relay.before), block.register_forward_hook(relay.after)]
    try:
        with torch.no_grad():
            run_decoder(parts, prompt[None, s:e], torch.arange(s, e, device=device), cache)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, (layer, branch) in enumerate(zip(layers, cache.layers)):
            if isinstance(layer, SliceKVState):
                layer.commit(branch, e - s)
            elif isinstance(layer, SlidingKVState):  # the prompt's final window, on every rank
                k, v, _ = _window_before(branch.tails, bounds, captured, layer.window - 1)
                layer.keys, layer.values, layer.length = k.clone(), v.clone(), captured
            else:  # the linear-attention state at the end of the prompt, from the last rank to every rank
                mine = _RecurrentRelay.pack(branch, layer.number_of_states)
                final = g.broadcast(f"capture layer {i}: final linear-attention state", mine, src=g.size - 1)
                conv, rec = _RecurrentRelay.unpack(final, layer.number_of_states)
                layer.commit(RecurrentBranchLayer(conv, rec, layer.number_of_states, layer.conv_trim), captured)
    del cache
    key = digest(prompt, chunk_size, block_size, prompt_grad, g.size)
    state = ContextParallelState(parts, layers, prompt[-1:].clone(), prompt.numel(), chunk_size, prompt_grad,
                                 block_size, group=g, bounds=bounds, key=key)
    if prompt_grad == "exact":
        state._prompt = prompt[:captured]
        for layer in layers[first_trainable_layer(parts):]:
            layer.require_grad()
    return state


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
    and the two log-sum-exps, as `longstraw.ops.attention.SplitAttention` does.

    Backward: the prompt part's incoming gradient w_p·dO, the merged output and the prompt part's lse go to every rank
    with the queries (one all-gather); each rank computes dq of every rank's queries against its slice (the prompt
    K/V never move; detached: no dK/dV), an all-to-all returns them, and the owner sums them in slice order."""

    @staticmethod
    def forward(ctx, q, own_k, own_v, slice_k, slice_v, own: Part, info: _ReplayInfo, sinks=None):
        g, lengths, layer = info.group, info.lengths, info.layer
        rmax = max(lengths)
        name = f"replay forward layer {layer.layer_idx}"
        qs = g.all_gather(f"{name}: queries", [_pad_rows(q, rmax)])
        prompt = _prompt_part(own, layer.start)
        send = []
        for j, (qj,) in enumerate(qs):
            o, l = part_forward(qj[:, :, :lengths[j]], slice_k, slice_v, prompt)
            send.append([_pad_rows(o.float(), rmax), _pad_rows(l.float(), rmax)])
        got = g.all_to_all(f"{name}: partial outputs", send)
        r = q.shape[2]
        acc = None
        for o, l in got:  # slice order: the same fold whatever rank computed it
            acc = _fold(acc, (o[:, :, :r], l[:, :, :r]))
        out_p, lse_p = acc
        out_o, lse_o = part_forward(q, own_k, own_v, own)
        out, lse = fold_sinks(*_fold((out_p, lse_p), (out_o, lse_o)), sinks)
        out = out.to(q.dtype)
        quantized = isinstance(slice_k, QuantizedTokens)  # a constant, kept on ctx (not a tensor to save)
        ctx.slice_kv = (slice_k, slice_v) if quantized else None
        ctx.save_for_backward(q, own_k, own_v, None if quantized else slice_k, None if quantized else slice_v, out,
                              lse_o.float(), lse_p, lse, sinks)
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
        got = g.all_gather(f"{name}: queries and gradients",
                           [_pad_rows(t, rmax) for t in (q, g_p, out)] + [_pad_rows(lse_p, rmax)])
        prompt = _prompt_part(own, layer.start)
        send, dk_s, dv_s = [], None, None
        for j, (qj, gj, oj, lj) in enumerate(got):
            n = lengths[j]
            dqj, dkj, dvj = part_backward(gj[:, :, :n], qj[:, :, :n], slice_k, slice_v, oj[:, :, :n], lj[:, :, :n],
                                          prompt, need_kv=need_kv)
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


class _ReplayBranchLayer(AttentionBranchLayer):
    """Branch layer of a context-parallel replay: own K/V kept here, the prompt part read collectively."""

    def __init__(self, info: _ReplayInfo, prompt_length: int):
        super().__init__(None, None, prompt_length=prompt_length)
        self.info = info

    def attend(self, module, q, k, v, *, q_start, own_start, scale, window, softcap, sinks, block):
        if q.shape[0] != 1:
            raise NotImplementedError("context-parallel replay runs one branch per rank (query batch 1)")
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = _part(q_start, own_start, window, softcap, scale, block)
        layer = self.info.layer
        return ReplayAttention.apply(q, k, v, layer.keys, layer.values, own, self.info, sinks)


class _SampleBranchLayer(AttentionBranchLayer):
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
        scale = float(d ** -0.5 if scale is None else scale)
        own = _part(q_start, own_start, window, softcap, scale, block)
        # the b sequences' rows folded into one row block against the one slice (as SplitAttention does)
        qf = q.transpose(0, 1).reshape(1, h, b * r, d)
        part = _part(q_start, self.layer.start, None, softcap, scale, block, q_period=r if b > 1 else None)
        o, l = part_forward(qf, self.layer.keys, self.layer.values, part)
        got = self.group.all_gather(f"sample layer {self.layer.layer_idx}: partial outputs", [o.float(), l.float()])
        acc = None
        for oj, lj in got:  # slice order
            acc = _fold(acc, (oj, lj))
        out_p = acc[0].reshape(h, b, r, dv).transpose(0, 1)
        lse_p = acc[1].reshape(h, b, r).transpose(0, 1)
        out, _ = fold_sinks(*_fold((out_p, lse_p), part_forward(q, k, v, own)), sinks)
        return out.to(q.dtype)


class _LatentReplayBranchLayer(_LatentOwn, _ReplayBranchLayer):
    """`_ReplayBranchLayer` of an MLA layer."""


class _LatentSampleBranchLayer(_LatentOwn, _SampleBranchLayer):
    """`_SampleBranchLayer` of an MLA layer."""


class _DsaReplayBranchLayer(_LatentReplayBranchLayer):
    """`_LatentReplayBranchLayer` of a DSA layer: the branch's selection over every slice (merged on its owner) and
    the sparse attention as a collective autograd function (`SparseReplayAttention`)."""

    def select_sparse(self, q, weights, scale, own_keys, topk, *, q_start, own_start, block):
        layer, g = self.info.layer, self.info.group
        q_pos = torch.arange(q_start, q_start + q.shape[1], device=q.device)
        return select(g, f"replay layer {layer.layer_idx}: sparse selection", q, weights, scale, own_keys, own_start,
                      q_pos, topk, block, slice_keys=layer.index_keys, slice_bounds=(layer.start, layer.end),
                      lengths=self.info.lengths, limits=[own_start] * g.size)

    def attend_sparse(self, query, own, selection, *, q_start, own_start, scale, block):
        if query.shape[0] != 1:
            raise NotImplementedError("context-parallel replay runs one branch per rank (query batch 1)")
        return SparseReplayAttention.apply(query, own, self.info.layer.keys, selection, scale, self.info)


class _DsaSampleBranchLayer(_LatentSampleBranchLayer):
    """`_LatentSampleBranchLayer` of a DSA layer: every rank has all the rows, so the slices' candidates and partials
    are all-gathered and merged alike on every rank."""

    def select_sparse(self, q, weights, scale, own_keys, topk, *, q_start, own_start, block):
        layer, g = self.layer, self.group
        q_pos = torch.arange(q_start, q_start + q.shape[1], device=q.device)
        return select(g, f"sample layer {layer.layer_idx}: sparse selection", q, weights, scale, own_keys, own_start,
                      q_pos, topk, block, slice_keys=layer.index_keys, slice_bounds=(layer.start, layer.end),
                      lengths=[q.shape[1]] * g.size, limits=[own_start] * g.size, replicated=True)

    def attend_sparse(self, query, own, selection, *, q_start, own_start, scale, block):
        layer, g = self.layer, self.group
        acc = slice_partials(g, f"sample layer {layer.layer_idx}: sparse attention", query, selection, scale,
                             slice_latents=layer.keys, slice_start=layer.start, lengths=[query.shape[2]] * g.size,
                             limits=[own_start] * g.size, replicated=True)
        out, _ = _fold(acc, sparse_partial(query, own, own_start, selection.indices, selection.valid, scale))
        return out.to(query.dtype)


#: the branch layers (capture, replay, sampling) that read each kind of sliced state
_BRANCH_KINDS = {
    SliceKVState: (_CaptureBranchLayer, _ReplayBranchLayer, _SampleBranchLayer),
    SliceLatentState: (_LatentCaptureBranchLayer, _LatentReplayBranchLayer, _LatentSampleBranchLayer),
    SliceIndexedLatentState: (_DsaCaptureBranchLayer, _DsaReplayBranchLayer, _DsaSampleBranchLayer),
}


def _replay_branch(layer, info: _ReplayInfo, start: int):
    return _BRANCH_KINDS[type(layer)][1](info, start)


def _sample_branch(layer, group: Group, start: int):
    return _BRANCH_KINDS[type(layer)][2](group, layer, start)


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
    def sliced_nbytes(self) -> int:
        """Bytes of this rank's slice of the states that grow with P (full-attention K/V)."""
        return sum(layer.nbytes for layer in self._live() if isinstance(layer, SliceKVState))

    @property
    def replicated_nbytes(self) -> int:
        """Bytes of the O(1) states every rank holds alike (sliding windows, linear-attention states)."""
        return self.nbytes - self.sliced_nbytes

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
            response = as_ids(response_ids, "response_ids", parts.config.vocab_size, self.last_token.device)
            check_length(parts.config, self.prompt_length + response.numel())
            mine, error = response.numel(), None
        except (ValueError, TypeError) as err:
            mine, error = -1, err
        self._replays += 1
        lengths = [row[0] for row in self.group.agree("ContextParallelState.replay", {
            "captured state": self._key, "replay number": self._replays, "checkpoint_layers": bool(checkpoint_layers),
            "grad enabled": torch.is_grad_enabled()}, free=(mine,))]
        bad = [r for r, n in enumerate(lengths) if n < 0]
        if bad:
            raise ValueError(f"ContextParallelState.replay: invalid response_ids on rank(s) {bad}; no rank "
                             "replays") from error
        inputs = torch.cat([self.last_token, response[:-1]])
        start = self.prompt_length - 1
        positions = torch.arange(start, start + inputs.numel(), device=inputs.device)
        cache = BranchCache([_replay_branch(layer, _ReplayInfo(self.group, lengths, layer), start)
                             if isinstance(layer, SliceKVState) else layer.branch() for layer in layers],
                            block=self.block)
        hidden = run_decoder(parts, inputs[None], positions, cache, checkpoint_layers=checkpoint_layers)
        logprobs, entropy = chunked_logprobs(hidden[0], parts.lm_head, response, temperature=temperature,
                                             softcap=parts.final_logit_softcapping, scale=parts.logit_scale)
        return Replay(logprobs=logprobs, entropy=entropy)

    def backward(self) -> None:
        """Exact mode, a collective: push the gradient the replays accumulated on every rank's slice into the
        parameters.

        Each rank recomputes its slice with autograd (the capture's forward, layer-synchronous, `CaptureAttention`)
        and back-propagates its slice's accumulated K/V gradient; the attention's backward sends dK/dV of earlier
        slices and dq of later ranks' rows back to their owners, so the parameter gradients summed over the ranks
        are those of one process's `PromptState.backward()`. Memory: the slice's whole graph (not chunked yet).
        Detached mode: nothing to do."""
        if self.prompt_grad != "exact":
            return
        layers = self._live()
        if self._backward_done:
            raise RuntimeError("PromptState.backward() was already called for this state")
        self.group.agree("ContextParallelState.backward", {"captured state": self._key, "replays": self._replays})
        s, e = self.slice
        g = self.group
        device = self.last_token.device
        branches, hooks = [], []
        for i, layer in enumerate(layers):
            if isinstance(layer, RecurrentState):
                branches.append(RecurrentBranchLayer({}, {}, layer.number_of_states, layer.conv_trim))
            elif isinstance(layer, SlidingKVState):
                branches.append(_SlidingCaptureBranchLayer(g, self.bounds, i, layer.window))
            else:
                branches.append(_capture_branch(layer, g, self.bounds, i, self.chunk_size))
        cache = BranchCache(branches, block=self.block)
        # sliding windows: the replays' gradient of the replicated final window, summed over the ranks; each rank
        # adds the rows of its own slice to the roots below
        windows = {}
        for i, layer in enumerate(layers):
            if isinstance(layer, SlidingKVState) and layer.keys is not None:
                mine = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (layer.keys, layer.values)]
                got = g.all_gather(f"reverse pass layer {i}: final window gradient", mine)
                windows[i] = _rank_sum(got)
        for i, layer in enumerate(layers):
            if isinstance(layer, RecurrentState):
                # the final states' gradient: every rank's replays added theirs to its own copy; summed in rank order
                final = _present(layer.branch(), layer.number_of_states)
                mine = [states[i2].grad if states[i2].grad is not None else torch.zeros_like(states[i2])
                        for states, i2 in final]
                got = g.all_gather(f"reverse pass layer {i}: final linear-attention state gradient", mine)
                relay = _RecurrentRelayExact(g, cache, i, layer, device, _rank_sum(got))
                block = self._parts.decoder.layers[i]
                hooks += [block.register_forward_pre_hook(relay.before), block.register_forward_hook(relay.after)]
        try:
            with torch.enable_grad():
                hidden = run_decoder(self._parts, self._prompt[None, s:e], torch.arange(s, e, device=device), cache)
        finally:
            for h in hooks:
                h.remove()
        # the slice's output with a zero gradient: every layer's output then takes part in the backward, so hooks
        # on the layers' outputs run before their inner nodes (FSDP2 gathers a sharded layer's parameters there)
        outputs, grads = ([hidden], [torch.zeros_like(hidden)]) if hidden.requires_grad else ([], [])
        for i, (layer, branch) in enumerate(zip(layers, cache.layers)):
            if i in windows:  # this slice's rows of the prompt's final window
                dk_w, dv_w = windows[i]
                w_start = self.prompt_length - 1 - layer.keys.shape[-2]
                a, b = max(s, w_start), e
                if a < b and branch.keys.requires_grad:
                    outputs += [branch.keys[:, :, a - s:b - s], branch.values[:, :, a - s:b - s]]
                    grads += [dk_w[:, :, a - w_start:b - w_start].to(branch.keys.dtype),
                              dv_w[:, :, a - w_start:b - w_start].to(branch.values.dtype)]
                continue
            if not isinstance(layer, SliceKVState):  # linear attention: its gradient travels through the relay
                continue
            pairs = ((branch.keys, layer.keys),) if layer.values is layer.keys else (
                (branch.keys, layer.keys), (branch.values, layer.values))  # MLA: one leaf, read as keys and values
            for own, leaf in pairs:
                if own.requires_grad and leaf.grad is not None:
                    outputs.append(own)
                    grads.append(leaf.grad.to(own.dtype))
        if outputs:
            torch.autograd.backward(outputs, grads)
        del cache, outputs, grads
        self._backward_done = True

    def sample(self, num: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               stop_token_ids=(), generator: torch.Generator | None = None, allowed_token_ids=None):
        """`PromptState.sample` as a collective: every rank decodes all `num` sequences alike and returns the same
        `Samples`, the attention against the prompt split over the ranks (`_SampleBranchLayer`). The arguments and the
        generator's state (the global one when `generator` is None) must agree across ranks (refused otherwise); the
        sampled tokens are compared at the end as well. Spread the samples' replays over the ranks yourself, e.g.
        rank r replays samples r, r + N, ..."""
        from ..sampler import sample, sampling_fields

        self.group.agree("ContextParallelState.sample", {
            "captured state": self._key, "num": num if isinstance(num, int) else repr(num),
            **sampling_fields(max_new_tokens, temperature, top_p, top_k, stop_token_ids, allowed_token_ids, generator)})
        samples = sample(self, num, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                         stop_token_ids=stop_token_ids, generator=generator, allowed_token_ids=allowed_token_ids)
        self.group.agree("ContextParallelState.sample: the sampled tokens",
                         {"tokens": [t.cpu() for t in samples.tokens]})
        return samples

    def _cache(self, batch: int = 1) -> BranchCache:
        """The cache of a decode (`longstraw.sampler`): sliced layers read collectively, the others locally."""
        start = self.prompt_length - 1
        return BranchCache([_sample_branch(layer, self.group, start) if isinstance(layer, SliceKVState)
                            else layer.branch(batch) for layer in self._live()], block=self.block)
