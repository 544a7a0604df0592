"""DeepSeek-V4: sliding-window attention, compressed sparse attention (CSA: every `m` tokens pooled into one
entry, searched by an indexer) and heavily compressed attention (HCA: every `m'` tokens pooled), all with
attention sinks and shared-KV multi-query attention; hyper-connections; hash-routed and top-k MoE."""

from .base import Family, register

register(
    # no SDPA path in transformers 5.24: the tiny model is built with eager attention. Rates 4 (CSA) and 8 (HCA)
    # and a window of 6 make the tests' prompts (≈ 20–40 tokens) cross several compression blocks and windows;
    # top-3 of the indexer is sparse from 16 tokens on.
    Family(
        "deepseek_v4",
        "sliding window + compressed sparse (CSA) / heavily compressed (HCA) attention, sinks, hash / routed MoE",
        moe=True,
        attn_implementation="eager",
        tiny=dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            head_dim=16,
            q_lora_rank=16,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            sliding_window=6,
            partial_rotary_factor=0.5,
            o_groups=2,
            o_lora_rank=8,
            hc_mult=2,
            index_n_heads=4,
            index_head_dim=8,
            index_topk=3,
            scoring_func="sigmoid",
        ),
    ),
)
