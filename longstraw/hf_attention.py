"""The bridge to transformers: a cache of branch layers and a registered attention function.

transformers models talk to their cache through `cache.update(...)`, `update_conv_state`,
`update_recurrent_state`, and do their attention math through `ALL_ATTENTION_FUNCTIONS`. longstraw
runs the unmodified model code with a `BranchCache` (one branch layer per decoder layer, each reading
the durable prompt state) and the attention implementation "longstraw", registered through
`AttentionInterface.register` together with a mask function under the same name (transformers 5.24
needs both; without the mask function the attention would get `mask=None` from the sdpa path).

The longstraw attention reads its prompt part from the branch layer of `module.layer_idx`, found in
the `longstraw_cache` keyword that capture and replay pass down the model's `**kwargs`.
"""

from __future__ import annotations

from contextlib import contextmanager

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
    own_start = layer.prompt_length
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
def attention_overrides(decoder, cache: BranchCache):
    """Swap in the attention module a branch layer asks for (`attention_module`, e.g. latent attention for
    MLA layers, whose transformers module would expand the prompt per head) for the block; the model's
    own module is the stand-in's child, so its parameters and adapters are the ones used."""
    blocks = getattr(decoder, "layers", None)
    swapped = []
    try:
        for i, layer in enumerate(cache.layers):
            cls = getattr(layer, "attention_module", None)
            if cls is not None:
                block = blocks[i]
                inner = block.self_attn
                block.self_attn = cls(inner)
                swapped.append((block, inner))
        yield
    finally:
        for block, inner in swapped:
            block.self_attn = inner


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
