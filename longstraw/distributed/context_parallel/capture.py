"""The collective capture of a prompt over a process group, in three steps that `longstraw.capture` (`longstraw.api`,
the one place a capture's arguments are validated) calls around its own checks: `agree` (every rank brings the same
arguments, before anything can fail differently on one rank), `check_served` (what the context-parallel capture
serves so far) and `capture` (each rank's slice through the decoder, the slices' attention collective)."""

from __future__ import annotations

from typing import cast

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ...hf.cache import BranchCache
from ...hf.parts import ModelParts, base_model
from ...kinds import LayerState, layer_kind
from ...model.capability import layer_states
from ...ops import quant
from ...ops.attention import DEFAULT_BLOCK
from ...ops.quant import QUANT_BLOCK
from ...prompt_state import first_trainable_layer, run_decoder
from ..collectives import Group, digest
from ..expert_parallel import spreads_experts
from .kinds import KINDS, SERVED, CollectiveKind
from .slices import slice_bounds
from .state import ContextParallelState


def agree(group, model, prompt_ids, chunk_size, prompt_grad, block_size, verify, state_dtype, state_device) -> Group:
    """The `Group` of `group` (a `torch.distributed` process group; the default group for
    `torch.distributed.group.WORLD`), once the capture's arguments are compared across its ranks (one small all-gather
    of hashes): a mismatch is refused on every rank with the same `MismatchError`. Invalid arguments pass here alike on
    every rank and are refused by the validation that follows."""
    g = Group(group)
    raw: torch.Tensor | str
    try:
        raw = torch.as_tensor(prompt_ids).detach()
        length = raw.numel()
    except Exception:  # noqa: BLE001 - invalid input is refused by the validation, on every rank alike
        raw, length = repr(prompt_ids), -1
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    g.agree(
        "longstraw.capture",
        {
            "prompt length": length,
            "prompt_ids": raw,
            "chunk_size": chunk_size if chunk_size is None or isinstance(chunk_size, int) else repr(chunk_size),
            "prompt_grad": prompt_grad,
            "block_size": block_size if isinstance(block_size, int) else repr(block_size),
            "verify": verify,
            "state_dtype": str(state_dtype),
            "state_device": str(state_device),
            "model config": base_model(model).config.to_json_string(use_diff=False),
            "trainable parameters": trainable,
        },
    )
    return g


def check_served(g: Group, parts: ModelParts, prompt: torch.Tensor, prompt_grad: str, compressed, state_device) -> None:
    """What the context-parallel capture refuses so far, before the model is prepared or self-checked: a state
    device, layer kinds outside `SERVED`, exact mode on a kind without its reverse pass, and a prompt too short to
    give every rank a slice (of whole 8-bit blocks with a quantized state)."""
    if state_device is not None:
        raise NotImplementedError(
            "context-parallel capture (group=...) keeps the state on the model's device so far; "
            "state_device is not supported with group="
        )
    kinds = {layer_kind(kind) for kind in parts.plan}
    if kinds - SERVED:
        other = sorted(k.__name__ for k in kinds - SERVED)
        raise NotImplementedError(
            f"context-parallel capture (group=...) serves {sorted(k.__name__ for k in SERVED)} "
            f"so far; {parts.config.model_type!r} also has layer kinds {other}"
        )
    captured = prompt.numel() - 1
    align = QUANT_BLOCK if compressed is not None else 1  # a quantized state's slices start on block boundaries
    if captured < g.size * align:
        raise ValueError(
            f"a prompt of {prompt.numel()} tokens ({captured} captured) cannot give each of the {g.size} "
            f"ranks a slice{f' of whole 8-bit blocks of {align} positions' if align > 1 else ''}; "
            "use fewer ranks or capture without group="
        )


def capture(
    g: Group,
    parts: ModelParts,
    prompt: torch.Tensor,
    compressed,
    chunk_size: int,
    prompt_grad: str,
    block_size: int = DEFAULT_BLOCK,
) -> ContextParallelState:
    """This rank's share of the collective capture of `prompt` (validated, the model prepared and checked, the same
    on every rank): its slice runs through the decoder in one forward, `chunk_size` keys exchanged per all-gather step
    (see `longstraw.distributed`); the state of its slice (full attention, MLA, DSA) or the replicated O(1) state
    (sliding windows, linear attention)."""
    device = prompt.device
    captured = prompt.numel() - 1
    align = QUANT_BLOCK if compressed is not None else 1
    bounds = slice_bounds(captured, g.size, align)
    s, e = bounds[g.rank]
    if compressed is not None:
        quant.check_device(compressed, device)
    layers: list[LayerState] = []
    kinds: list[CollectiveKind] = []
    branches: list[CacheLayerMixin | LinearAttentionCacheLayerMixin] = []
    for i, whole in enumerate(layer_states(parts.config, captured, parts.plan)):
        kind = KINDS[type(whole)]  # served (`check_served`)
        layer = kind.slice_state(whole, parts.config, i, s, e, compressed)
        layers.append(layer)
        kinds.append(kind)
        branches.append(kind.capture_branch(layer, g, bounds, i, chunk_size))
    cache = BranchCache(branches, block=block_size)
    # chunked layers (recurrent) read nothing of the other ranks but the relayed state: they run chunk_size positions
    # at a time, so their intermediates are a chunk's, not the slice's (attention layers need the slice whole, but not
    # their feed-forward modules)
    # (the ignores: `BranchCache.__init__`, longstraw/hf/cache.py, sets both to None without an annotation)
    cache.layer_chunks = (
        chunk_size,  # type: ignore[assignment]
        {i for i, kind in enumerate(kinds) if kind.chunked},
    )
    cache.ffn_chunk = chunk_size  # type: ignore[assignment]  # and every layer's feed-forward module (position-wise)
    if spreads_experts(parts.decoder):
        # each call of an MoE block is a collective (`longstraw.distributed.expert_parallel`): every rank makes as
        # many as the longest slice needs, the shorter slices' last ones empty
        cache.ffn_calls = max(-(-(b - a) // chunk_size) for a, b in bounds)  # type: ignore[assignment]
    hooks = []
    for i, (layer, kind) in enumerate(zip(layers, kinds)):
        relay = kind.capture_relay(layer, g, cache, i, device)
        if relay is not None:
            block = cast(torch.nn.ModuleList, parts.decoder.layers)[i]
            hooks += [block.register_forward_pre_hook(relay.before), block.register_forward_hook(relay.after)]
    try:
        with torch.no_grad():
            run_decoder(parts, prompt[None, s:e], torch.arange(s, e, device=device), cache)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, (layer, kind, branch) in enumerate(zip(layers, kinds, cache.layers)):
            kind.finish_capture(layer, branch, g, bounds, captured, i)
    del cache
    key = digest(prompt, chunk_size, block_size, prompt_grad, g.size)
    state = ContextParallelState(
        parts,
        layers,
        prompt[-1:].clone(),
        prompt.numel(),
        chunk_size,
        prompt_grad,
        block_size,
        group=g,
        bounds=bounds,
        key=key,
    )
    if prompt_grad == "exact":
        state._prompt = prompt[:captured]
        for layer in layers[first_trainable_layer(parts) :]:
            layer.require_grad()
    return state
