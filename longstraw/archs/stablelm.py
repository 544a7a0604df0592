"""StableLM: partial rotary, per-head QK LayerNorm, parallel residual."""

from .base import Family, register

register(
    Family(
        "stablelm",
        "dense, partial rotary, QK-norm, parallel residual",
        tiny=dict(partial_rotary_factor=0.5, qk_layernorm=True, use_parallel_residual=True),
    )
)
