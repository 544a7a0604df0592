"""Shared tiny fields of the multi-head latent attention (MLA) families."""

#: MLA: latent 32 + rotary 8 per token; heads of 16 (nope) + 8 (rope) for q·k, 16 for values; MoE of 4 experts.
MLA = dict(
    num_key_value_heads=4,
    head_dim=8,  # the rotary width (= qk_rope_head_dim), as in these models' own configs
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    norm_topk_prob=True,
    rope_interleave=True,
)
#: DSA indexer: 16 heads of 16, top-8 keys (smaller than the tests' prompts, so selection is sparse).
DSA = dict(index_n_heads=16, index_head_dim=16, index_topk=8)
#: MLA layers are "full_attention" in `layer_types`: what they keep is the latent.
LATENT = {"full_attention": "latent_attention"}
