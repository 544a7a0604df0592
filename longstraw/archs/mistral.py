"""Mistral, Ministral, Ministral 3 and Mixtral: the sliding window comes from `config.sliding_window`
(Mistral, Mixtral, Ministral 3 have no `layer_types`: every layer slides when it is set)."""

from .base import Family, register

register(
    Family("mistral", "dense, sliding-window attention on every layer (`sliding_window`)", tiny=dict(sliding_window=5)),
    Family(
        "ministral",
        "dense, sliding-window and full attention (`layer_types`)",
        tiny=dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    ),
    Family("ministral3", "dense, sliding-window attention, YaRN RoPE", tiny=dict(sliding_window=5)),
    Family("mixtral", "sliding-window attention, MoE", moe=True, tiny=dict(sliding_window=5)),
)
