"""Qwen2, Qwen3 (dense and MoE), Qwen3-Next and Qwen3.5 (gated DeltaNet hybrids)."""

from .base import Family, register

_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
)
_HYBRID = "gated DeltaNet + full attention"

register(
    # sliding window on the layers from `max_window_layers` on (`use_sliding_window`)
    Family(
        "qwen2",
        "dense, full attention with QKV bias; optional sliding window on upper layers",
        tiny=dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    Family("qwen2_moe", "full attention, MoE with a shared expert", moe=True),
    Family("qwen3", "dense, full attention with QK-norm (GQA)"),
    Family("qwen3_moe", "full attention with QK-norm, MoE", moe=True),
    Family("qwen3_next", _HYBRID + ", MoE", moe=True, tiny=dict(_LINEAR, decoder_sparse_step=1)),
    Family(
        "qwen3_5_text",
        _HYBRID,
        tiny=_LINEAR,
        wrapper=(
            "qwen3_5",
            dict(vision_config=dict(hidden_size=16, intermediate_size=32, depth=1, num_heads=2, out_hidden_size=64)),
        ),
    ),
    Family("qwen3_5_moe_text", _HYBRID + ", MoE", moe=True, tiny=_LINEAR),
)
