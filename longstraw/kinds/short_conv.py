"""Short convolution (LFM2's gated `conv` layers): the durable state is the last kernel − 1 inputs.

A causal depthwise convolution of kernel K reads, for the next token, the K − 1 inputs before it and
the token itself: nothing older. transformers 5.24 keeps K inputs in its cache (`conv_L_cache`); the
state here keeps K − 1 (`[1, channels, K − 1]`), O(1) in P. The branch layer is the linear-attention
one (`RecurrentBranchLayer`): it rebinds its window instead of writing the captured one in place.
"""

from __future__ import annotations

from .base import register_layer_kind
from .linear_attention import RecurrentState


@register_layer_kind
class ShortConvState(RecurrentState):
    """Conv window of a short-convolution layer: its last kernel − 1 inputs (no recurrent state)."""

    layer_types = ("conv",)
    conv_trim = 1

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """The last K − 1 inputs (`conv_L_cache` = K)."""
        return 0 if tokens == 0 else elem * config.hidden_size * (config.conv_L_cache - 1)

    @classmethod
    def recurrence_bytes(cls, config) -> int:
        return 0  # a convolution window, no chunked recurrence
