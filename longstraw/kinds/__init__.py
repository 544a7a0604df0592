"""Layer kinds: one module per kind of durable state (see `base.LayerState`)."""

from .base import (
    BranchLayer,
    CollectiveAttention,
    CollectiveSparseAttention,
    LatentBranch,
    LayerState,
    PromptBranchLayer,
    branch_layers,
    layer_kind,
    register_layer_kind,
    registered_layer_types,
    state_bytes,
)
from .compressed_attention import CompressedAttention, CompressedBranchLayer, CompressedKVState
from .full_attention import AttentionBranchLayer, KVState
from .hybrid import HybridBranchLayer, HybridState
from .latent_attention import IndexedLatentState, LatentAttention, LatentBranchLayer, LatentState
from .linear_attention import RecurrentBranchLayer, RecurrentState
from .mixerless import MixerlessBranchLayer, MixerlessState
from .short_conv import ShortConvState
from .sliding_window import ChunkedKVState, SlidingKVState

__all__ = [
    "AttentionBranchLayer",
    "BranchLayer",
    "ChunkedKVState",
    "CollectiveAttention",
    "CollectiveSparseAttention",
    "CompressedAttention",
    "CompressedBranchLayer",
    "CompressedKVState",
    "HybridBranchLayer",
    "HybridState",
    "IndexedLatentState",
    "KVState",
    "LatentAttention",
    "LatentBranch",
    "LatentBranchLayer",
    "LatentState",
    "LayerState",
    "MixerlessBranchLayer",
    "MixerlessState",
    "PromptBranchLayer",
    "RecurrentBranchLayer",
    "RecurrentState",
    "ShortConvState",
    "SlidingKVState",
    "branch_layers",
    "layer_kind",
    "register_layer_kind",
    "registered_layer_types",
    "state_bytes",
]
