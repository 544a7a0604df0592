"""Llama and Llama 4 (text)."""

from .base import Family, register

register(
    Family("llama", "dense, full attention (GQA)"),
    # Llama 4: chunked local attention (a layer reads only the keys of its current attention chunk) on
    # the RoPE layers, NoPE global layers every 4th (`no_rope_layers`), MoE every other layer.
    Family(
        "llama4_text",
        "chunked local attention + NoPE global attention, MoE",
        tiny=dict(
            num_hidden_layers=4,
            attention_chunk_size=4,
            no_rope_layers=[1, 1, 1, 0],
            layer_types=["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"],
            interleave_moe_layer_step=2,
            intermediate_size_mlp=128,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size=32,
            use_qk_norm=True,
            attn_temperature_tuning=True,
            floor_scale=4,
            attn_scale=0.1,
        ),
    ),
)
