"""gpt-oss: attention sinks (a learned per-head logit in the softmax denominator), sliding + full layers, MoE."""

from .base import Family, register

# no SDPA path in transformers 5.24 (sinks): the tiny model is built with eager attention
register(
    Family(
        "gpt_oss",
        "sliding-window + full attention with attention sinks, MoE",
        moe=True,
        attn_implementation="eager",
        tiny=dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"], intermediate_size=32),
    )
)
