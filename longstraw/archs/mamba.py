"""Mamba hybrids: Nemotron-H, Granite 4 (granitemoehybrid), Falcon-H1, Bamba, Zamba2 (Mamba-2), Jamba (Mamba-1).

Their SSM layers talk to the cache as gated DeltaNet does (transformers 5.24: `update_conv_state`,
`update_recurrent_state`), so they keep the linear-attention kind's durable state: the causal-conv
window and the SSM state, O(1) in P. Nemotron-H's `moe` / `mlp` layers have no token mixer and keep
nothing; Falcon-H1's `hybrid` layers run attention and an SSM side by side (both states); Zamba2's
`hybrid` layers run a shared attention block before their own SSM (both states, one layer index).

Jamba's Mamba mixer (transformers 5.24, `JambaMambaMixer`) runs a multi-token forward without the cached
SSM state (`mamba_selective_scan` takes no initial state): inside transformers a chunked prefill restarts
the scan from zero. Inside longstraw `longstraw.kinds.jamba.JambaMixer` continues it from the state.
"""

from ..kinds.jamba import JambaMixer
from .base import Family, register

#: a small Mamba-2 mixer: 4 heads of 16 (or 32), state 8, conv 4, SSD chunks of 8 (so the tests' prompts
#: span several SSD chunks inside one capture chunk)
_SSM = "Mamba-2 (SSD)"


register(
    Family(
        "nemotron_h",
        f"{_SSM} + full attention, MoE and MLP layers without a token mixer",
        moe=True,
        tiny=dict(
            num_hidden_layers=4,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            n_routed_experts=4,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
            n_group=1,
            topk_group=1,
        ),
    ),
    Family(
        "granitemoehybrid",
        f"{_SSM} + full attention, MoE, scaled logits",
        moe=True,
        tiny=dict(
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=8,
            shared_intermediate_size=32,
        ),
    ),
    Family(
        "falcon_h1",
        f"parallel attention + {_SSM} in every layer, scaled streams",
        tiny=dict(
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=8,
        ),
    ),
    Family(
        "bamba",
        f"{_SSM} + full attention",
        tiny=dict(
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_chunk_size=8,
        ),
    ),
    Family(
        "zamba2",
        f"{_SSM} + a shared attention block before some SSM layers",
        tiny=dict(
            num_hidden_layers=3,
            layers_block_type=["linear_attention", "hybrid", "linear_attention"],
            n_mamba_heads=4,
            mamba_headdim=32,
            mamba_d_state=8,
            mamba_d_conv=4,
            chunk_size=8,
            attention_head_dim=16,
            num_attention_heads=4,
            num_key_value_heads=4,
        ),
    ),
    Family(
        "jamba",
        "Mamba-1 + full attention, MoE every other layer",
        moe=True,
        tiny=dict(
            num_hidden_layers=3,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
            use_mamba_kernels=False,
        ),
        stand_ins={"mamba": JambaMixer},
    ),
)
