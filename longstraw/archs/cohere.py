"""Cohere (Command R) and Cohere 2: output logit scaling (`logit_scale`), parallel attention + MLP blocks."""

from .base import Family, register

register(
    Family(
        "cohere",
        "dense, parallel attention + MLP, QK-norm, logit scaling",
        tiny=dict(logit_scale=0.5, use_qk_norm=True),
    ),
    Family(
        "cohere2",
        "sliding-window + NoPE global attention, parallel blocks, logit scaling",
        tiny=dict(logit_scale=0.5, sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    ),
)
