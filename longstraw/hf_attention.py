"""The bridge to transformers: a cache of branch layers and a registered attention function.

transformers models talk to their cache through `cache.update(...)`, `update_conv_state`,
`update_recurrent_state`, and do their attention math through `ALL_ATTENTION_FUNCTIONS`. longstraw
runs the unmodified model code with a `BranchCache` (one branch layer per decoder layer, each reading
the durable prompt state) and the attention implementation "longstraw", registered through
`AttentionInterface.register` together with a mask function under the same name (transformers 5.24
needs both; without the mask function the attention would get `mask=None` from the sdpa path).

The longstraw attention reads its prompt part from the branch layer of `module.layer_idx`, found in
the `longstraw_cache` keyword that capture and replay pass down the model's `**kwargs`.

Two stand-in modules cover what the attention registry cannot:
- `attention_overrides`: a branch layer may name an `attention_module` that stands in for the
  layer's attention module for the call (MLA: transformers expands the cached latents per head before
  calling the attention function; `longstraw.layers.latent_attention.LatentAttention` attends in latent
  space instead). The original module is the stand-in's child and is put back afterwards.
- `checkpointed_layers`: each decoder layer under activation checkpointing, recomputed in backward
  against a snapshot of its branch layer (`CheckpointedDecoderLayer`); it also stands in for
  transformers' own activation checkpointing, which would drop the cache (`hf_checkpointing_suspended`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface

from .attention import DEFAULT_BLOCK, split_attention

ATTN_IMPLEMENTATION = "longstraw"


class BranchCache(Cache):
    """transformers `Cache` over one branch's layers (`LayerState.branch()` of every decoder layer).

    `block`: key block size of the split attention (memory O(heads · R · block) per block).
    """

    def __init__(self, layers: list, block: int = DEFAULT_BLOCK):
        super().__init__(layers=layers)
        self.block = block

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        """Always None, so that linear-attention layers take their functional conv path
        (`update_conv_state` returns [previous window | new inputs]; the branch layer keeps its window).
        Given a conv state, single-token steps update it in place (Kimi's KDA does regardless of
        `is_recording_past`, transformers 5.24), which would write the shared captured state."""
        return None

    def batch_select_indices(self, indices) -> None:
        """Keep the branch rows `indices` in every layer (finished sequences leave the batch)."""
        for layer in self.layers:
            layer.batch_select_indices(indices)


def longstraw_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    longstraw_cache: BranchCache | None = None,
    **kwargs,
):
    """Attention of a branch's queries `[B, H, R, D]` over [prompt K/V | its own K/V]: `[B, R, H, Dv]`."""
    if longstraw_cache is None:
        raise RuntimeError(
            "the 'longstraw' attention implementation only runs inside longstraw.capture / PromptState.replay"
        )
    if dropout:
        raise NotImplementedError("attention dropout is not supported by longstraw replay; set attention_dropout=0")
    layer = longstraw_cache.layers[module.layer_idx]
    if sliding_window is not None and layer.window != sliding_window:
        raise RuntimeError(
            f"layer {module.layer_idx}: the model uses a sliding window of {sliding_window} but the captured state "
            f"was built for {layer.window}; check config.layer_types"
        )
    # `key` is what the branch layer's update returned: the last key.shape[-2] of its own keys so far
    own_start = layer.prompt_length + layer.own_length - key.shape[-2]
    out = split_attention(
        query,
        key,
        value,
        layer.prompt_k,
        layer.prompt_v,
        q_start=own_start + key.shape[-2] - query.shape[-2],
        own_start=own_start,
        prompt_start=layer.prompt_start,
        scale=scaling,
        window=layer.window,
        softcap=softcap,
        block=longstraw_cache.block,
    )
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs):
    """longstraw attention builds its masks from positions, blockwise; transformers need not build one."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, longstraw_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)


@contextmanager
def attention_overrides(decoder, cache: BranchCache, only: int | None = None):
    """Swap in the attention module a branch layer asks for (`attention_module`, e.g. latent attention for
    MLA layers, whose transformers module would expand the prompt per head) for the block; the model's
    own module is the stand-in's child, so its parameters and adapters are the ones used. `only`: just
    that layer."""
    swapped = []
    try:
        for i, layer in enumerate(cache.layers):
            cls = getattr(layer, "attention_module", None)
            if cls is not None and only in (None, i):
                block = decoder.layers[i]
                inner = block.self_attn
                block.self_attn = cls(inner)
                swapped.append((block, inner))
        yield
    finally:
        for block, inner in swapped:
            block.self_attn = inner


@contextmanager
def hf_checkpointing_suspended(module):
    """Suspend transformers' own activation checkpointing (`activation_checkpointing_enable`) in `module` for the
    block; yields whether any layer had it on. transformers drops the cache of a layer it checkpoints
    (`cache=None`, `GradientCheckpointingLayer`, 5.24), which would start linear-attention layers from a
    zero state and lose the branch's own K/V: longstraw checkpoints with `CheckpointedDecoderLayer` instead."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield bool(layers)
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def _snapshot(layer):
    """A copy of a branch layer that later appends do not change (branch layers rebind their tensors
    and never write them in place, so copying the attribute dicts is enough)."""
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, dict):
            setattr(new, name, dict(value))
    return new


class CheckpointedDecoderLayer(nn.Module):
    """Stands in for decoder layer `index` during a replay: runs it under (non-reentrant) activation
    checkpointing, so the replay graph keeps only each layer's inputs and recomputes the layer in
    backward. The branch cache layer is stateful (the forward appended the branch's K/V or latents, or
    advanced its recurrent state); the recomputation runs against a snapshot taken before the forward,
    so it sees exactly what the forward saw and leaves the branch as the forward left it.

    Memory of a replay: O(layers · R · hidden) saved inputs plus one layer's graph, instead of every
    layer's graph (attention projections, MoE expert activations, ...). Time: one more forward per layer.
    """

    def __init__(self, inner: nn.Module, cache: BranchCache, index: int, run_context):
        """`run_context()`: a context manager restoring, for the recomputation in backward (outside
        `run_decoder`), what this layer's forward ran under (attention implementation, stand-in modules)."""
        super().__init__()
        self.inner = inner
        self.cache, self.index = cache, index
        self.run_context = run_context

    def forward(self, *args, **kwargs):
        before = _snapshot(self.cache.layers[self.index])

        @contextmanager
        def recompute():
            after = self.cache.layers[self.index]
            self.cache.layers[self.index] = _snapshot(before)
            try:
                with self.run_context(), hf_checkpointing_suspended(self.inner):
                    yield
            finally:
                self.cache.layers[self.index] = after

        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=lambda: (nullcontext(), recompute()),
                          **kwargs)


@contextmanager
def checkpointed_layers(model, decoder, cache: BranchCache, enabled: bool = True):
    """Run every decoder layer of `decoder` (of `model`) under `CheckpointedDecoderLayer` for the block
    (no-op when not `enabled`)."""
    if not enabled:
        yield
        return
    @contextmanager
    def run_context(i: int):
        with longstraw_attention_enabled(model), attention_overrides(decoder, cache, only=i):
            yield

    blocks = decoder.layers
    inner = list(blocks)
    try:
        for i, block in enumerate(inner):
            blocks[i] = CheckpointedDecoderLayer(block, cache, i, partial(run_context, i))
        yield
    finally:
        for i, block in enumerate(inner):
            blocks[i] = block


@contextmanager
def longstraw_attention_enabled(model):
    """Switch `model` (a transformers PreTrainedModel) to the longstraw attention for the block."""
    previous = model.config._attn_implementation
    if previous == ATTN_IMPLEMENTATION:
        yield
        return
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
