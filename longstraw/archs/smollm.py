"""SmolLM 3: NoPE every few layers."""

from .base import Family, register

register(
    Family(
        "smollm3", "dense, full attention with NoPE layers", tiny=dict(num_hidden_layers=3, no_rope_layer_interval=2)
    )
)
