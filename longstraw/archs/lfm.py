"""LFM2 (dense and MoE): gated short convolutions + full attention.

A `conv` layer's only state is its causal-conv window: the last `conv_L_cache` − 1 inputs (transformers
5.24 keeps `conv_L_cache` of them, the oldest of which the next token no longer reads).
"""

from .base import Family, register

_LAYERS = ["conv", "full_attention", "conv"]

register(
    Family(
        "lfm2",
        "gated short convolution + full attention",
        tiny=dict(num_hidden_layers=3, layer_types=_LAYERS, conv_L_cache=3, block_auto_adjust_ff_dim=False),
    ),
    Family(
        "lfm2_moe",
        "gated short convolution + full attention, MoE",
        moe=True,
        tiny=dict(num_hidden_layers=3, layer_types=_LAYERS, conv_L_cache=3, num_dense_layers=1),
    ),
)
