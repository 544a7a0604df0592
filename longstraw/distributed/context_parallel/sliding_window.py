"""Sliding-window layers over a process group: the state (the prompt's final window) is the same on every rank; at
capture each rank reads the window before its slice from the tails the earlier ranks gather once, and exact mode's
reverse pass sends the window's gradient back to its owners."""

from __future__ import annotations

import torch

from ...kinds.full_attention import AttentionBranchLayer
from ...ops.attention import Part, part_backward, part_forward
from ..collectives import Group
from ..merge import fold as _fold
from ..merge import fold_sinks
from ..merge import pad_rows as _pad_rows
from .slices import make_part, prompt_part, rank_sum


def window_before(tails, bounds, pos: int, keep: int):
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
        ks.append(k[:, :, a - first : b - first])
        vs.append(v[:, :, a - first : b - first])
    if not ks:
        return None, None, lo
    return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2), lo


class SlidingCaptureBranchLayer(AttentionBranchLayer):
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
            raise NotImplementedError(
                "context-parallel exact mode (the reverse pass) does not support attention sinks yet"
            )
        g = self.group
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        own = make_part(q_start, own_start, window, softcap, scale, block)
        keep = window - 1
        n = k.shape[-2]
        if keep > 0:
            tail = max(0, n - keep)
            got = g.all_gather(
                f"capture layer {self.layer_idx}: window keys and values",
                [_pad_rows(k[:, :, tail:], keep), _pad_rows(v[:, :, tail:], keep)],
            )
            lengths = [min(keep, e - s) for s, e in self.bounds]
            self.tails = [(kj[:, :, :m], vj[:, :, :m]) for (kj, vj), m in zip(got, lengths)]
        else:
            self.tails = [(k[:, :, :0], v[:, :, :0])] * g.size
        if torch.is_grad_enabled():  # exact mode's reverse pass: the window's gradient goes back to its owners
            return SlidingCaptureAttention.apply(q, k, v, own, self)
        pk, pv, start = window_before(self.tails, self.bounds, self.bounds[g.rank][0], keep)
        acc = None if pk is None else part_forward(q, pk, pv, prompt_part(own, start))
        out, _ = fold_sinks(*_fold(acc, part_forward(q, k, v, own)), sinks)
        return out.to(q.dtype)


class SlidingCaptureAttention(torch.autograd.Function):
    """A sliding-window layer of exact mode's reverse pass (`SlidingCaptureBranchLayer`, whose `tails` the forward
    has gathered): forward as in capture; backward computes dq and the own dK/dV, and the gradient of the window
    before the slice, which lies in the tails of earlier ranks, goes back to them (one all-to-all of W − 1 rows per
    rank), each owner adding what it receives in rank order to its own tail's rows."""

    @staticmethod
    def forward(ctx, q, k, v, own: Part, layer: SlidingCaptureBranchLayer):
        g = layer.group
        assert own.window is not None  # a sliding window's part
        keep = own.window - 1
        pk, pv, start = window_before(layer.tails, layer.bounds, layer.bounds[g.rank][0], keep)
        prompt = None if pk is None else prompt_part(own, start)
        acc = None if prompt is None else part_forward(q, pk, pv, prompt)
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
        send = [
            [
                k.new_zeros((*k.shape[:2], keep, k.shape[-1]), dtype=torch.float32),
                v.new_zeros((*v.shape[:2], keep, v.shape[-1]), dtype=torch.float32),
            ]
            for _ in range(g.size)
        ]
        if window:
            pk, pv = window
            dqw, dpk, dpv = part_backward(dout, q, pk, pv, out, lse, ctx.prompt, need_kv=True)
            dq = dq + dqw.float()
            row = 0  # rows of the window come from the ranks' tails in position order (`window_before`)
            for j, ((sj, ej), (kj, _)) in enumerate(zip(bounds, layer.tails)):
                a, b = max(sj, ctx.start), min(ej, bounds[g.rank][0])
                if a >= b:
                    continue
                first = ej - kj.shape[-2]  # position of tail j's first row
                send[j][0][:, :, a - first : b - first] += dpk[:, :, row : row + b - a].float()
                send[j][1][:, :, a - first : b - first] += dpv[:, :, row : row + b - a].float()
                row += b - a
        back = g.all_to_all(f"reverse pass layer {layer.layer_idx}: window gradients", send)
        m = min(keep, k.shape[-2])
        if m > 0:
            for dkr, dvr in back:  # rank order
                dk[:, :, k.shape[-2] - m :] += dkr[:, :, :m]
                dv[:, :, v.shape[-2] - m :] += dvr[:, :, :m]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class WindowKind:
    """The context parallelism of a sliding-window layer (`CollectiveKind`): its state, the prompt's last W − 1 keys,
    is replicated; during capture each rank's slice reads the windows it needs from the ranks before it
    (`SlidingCaptureBranchLayer`), and the final window is put together from the slices' tails on every rank."""

    chunked = False
    sliced = False
    batches_replays = True

    def slice_state(self, layer, config, i: int, s: int, e: int, compressed):
        return layer

    def capture_branch(self, state, g: Group, bounds, i: int, chunk: int):
        assert state.window is not None  # a sliding window's (chunked attention is not served)
        return SlidingCaptureBranchLayer(g, bounds, i, state.window)

    def capture_relay(self, state, g: Group, cache, i: int, device):
        return None

    def finish_capture(self, state, branch, g: Group, bounds, captured: int, i: int) -> None:
        """The prompt's final window, on every rank."""
        k, v, _ = window_before(branch.tails, bounds, captured, state.window - 1)
        state.keys, state.values, state.length = k.clone(), v.clone(), captured

    def replay_branch(self, state, g: Group, lengths: list[int], start: int, grown, batch: int = 1):
        return state.branch(batch) if grown is None else grown

    def sample_branch(self, state, g: Group, start: int, batch: int):
        return state.branch(batch)

    def reverse_gradient(self, state, g: Group, i: int):
        """The replays' gradient of the replicated final window, summed over the ranks (a collective); None when the
        window is empty."""
        if state.keys is None:
            return None
        assert state.values is not None  # stored with the keys
        mine = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (state.keys, state.values)]
        return rank_sum(g.all_gather(f"reverse pass layer {i}: final window gradient", mine))

    def reverse_relay(self, state, g: Group, cache, i: int, device, gathered):
        return None

    def reverse_roots(self, state, branch, gathered, s: int, e: int, prompt_length: int) -> list:
        """This slice's rows of the final window, with their share of its gradient."""
        if gathered is None:
            return []
        assert branch.keys is not None and branch.values is not None  # the slice ran through the layer
        dk_w, dv_w = gathered
        w_start = prompt_length - 1 - state.keys.shape[-2]
        a, b = max(s, w_start), e
        if a >= b or not branch.keys.requires_grad:
            return []
        return [
            (branch.keys[:, :, a - s : b - s], dk_w[:, :, a - w_start : b - w_start].to(branch.keys.dtype)),
            (branch.values[:, :, a - s : b - s], dv_w[:, :, a - w_start : b - w_start].to(branch.values.dtype)),
        ]
