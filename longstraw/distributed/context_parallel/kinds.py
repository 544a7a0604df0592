"""Which layer kinds the context-parallel capture serves, and how each takes part: one `CollectiveKind` per served
state class, written beside its branch layers (`full_attention`, `latent_attention`, `sliding_window`,
`linear_attention`) and registered here by class. The capture, the replay, the sampling and the exact-mode reverse
pass (`capture.py`, `state.py`) ask a layer's kind what to do; none of them names a kind."""

from __future__ import annotations

from typing import Protocol

from ...kinds.base import LayerState
from ...kinds.full_attention import KVState
from ...kinds.latent_attention import IndexedLatentState, LatentState
from ...kinds.linear_attention import RecurrentState
from ...kinds.sliding_window import SlidingKVState
from ..collectives import Group
from .full_attention import CaptureBranchLayer, ReplayBranchLayer, SampleBranchLayer, SlicedKind, SliceKVState
from .latent_attention import (
    DsaCaptureBranchLayer,
    DsaReplayBranchLayer,
    DsaSampleBranchLayer,
    LatentCaptureBranchLayer,
    LatentReplayBranchLayer,
    LatentSampleBranchLayer,
    SliceIndexedLatentState,
    SliceLatentState,
)
from .linear_attention import RecurrentKind
from .sliding_window import WindowKind


class CollectiveKind(Protocol):
    """How one layer kind takes part in context parallelism. `bounds`: every rank's slice `(start, end)` of the
    captured positions; `i`: the layer's index; `g`: the group. Methods marked collective run on every rank alike."""

    #: whether the layer runs its slice chunk by chunk (only a relayed state crosses the ranks)
    chunked: bool
    #: whether the durable state is this rank's slice of the positions (else replicated alike on every rank)
    sliced: bool

    def slice_state(self, layer: LayerState, config, i: int, s: int, e: int, compressed) -> LayerState:
        """The state this rank keeps for `layer` (of the whole prompt) when its slice is `[s, e)`."""

    def capture_branch(self, state: LayerState, g: Group, bounds, i: int, chunk: int):
        """The cache layer the slice's forward runs against (the capture's, and the exact-mode recomputation's)."""

    def capture_relay(self, state: LayerState, g: Group, cache, i: int, device):
        """An object whose `before` / `after` are put on the decoder layer as forward hooks during capture, or None."""

    def finish_capture(self, state: LayerState, branch, g: Group, bounds, captured: int, i: int) -> None:
        """Fold the slice's forward into `state` (collective)."""

    #: whether a replay's layer takes a batch of responses per rank (`replay_branch`'s `batch`)
    batches_replays: bool

    def replay_branch(self, state: LayerState, g: Group, lengths: list[int], start: int, grown, batch: int = 1):
        """A replay's layer for `batch` responses per rank (`lengths`: every rank's widest), after a branch's layer
        `grown` (already `batch` rows) or None."""

    def sample_branch(self, state: LayerState, g: Group, start: int, batch: int):
        """A decode's layer for `batch` rows."""

    def reverse_gradient(self, state: LayerState, g: Group, i: int):
        """Exact mode, before the recomputation: the replays' gradient of a replicated state summed over the ranks
        (collective), or None."""

    def reverse_relay(self, state: LayerState, g: Group, cache, i: int, device, gathered):
        """Exact mode: the recomputation's hook object (as `capture_relay`), or None."""

    def reverse_roots(self, state: LayerState, branch, gathered, s: int, e: int, prompt_length: int) -> list:
        """Exact mode: (recomputed output, its gradient) pairs to back-propagate from this rank's slice."""


#: the served state classes (exact classes: a subclass, e.g. `ShortConvState`, is refused by name) and their kinds
KINDS: dict[type[LayerState], CollectiveKind] = {
    KVState: SlicedKind(SliceKVState, CaptureBranchLayer, ReplayBranchLayer, SampleBranchLayer),
    LatentState: SlicedKind(
        SliceLatentState, LatentCaptureBranchLayer, LatentReplayBranchLayer, LatentSampleBranchLayer
    ),
    IndexedLatentState: SlicedKind(
        SliceIndexedLatentState, DsaCaptureBranchLayer, DsaReplayBranchLayer, DsaSampleBranchLayer, batched=False
    ),
    SlidingKVState: WindowKind(),
    RecurrentState: RecurrentKind(),
}
#: the state classes the context-parallel capture serves
SERVED = frozenset(KINDS)
#: the slice state classes (what a rank keeps in place of a served state that grows with P), to their kinds
SLICES: dict[type[LayerState], CollectiveKind] = {k.slice_class: k for k in KINDS.values() if isinstance(k, SlicedKind)}


def kind_of(state: LayerState) -> CollectiveKind:
    """The `CollectiveKind` of a layer's state as the capture built it: a served state, or a slice of one."""
    return SLICES[type(state)] if type(state) in SLICES else KINDS[type(state)]
