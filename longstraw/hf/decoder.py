"""The unmodified decoder run against a branch cache: what capture, replay and sampling all call."""

from __future__ import annotations

import torch

from .cache import BranchCache, running
from .parts import ModelParts


def run_decoder(
    parts: ModelParts,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: BranchCache,
    checkpoint_layers: bool = False,
):
    """Hidden states `[B, T, hidden]` of the unmodified decoder (of a prepared model) over `input_ids` `[B, T]`
    (positions `[T]`, shared by the B rows, or `[B, T]`: a ragged decode batch's, `longstraw.ragged`) against
    `cache`; `checkpoint_layers`: recompute each decoder layer in backward instead of keeping its graph
    (`longstraw.model.prepare.CheckpointedLayer`), which also stands in for transformers' own activation
    checkpointing when the model has it on in training mode."""
    cache.checkpoint_layers = checkpoint_layers
    cache.configs = parts.configs
    cache.past_length = int(positions.reshape(-1)[0])
    position_ids = positions if positions.dim() == 2 else positions[None]
    with running(cache, parts.configs), cache.inplace_safe():
        out = parts.decoder(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
    return out.last_hidden_state
