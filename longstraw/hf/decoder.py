"""The unmodified decoder run against a branch cache: what capture, replay and sampling all call."""

from __future__ import annotations

import torch

from .cache import BranchCache, OneLayer, UpdateDone, running
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


def run_layer(
    parts: ModelParts,
    index: int,
    hidden: torch.Tensor | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: BranchCache,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder layer `index` alone over one stretch of positions, called by the unmodified decoder forward as it calls
    it (its rotary embeddings, masks and keyword arguments the decoder's own): `(the layer's output, the decoder's
    output)`, both `[B, T, hidden]`. The layer reads `hidden` (None: what the decoder hands it, the embeddings of
    `input_ids` for layer 0) and `cache.layers[index]`; every other layer hands its input on unchanged and touches no
    cache. The decoder's output is the final norm of the layer's: the model's last hidden states when `index` is the
    last layer. Cost: the layer, and the decoder's embedding, rotary embeddings and final norm over `input_ids`."""
    cache.one_layer = one = OneLayer(index, hidden)
    try:
        final = run_decoder(parts, input_ids, positions, cache)
    finally:
        cache.one_layer = None
    if one.output is None:
        raise RuntimeError(f"decoder layer {index} did not run: the decoder skipped it")
    out = one.output[0] if isinstance(one.output, tuple) else one.output
    return out, final


def run_until_update(
    parts: ModelParts,
    index: int,
    hidden: torch.Tensor | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: BranchCache,
) -> None:
    """`run_layer` up to the layer's cache `update`: its keys and values over the positions appended to
    `cache.layers[index]`, nothing of its attention or feed-forward run (for a layer whose own tensors are all
    appended there, `BranchLayer.own_from_update`). Cost: the layer's norm and projections."""
    cache.stop_after_update = True
    try:
        run_layer(parts, index, hidden, input_ids, positions, cache)
    except UpdateDone:
        return
    finally:
        cache.stop_after_update = False
    raise RuntimeError(f"decoder layer {index} did not hand its keys and values to the cache")
