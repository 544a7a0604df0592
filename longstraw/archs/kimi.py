"""Kimi Linear: Kimi delta attention (linear) + NoPE MLA, MoE."""

from .base import Family, register
from .mla import LATENT, MLA

register(
    Family(
        "kimi_linear",
        "Kimi delta attention + NoPE MLA, MoE",
        layer_kinds=LATENT,
        latent_rotary=lambda m: (None, None),
        tiny=dict(
            MLA,
            q_lora_rank=None,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            num_expert_group=1,
            pad_token_id=None,
            bos_token_id=1,
            eos_token_id=2,
        ),
    )
)
