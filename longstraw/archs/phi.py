"""Phi-3 and Phi-3.5-MoE: fused QKV, partial rotary (Phi-3), sliding window from `config.sliding_window`."""

from .base import Family, register

register(
    Family(
        "phi3", "dense, fused QKV, sliding-window attention", tiny=dict(sliding_window=5, partial_rotary_factor=0.5)
    ),
    Family("phimoe", "sliding-window attention, MoE", moe=True, tiny=dict(sliding_window=5)),
)
