"""Which layer kinds the context-parallel capture serves, and the branch layers that read each sliced kind."""

from __future__ import annotations

from ...kinds.full_attention import KVState
from ...kinds.latent_attention import IndexedLatentState, LatentState
from ...kinds.linear_attention import RecurrentState
from ...kinds.sliding_window import SlidingKVState
from ..collectives import Group
from .full_attention import CaptureBranchLayer, ReplayBranchLayer, ReplayInfo, SampleBranchLayer, SliceKVState
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

#: layer kinds the context-parallel capture serves: full attention (sliced), sliding window and linear attention
#: (replicated O(1) states)
SERVED = frozenset({KVState, LatentState, IndexedLatentState, SlidingKVState, RecurrentState})


#: layer kinds whose state is sliced by position (the others are replicated): the slice's state kind, per kind
SLICED = {KVState: SliceKVState, LatentState: SliceLatentState, IndexedLatentState: SliceIndexedLatentState}


#: the branch layers (capture, replay, sampling) that read each kind of sliced state
BRANCH_KINDS = {
    SliceKVState: (CaptureBranchLayer, ReplayBranchLayer, SampleBranchLayer),
    SliceLatentState: (LatentCaptureBranchLayer, LatentReplayBranchLayer, LatentSampleBranchLayer),
    SliceIndexedLatentState: (DsaCaptureBranchLayer, DsaReplayBranchLayer, DsaSampleBranchLayer),
}


def capture_branch(layer, group: Group, bounds, layer_idx: int, chunk: int) -> CaptureBranchLayer:
    return BRANCH_KINDS[type(layer)][0](group, bounds, layer_idx, chunk)


def replay_branch(layer, info: ReplayInfo, start: int):
    return BRANCH_KINDS[type(layer)][1](info, start)


def sample_branch(layer, group: Group, start: int):
    return BRANCH_KINDS[type(layer)][2](group, layer, start)
