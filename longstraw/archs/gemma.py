"""Gemma 1-4: embedding scaling, attention and final-logit softcapping (Gemma 2), sliding + global layers."""

from .base import Family, register

register(
    Family("gemma", "dense, full attention"),
    # Gemma 2 has no SDPA path in transformers 5.24 (softcapping): the tiny model is built with eager attention
    Family(
        "gemma2",
        "sliding-window + global attention, attention and final-logit softcapping",
        attn_implementation="eager",
        tiny=dict(
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
    ),
    Family(
        "gemma3_text",
        "sliding-window + global attention",
        tiny=dict(
            num_hidden_layers=3,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
        ),
        wrapper=(
            "gemma3",
            dict(
                vision_config=dict(
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=28,
                    patch_size=14,
                ),
                mm_tokens_per_image=4,
            ),
        ),
    ),
    Family(
        "gemma4_text",
        "sliding-window + global attention (wider global heads), per-layer inputs, softcapping",
        tiny=dict(
            num_hidden_layers=3,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            global_head_dim=32,
            num_global_key_value_heads=1,
            vocab_size_per_layer_input=256,
            hidden_size_per_layer_input=8,
            final_logit_softcapping=3.0,
            num_kv_shared_layers=0,
        ),
    ),
)
