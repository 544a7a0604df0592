"""OLMo 2, OLMo 3 and OLMoE: QK-norm over the whole projection, norms after the blocks."""

from .base import Family, register

register(
    Family("olmo2", "dense, full attention, QK-norm, post-norm"),
    Family(
        "olmo3",
        "dense, sliding-window + full attention, QK-norm",
        tiny=dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    ),
    Family("olmoe", "full attention, QK-norm, MoE", moe=True, tiny=dict(intermediate_size=32)),
)
