"""Tiny random models (one config per tested family, from the family specs) and the benchmarks' model configs, for
tests, demos and benchmarks: `tiny_config(arch, **overrides)`, `tiny_model(arch, ...)`, `TINY_CONFIGS`,
`TINY_MULTIMODAL`, `BENCH_*`.

The engine never imports this module (`tests/test_layout.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PreTrainedConfig

from ..archs import FAMILIES, tiny_fields
from ..errors import UnsupportedArchitectureError

# ---------------------------------------------------------------------------------------------- tiny models


class _TinyConfigs(Mapping):
    """model_type → fields of its tiny random config (`longstraw.archs`), computed at first use."""

    def __init__(self):
        self._fields: dict[str, dict] = {}

    def __getitem__(self, name: str) -> dict:
        if name not in FAMILIES:
            raise KeyError(name)
        if name not in self._fields:
            self._fields[name] = tiny_fields(FAMILIES[name])
        return self._fields[name]

    def __iter__(self):
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)


#: model_type → fields of its tiny random config (`longstraw.archs`: one spec per tested family).
TINY_CONFIGS = _TinyConfigs()
#: Multimodal wrappers served through their text model: wrapper model_type → (text model_type, wrapper fields).
TINY_MULTIMODAL: dict[str, tuple[str, dict]] = {
    fam.wrapper[0]: (name, fam.wrapper[1]) for name, fam in FAMILIES.items() if fam.wrapper is not None
}

#: The dense model of the memory benchmark: hidden 128, 4 layers, 2 KV heads of 32.
BENCH_DENSE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
#: The hybrid model of the memory benchmark (qwen3_next-like: 3 linear + 1 full attention layers, MoE).
BENCH_HYBRID: dict[str, Any] = dict(
    BENCH_DENSE,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    decoder_sparse_step=1,
)

#: The Mamba-2 hybrid of the memory benchmark (granitemoehybrid): 3 Mamba-2 layers (4 heads of 64, state 16, conv 4)
#: + 1 full attention layer, MoE. Durable bytes: per Mamba-2 layer 4 · ((256 + 2 · 16) · 4 + 256 · 16) = 20,992
#: whatever P; per prompt token the attention layer's K/V, 2 · 2 · 32 · 4 = 512.
BENCH_SSM: dict[str, Any] = dict(
    BENCH_DENSE,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    mamba_n_heads=4,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=256,
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=64,
)

#: The DeepSeek-V4 model of the memory benchmark: hidden 64, 4 layers CSA / HCA / CSA / HCA at V4's own rates
#: (4 and 128) and window (128), 4 heads of 32 sharing one K = V head, indexer of 4 heads × 16 with top-64, MoE
#: of 4 experts (first layer hash-routed). Per token it keeps (32 + 16) / 4 values on a CSA layer and 32 / 128
#: on an HCA layer, plus O(window + rate) per layer.
BENCH_DSV4: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=128,
    partial_rotary_factor=0.5,
    o_groups=2,
    o_lora_rank=16,
    hc_mult=2,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    scoring_func="sigmoid",
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
)

#: The compressed-attention model of the memory benchmark (glm_moe_dsa): 4 layers of MLA (16 heads, latent 64 +
#: rotary 16) with DSA (8 indexer heads of 32, top-256; layers 2 and 4 share the selection of the layer before),
#: MoE from layer 2. Per token and layer it keeps 112 values where the expanded K/V would take 16 × (48 + 32) = 1280.
BENCH_DSA: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=16,
    kv_lora_rank=64,
    q_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=256,
    indexer_types=["full", "shared", "full", "shared"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    n_group=1,
    topk_group=1,
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
)


#: The sliding-window model of the planner benchmark (gemma3_text): the dense benchmark model with 3 sliding layers
#: (window 1,024) and 1 global layer.
BENCH_SLIDING = dict(
    BENCH_DENSE,
    sliding_window=1024,
    query_pre_attn_scalar=32,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
)
#: The MLA model of the planner benchmark (deepseek_v3): BENCH_DSA's attention without the indexer, MoE from layer 2.
BENCH_MLA = {
    k: v
    for k, v in BENCH_DSA.items()
    if k not in ("index_n_heads", "index_head_dim", "index_topk", "indexer_types", "mlp_layer_types")
}
BENCH_MLA.update(first_k_dense_replace=1, head_dim=16)


def tiny_config(arch: str, **overrides) -> PreTrainedConfig:
    """A tiny random-initialisable config of a supported architecture (fp32 unless overridden)."""
    if arch in TINY_MULTIMODAL:
        text_arch, fields = TINY_MULTIMODAL[arch]
        # ignored below: a multimodal config class (CONFIG_MAPPING types each entry as the base PreTrainedConfig)
        return CONFIG_MAPPING[arch](
            text_config={**TINY_CONFIGS[text_arch], **overrides},  # type: ignore[call-arg]
            **fields,
        )
    if arch not in TINY_CONFIGS:
        raise UnsupportedArchitectureError(
            f"no tiny config for {arch!r}; choose from {sorted(TINY_CONFIGS) + sorted(TINY_MULTIMODAL)}"
        )
    fields = {**TINY_CONFIGS[arch], **overrides}
    n = fields["num_hidden_layers"]
    for name in _PER_LAYER:  # a different depth repeats the tiny config's per-layer pattern
        if name in fields and name not in overrides and len(fields[name]) != n:
            fields[name] = [fields[name][i % len(fields[name])] for i in range(n)]
    return CONFIG_MAPPING[arch](**fields)


#: config fields with one entry per decoder layer
_PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types", "no_rope_layers")


def tiny_model(
    arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None, **overrides
):
    """A tiny random model of `arch` (eval mode, `dtype`), reproducible from `seed`; attention as its family
    spec says (SDPA unless the family has no SDPA path) unless `attn_implementation` is given."""
    cfg = tiny_config(arch, **overrides)
    if attn_implementation is None:
        fam = FAMILIES[TINY_MULTIMODAL[arch][0] if arch in TINY_MULTIMODAL else arch]
        attn_implementation = fam.attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


__all__ = [
    "tiny_config",
    "tiny_model",
    "TINY_CONFIGS",
    "TINY_MULTIMODAL",
]
