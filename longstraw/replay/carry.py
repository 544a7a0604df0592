"""What a replay in pieces carries from one piece to the next: a trajectory's segments (`segments`), and the
carry (`Carry`): the own keys and values (or latents) the pieces produced, as buffers that collect their gradient,
and the recurrent states at the pieces' boundaries. Segmented replay (`longstraw.replay.segments`) carries every layer's
across a trajectory's segments; layer-major replay (`longstraw.replay.layer_major`) one layer's across its chunks."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import cast

import torch

from ..hf.cache import BranchCache
from ..kinds import PromptBranchLayer, branch_layers
from ..ops.logprobs import chunked_logprobs
from ..prompt_state import Replay


@dataclass(frozen=True)
class Segment:
    """Tokens `[start, end)` of a trajectory, written by the policy (`policy=True`) or by the environment."""

    start: int
    end: int
    policy: bool


def segments(mask: torch.Tensor) -> list[Segment]:
    """The maximal runs of equal `mask` `[T]` (1: policy, 0: environment), in order."""
    m = torch.as_tensor(mask).reshape(-1)
    if m.numel() == 0:
        return []
    flips = (m[1:] != m[:-1]).nonzero().flatten().add(1).tolist()
    bounds = [0, *flips, m.numel()]
    return [Segment(a, b, bool(m[a] > 0)) for a, b in zip(bounds[:-1], bounds[1:])]


def policy_loss(
    parts, hidden, response, seg: Segment, segment_loss, temperature: float, logprobs, entropy
) -> torch.Tensor | None:
    """A policy segment's log-probs and entropies from its hidden states `[1, len, d]` (with their graph) given to
    `segment_loss`; written, detached, into `logprobs` / `entropy` `[T]`. Returns the segment's loss (or None)."""
    sl = slice(seg.start, seg.end)
    lp, ent = chunked_logprobs(
        hidden[0],
        parts.lm_head,
        response[sl],
        temperature=temperature,
        softcap=parts.final_logit_softcapping,
        scale=parts.logit_scale,
    )
    logprobs[sl], entropy[sl] = lp.detach(), ent.detach()
    return segment_loss(sl, Replay(logprobs=lp, entropy=ent))


class Carry:
    """What later segments read of one trajectory's own growth, as tensors that collect its gradient.

    Tensors that grow with the trajectory (attention keys and values `[1, Hkv, T, D]`, MLA latents `[1, 1, T, r + dr]`
    and DSA indexer keys `[1, T, Di]`): one buffer each for the whole trajectory, with its gradient; a segment reads
    the positions before it in place (`_read`: its gradient added into `buffer.grad` in place) and what it produced
    is copied in after its forward. Recurrent layers (linear attention, SSM, short convolutions): the states at each
    segment boundary as leaves (O(1) each); boundary 0 is the prompt state's own (exact-mode leaves of the
    `PromptState`). What the cache already held of its own when the carry was made (a `Branch`'s tokens: a row's
    question after a shared document) is the buffers' first positions, constants the trajectory reads.
    Memory: 2 × the trajectory's own state + the boundary states; during a segment's backward, also one layer's
    gradients of what the segment read (the attention kernel's dK and dV, and one of them copied into the read's
    strides: up to 1.5 / L of the own state over L layers).
    """

    @staticmethod
    def serves(cache) -> bool:
        """Whether every layer of `cache` is one the carry holds (`BranchLayer.carries_segments`)."""
        return all(layer.carries_segments for layer in branch_layers(cache))

    def __init__(self, cache, total: int, layers: Collection[int] | None = None):
        self.total = total
        mine = [(i, layer) for i, layer in enumerate(branch_layers(cache)) if layers is None or i in layers]
        #: what each layer's own state grows by (`grown_tensors`), and the layers with recurrent states (of `layers`;
        #: None: every layer)
        self.appended = {i: layer.grown_tensors for i, layer in mine if layer.grown_tensors}
        self.recurrent = [i for i, layer in mine if layer.boundary_states() is not None]
        self.buffers: dict[tuple[int, str], torch.Tensor] = {}
        #: what each appended tensor held before the trajectory (a branch's own tokens; None: nothing), its length
        #: along the token dimension, and each layer's own positions before it (`segment_offset`)
        self.base: dict[tuple[int, str], torch.Tensor | None] = {}
        self.kept: dict[tuple[int, str], int] = {}
        self.offset: dict[int, int] = {}
        #: layers that read their earlier own tensors in place as a part of their own (`reads_carried_in_place`): a
        #: segment's forward then appends only its own, no copy of the trajectory's
        self.carried = {i for i in self.appended if grown(cache, i).reads_carried_in_place}
        for i, attrs in self.appended.items():
            layer = grown(cache, i)
            self.offset[i] = layer.segment_offset()
            for name, dim in attrs:
                t = getattr(layer, name)
                self.base[(i, name)] = t
                self.kept[(i, name)] = 0 if t is None else t.shape[dim]
        self.initial = {i: dict(branch_layers(cache)[i].boundary_states() or {}) for i in self.recurrent}
        self.boundaries: list[dict] = [{}]  # per boundary j: {(layer, "conv"|"recurrent", state idx): leaf}

    @staticmethod
    def _slice(t: torch.Tensor, dim: int, start: int, end: int | None = None) -> torch.Tensor:
        return t.narrow(dim % t.dim(), start, (t.shape[dim] if end is None else end) - start)

    def _read(self, key: tuple[int, str], dim: int, length: int) -> torch.Tensor:
        """The first `length` positions of buffer `key` as a leaf of their own, sharing the buffer's storage; the
        gradient a backward delivers to it is added into the same positions of the buffer's gradient in place and
        dropped. Its accumulation runs as soon as the layer's backward has made it (autograd runs a leaf's first),
        so what a segment's backward holds beyond the carry is one layer's gradient of what it read (in the leaf's
        strides), not a zero-filled gradient of the whole buffer per layer (a view's backward would make one) nor
        every layer's at once (a function of the buffer, created before the segment's forward, would run last)."""
        buf = self.buffers[key]
        leaf = self._slice(buf.detach(), dim, 0, length).requires_grad_(True)

        def accumulate(t: torch.Tensor) -> None:
            if t.grad is None:
                return
            if buf.grad is None:
                buf.grad = torch.zeros_like(buf)
            self._slice(buf.grad, dim, 0, length).add_(t.grad)
            t.grad = None

        leaf.register_post_accumulate_grad_hook(accumulate)
        return leaf

    def enter(self, cache: BranchCache, j: int, start: int) -> None:
        """Set the cache up to run segment j (first token at `start`) from the carry."""
        for i, attrs in self.appended.items():
            before = {}
            for name, dim in attrs:
                key = (i, name)
                buf = self.buffers.get(key)
                before[name] = (
                    self.base[key] if start == 0 or buf is None else self._read(key, dim, self.kept[key] + start)
                )
            grown(cache, i).enter_segment(before, self.offset[i])
        for i in self.recurrent:
            if j == 0:  # the states the trajectory started from
                branch_layers(cache)[i].load_boundary(self.initial[i], reset=True)
            else:
                states = {(which, idx): leaf for (li, which, idx), leaf in self.boundaries[j].items() if li == i}
                branch_layers(cache)[i].load_boundary(states)

    def leave(
        self, cache: BranchCache, j: int, start: int, end: int, first_pass: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After segment j's forward: on the first pass, store what it produced (into the buffers, its end states as
        the leaves of boundary j + 1); on the reverse pass, the (produced tensor, accumulated gradient) pairs to
        back-propagate."""
        out = []
        for i, attrs in self.appended.items():
            layer = cache.layers[i]
            for name, dim in attrs:
                own = getattr(layer, name)
                if own is None:
                    continue
                key = (i, name)
                k = self.kept[key]
                # a carried layer's own tensors are this segment's only
                new = (
                    self._slice(own, dim, 0, end - start)
                    if i in self.carried
                    else self._slice(own, dim, k + start, k + end)
                )
                if first_pass:
                    if key not in self.buffers:
                        shape = list(new.shape)
                        shape[dim % new.dim()] = k + self.total
                        self.buffers[key] = new.new_zeros(shape)
                        base = self.base[key]
                        if base is not None:
                            self._slice(self.buffers[key], dim, 0, k).copy_(base)
                    with torch.no_grad():
                        self._slice(self.buffers[key], dim, k + start, k + end).copy_(new)
                else:
                    buf = self.buffers[key]
                    if buf.grad is not None and new.requires_grad:
                        out.append((new, self._slice(buf.grad, dim, k + start, k + end)))
        if first_pass:
            nxt = {}
            for i in self.recurrent:
                for (which, idx), t in (branch_layers(cache)[i].boundary_states() or {}).items():
                    nxt[(i, which, idx)] = t.detach().clone().requires_grad_(True)
            self.boundaries.append(nxt)
        else:
            for (i, which, idx), leaf in self.boundaries[j + 1].items():
                produced = (branch_layers(cache)[i].boundary_states() or {}).get((which, idx))
                if leaf.grad is not None and produced is not None and produced.requires_grad:
                    out.append((produced, leaf.grad))
        return out


def grown(cache: BranchCache, i: int) -> PromptBranchLayer:
    """Layer i of `cache`, one whose own tensors grow (`grown_tensors`: an attention or latent branch layer)."""
    return cast(PromptBranchLayer, cache.layers[i])
