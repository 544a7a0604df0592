"""Layer-major replay: a trajectory's gradient one decoder layer at a time, holding one layer's own K/V.

Segmented replay (`longstraw.replay.segments`) goes segment-major: each segment through every layer, then a reverse pass
over the segments that accumulates the gradient of the earlier segments' own keys and values. Its backward holds
every layer's own K/V and that gradient: 2 × the trajectory's own K/V. Layer-major replay goes the other way round:

1. forward, one layer at a time over the whole trajectory (`chunk` positions per layer call, in order, against the
   prompt state and the layer's own keys and values so far), keeping the hidden states entering `keep` of every
   `every` layers (`LayerMajor`) and no keys or values beyond the current layer's;
2. the policy segments' losses (`segment_loss`, on the model's last hidden states) and their gradient with respect
   to those hidden states;
3. layers last to first: the hidden states entering the layer (kept, or recomputed from the last kept one below),
   its own keys and values (or recurrent states at the chunks' boundaries: `longstraw.replay.carry.Carry` over the
   layer's chunks), then its chunks last to first, each re-run with autograd and back-propagated with the gradient the
   layer above sent to its output and the gradient later chunks sent to its own keys and values.

The gradient is that of the whole trajectory replayed at once (`PromptState.replay`, and with a detached prompt the
project's oracle `longstraw.model.oracles.cache_reference_logprobs`), as segmented replay's is; the log-probs are the
model's. Each layer is called by the unmodified decoder forward with the others handing their input on
(`longstraw.hf.decoder.run_layer`): its rotary embeddings and arguments are the decoder's own. A model whose decoder
does more between its layers than hand one layer's output to the next is refused (`check_layer_calls`, once per
model).

Memory per trajectory position: the kept hidden states, the current layer's input and its output's gradient (2
hidden states more), and one layer's own keys, values and their gradients (4 × one layer's K/V), instead of
segmented replay's 2 × every layer's K/V; plus one chunk of one layer's graph. SmolLM2-135M (30 layers, hidden 576,
3 × 64 K/V heads a layer): 2 of 3 layers' inputs kept is at most 1.18 × the trajectory's own K/V (measured 1.09 ×
from 2 to 32 agent turns, in 1.44 × the whole replay's time: docs/agents.md, "Cost"), 1 of 2 0.93 ×, 1 of 1 1.68 ×,
against 2 ×.
Work: the whole replay's forward and backward, one more forward of every layer (its autograd re-run), an attention
layer's key and value projections once more (a recurrent layer's whole layer, for its boundary states), and
1 − keep / every of a forward to recompute the hidden states not kept.

One process: context parallelism and FSDP2 replay in segments (`longstraw.replay.segments`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..branch import detach_own
from ..hf.cache import snapshot
from ..hf.decoder import run_decoder, run_layer, run_until_update
from ..prompt_state import Replay
from .carry import Carry, policy_loss, segments


@dataclass(frozen=True)
class LayerMajor:
    """How a layer-major replay runs. The hidden states entering decoder layers i with `i % every < keep` (i > 0: layer
    0's are the embeddings, made again by the decoder) are kept from the forward; the others are recomputed from the
    last kept one below (1 − keep / every of a forward more). `chunk`: positions per layer call (None: the prompt
    state's `chunk_size`); its graph is what a backward holds beyond the kept states."""

    keep: int = 2
    every: int = 3
    chunk: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.keep <= self.every:
            raise ValueError(f"LayerMajor needs 1 <= keep <= every; got keep={self.keep}, every={self.every}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"LayerMajor.chunk must be a positive number of positions or None; got {self.chunk}")

    @classmethod
    def parse(cls, text: str, chunk: int | None = None) -> LayerMajor:
        """From the form "keep/every" (the config's and command line's `keep_hidden`)."""
        try:
            keep, every = (int(x) for x in str(text).split("/"))
        except ValueError:
            raise ValueError(f"keep_hidden must read 'keep/every', e.g. '2/3'; got {text!r}") from None
        return cls(keep, every, chunk)

    def keeps(self, i: int) -> bool:
        """Whether the hidden states entering layer i are kept from the forward."""
        return i > 0 and i % self.every < self.keep

    def below(self, i: int) -> int:
        """The last layer at or below i whose input is kept (0: the embeddings)."""
        while i > 0 and not self.keeps(i):
            i -= 1
        return i


#: decoder stacks whose layer-at-a-time calls were checked against their own forward (`check_layer_calls`)
_CHECKED: weakref.WeakSet = weakref.WeakSet()


def check_layer_calls(state) -> None:
    """Once per model: the decoder run one layer at a time (`run_layer`, each layer on the one below's output) gives
    the hidden states of its own forward over a few tokens after the prompt state, to 16 × the model dtype's epsilon
    of their largest (the same operations on the same inputs; a decoder that adds or mixes anything between its layers
    is off by O(1)). Refuses the model otherwise."""
    parts = state.parts
    if parts.decoder in _CHECKED:
        return
    inputs = state.last_token.repeat(4)[None]
    positions = torch.arange(state.prompt_length - 1, state.prompt_length + 3, device=inputs.device)
    with torch.no_grad():
        whole = run_decoder(parts, inputs, positions, state.branch_cache(1))
        cache = state.branch_cache(1)
        hidden = None
        final = whole
        try:
            for i in range(len(cache.layers)):
                hidden, final = run_layer(parts, i, hidden, inputs, positions, cache)
        except (TypeError, ValueError, RuntimeError) as e:  # e.g. a decoder that threads more from layer to layer
            raise NotImplementedError(
                f"layer-major replay: {type(parts.decoder).__name__} cannot be run one layer at a time ({e}): its "
                f"decoder hands more than hidden states from one layer to the next. Replay in segments "
                f"(replay_order: segments)"
            ) from e
    eps = torch.finfo(whole.dtype).eps
    scale = float(whole.abs().max())
    err = float((final - whole).abs().max())
    if not err <= 16 * eps * max(scale, 1.0):
        raise NotImplementedError(
            f"layer-major replay: {type(parts.decoder).__name__} called one layer at a time gives hidden states "
            f"{err:.3g} off its own forward's (largest {scale:.3g}): its decoder does more between its layers than "
            f"hand one layer's output to the next. Replay in segments (replay_order: segments)"
        )
    _CHECKED.add(parts.decoder)


class _Walk:
    """One trajectory's layer calls: its inputs `[1, T]` (`[last prompt token] + response[:-1]`), positions, chunks,
    and the branch cache they run on, each layer started afresh from how the trajectory found it (`initial`)."""

    def __init__(self, state, cache, response: torch.Tensor, size: int):
        self.parts = state.parts
        self.cache = cache
        self.T = response.numel()
        self.inputs = torch.cat([state.last_token, response[:-1]])[None]
        self.start = state.prompt_length - 1
        self.chunks = [(s, min(s + size, self.T)) for s in range(0, self.T, size)]
        self.n = len(cache.layers)
        self.initial = [snapshot(layer) for layer in cache.layers]

    def begin(self, i: int) -> None:
        """Layer i of the cache as the trajectory found it (none of its own tensors)."""
        self.cache.layers[i] = snapshot(self.initial[i])

    def end(self, i: int) -> None:
        """Layer i's own tensors dropped."""
        self.cache.layers[i] = self.initial[i]

    def _at(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[:, s:e], torch.arange(self.start + s, self.start + e, device=self.inputs.device)

    def call(self, i: int, x: torch.Tensor | None, s: int, e: int) -> torch.Tensor:
        """Layer i over positions [s, e) of the trajectory, its input `x` `[1, e - s, hidden]` (None: the
        embeddings): its output, or for the last layer the decoder's (the model's last hidden states)."""
        out, final = run_layer(self.parts, i, x, *self._at(s, e), self.cache)
        return final if i == self.n - 1 else out

    def until_update(self, i: int, x: torch.Tensor | None, s: int, e: int) -> None:
        """Layer i over positions [s, e) up to its cache update: its keys and values appended, nothing else run."""
        run_until_update(self.parts, i, x, *self._at(s, e), self.cache)

    def forward(self, i: int, x: torch.Tensor | None) -> torch.Tensor:
        """Layer i over the trajectory (input `x` `[1, T, hidden]`, None: the embeddings), chunk by chunk in order,
        without autograd: `call`'s output `[1, T, hidden]`."""
        self.begin(i)
        out: torch.Tensor | None = None
        with torch.no_grad():
            for s, e in self.chunks:
                o = self.call(i, None if x is None else x[:, s:e], s, e)
                if out is None:
                    out = o.new_empty(1, self.T, o.shape[-1])
                out[:, s:e] = o
        self.end(i)
        assert out is not None
        return out

    def backward(self, i: int, x: torch.Tensor | None, grad: torch.Tensor) -> None:
        """Layer i's share of the backward: its own keys and values (or boundary states) over the trajectory into a
        carry without autograd (an attention layer's by its projections only, `until_update`), then its chunks last
        to first with autograd, each back-propagated with `grad` `[1, T, hidden]` at its positions (the gradient of
        `call`'s output) and the gradient later chunks sent to what it produced. `grad` is left holding the
        gradient of the layer's input `x` (None: the embeddings, whose gradient goes into the parameters)."""
        self.begin(i)
        cache = self.cache
        carry = Carry(cache, self.T, layers=(i,))
        projections_only = getattr(cache.layers[i], "own_from_update", False)  # (recurrent, mixer-less: none)
        with torch.no_grad():
            carried = bool(carry.appended or carry.recurrent)  # (a mixer-less layer carries nothing)
            for j, (s, e) in enumerate(self.chunks):
                carry.enter(cache, j, s)
                xc = None if x is None else x[:, s:e]
                if carried and projections_only:
                    self.until_update(i, xc, s, e)
                elif carried:
                    self.call(i, xc, s, e)
                carry.leave(cache, j, s, e, first_pass=True)
                detach_own(cache, i)
        for j in range(len(self.chunks) - 1, -1, -1):
            s, e = self.chunks[j]
            carry.enter(cache, j, s)
            with torch.enable_grad():
                xc = None if x is None else x[:, s:e].detach().requires_grad_(True)
                out = self.call(i, xc, s, e)
                pairs = carry.leave(cache, j, s, e, first_pass=False)
                # the gradients copied: backward accumulates into the same buffers (at earlier positions)
                both = [(out, grad[:, s:e]), *((t, g.to(t.dtype, copy=True)) for t, g in pairs)]
                roots, grads = [t for t, _ in both if t.requires_grad], [g for t, g in both if t.requires_grad]
                if roots:  # (nothing below a frozen layer 0 over frozen embeddings takes a gradient)
                    torch.autograd.backward(roots, grads)
            del pairs, both, roots, grads, out
            if xc is not None:  # this chunk's output gradient is spent
                grad[:, s:e] = 0.0 if xc.grad is None else xc.grad
            detach_own(cache, i)
        self.end(i)


def replay_layer_major(
    state,
    cache,
    response: torch.Tensor,
    mask: torch.Tensor,
    segment_loss: Callable[[slice, Replay], torch.Tensor | None],
    temperature: float,
    order: LayerMajor,
) -> Replay:
    """Back-propagate every policy segment's loss of trajectory `response` `[T]` (`mask` `[T]`, 1 at the policy's
    tokens) after `state` (a `PromptState` or `Branch` of one process) layer-major (see the module doc); `cache`: the
    state's branch cache for one row, which the replay runs on. `segment_loss(sl, replay)` is called once per policy
    segment, in order, with the segment's log-probs and entropies (with grad); an exact prompt's share of the gradient
    stays on the state's leaves for `PromptState.backward()`. Returns the log-probs and entropies `[T]`, detached (0 at
    environment tokens)."""
    check_layer_calls(state)
    parts = state.parts
    device = state.last_token.device
    walk = _Walk(state, cache, response, order.chunk or state.chunk_size)
    T, n = walk.T, walk.n
    kept: dict[int, torch.Tensor | None] = {}
    x: torch.Tensor | None = None
    for i in range(n):
        if order.keeps(i):
            kept[i] = x
        x = walk.forward(i, x)
    assert x is not None
    # the policy segments' losses on the last hidden states, and their gradient
    grad = torch.zeros_like(x)
    logprobs = torch.zeros(T, device=device)
    entropy = torch.zeros(T, device=device)
    for seg in segments(mask):
        if not seg.policy:
            continue
        with torch.enable_grad():
            leaf = x[:, seg.start : seg.end].detach().requires_grad_(True)
            loss = policy_loss(parts, leaf, response, seg, segment_loss, temperature, logprobs, entropy)
            if loss is not None and loss.requires_grad:
                loss.backward()
        if leaf.grad is not None:
            grad[:, seg.start : seg.end] = leaf.grad
    del x
    block: dict[int, torch.Tensor | None] = {}
    for i in range(n - 1, -1, -1):
        if i == 0:
            x = None  # the embeddings
        elif i in kept:
            x = kept.pop(i)
        elif i in block:
            x = block.pop(i)
        else:  # this layer's input, and those between it and the last kept one below, from that one
            low = order.below(i)
            x = kept.get(low)
            for j in range(low, i):
                x = walk.forward(j, x)
                block[j + 1] = x
            x = block.pop(i)
        walk.backward(i, x, grad)
    return Replay(logprobs=logprobs, entropy=entropy)
