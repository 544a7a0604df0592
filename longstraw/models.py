"""Supported architectures, how to reach their parts, and tiny random configs for tests and demos.

longstraw runs the unmodified transformers model code; what it needs from a model is its decoder
(the stack that returns hidden states), its LM head, and per decoder layer a `config.layer_types`
name that a longstraw layer kind serves (`longstraw.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PreTrainedConfig

#: transformers `model_type` (of the text config) → what longstraw keeps per layer.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "dense, full attention (K/V)",
    "qwen3": "dense, full attention with GQA (K/V)",
    "gemma3_text": "sliding-window + global attention (last W-1 K/V, full K/V)",
    "qwen3_next": "hybrid gated DeltaNet + full attention, MoE (conv/recurrent state, K/V)",
    "qwen3_5_text": "hybrid gated DeltaNet + full attention (conv/recurrent state, K/V)",
    "qwen3_5_moe_text": "hybrid gated DeltaNet + full attention, MoE (conv/recurrent state, K/V)",
    "deepseek_v3": "multi-head latent attention (MLA), MoE (compressed latent + rotary key)",
    "deepseek_v32": "MLA with DeepSeek sparse attention (DSA), MoE (latent + rotary key + indexer key)",
    "glm_moe_dsa": "MLA with DSA and shared-index layers, MoE (latent + rotary key [+ indexer key])",
    "kimi_linear": "hybrid Kimi delta attention + NoPE MLA, MoE (conv/recurrent state, latent)",
}

#: model_type → {transformers layer type → longstraw layer kind} where the name alone does not say what
#: the layer keeps: these models' "full_attention" layers are MLA (latents, `longstraw.layers.latent_attention`).
_LAYER_KINDS: dict[str, dict[str, str]] = {
    "deepseek_v3": {"full_attention": "latent_attention"},
    "kimi_linear": {"full_attention": "latent_attention"},
}
# The multimodal wrappers (`gemma3`, `qwen3_5`, `qwen3_5_moe`) are supported through their text model:
# the check below reads the text config, whose model_type is one of the above.


class UnsupportedArchitectureError(ValueError):
    pass


def base_model(model) -> transformers.PreTrainedModel:
    """The transformers model under an optional PEFT wrapper (adapters stay injected in its modules)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def text_config(model) -> PreTrainedConfig:
    return base_model(model).config.get_text_config(decoder=True)


def check_supported(model) -> PreTrainedConfig:
    """The text config of `model`, or an error naming the supported architectures."""
    cfg = text_config(model)
    if cfg.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"longstraw does not support model_type {cfg.model_type!r} ({type(base_model(model)).__name__}). "
            f"Supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}."
        )
    return cfg


def layer_types(cfg: PreTrainedConfig) -> list[str]:
    """The longstraw layer kind of each decoder layer (`longstraw.layers.layer_kind`)."""
    types = getattr(cfg, "layer_types", None)
    types = list(types) if types is not None else ["full_attention"] * cfg.num_hidden_layers
    kinds = _LAYER_KINDS.get(cfg.model_type, {})
    return [kinds.get(t, t) for t in types]


@dataclass
class ModelParts:
    """What capture and replay call: `decoder(input_ids=..., ...)` → hidden `[1, T, hidden]`; `lm_head`."""

    model: torch.nn.Module
    decoder: torch.nn.Module
    lm_head: torch.nn.Module
    config: PreTrainedConfig
    final_logit_softcapping: float | None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits


def model_parts(model) -> ModelParts:
    cfg = check_supported(model)
    base = base_model(model)
    return ModelParts(
        model=base,
        decoder=base.get_decoder(),
        lm_head=base.get_output_embeddings(),
        config=cfg,
        final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None),
    )


# ---------------------------------------------------------------------------------------------- tiny models

_TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
)

_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)

#: MLA: latent 32 + rotary 8 per token; heads of 16 (nope) + 8 (rope) for q·k, 16 for values; MoE of 4 experts.
_MLA = dict(
    _TINY_COMMON,
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
_DSA = dict(index_n_heads=16, index_head_dim=16, index_topk=8)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_TINY_COMMON),
    "qwen3": dict(_TINY_COMMON),
    "gemma3_text": dict(
        _TINY_COMMON,
        num_hidden_layers=3,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16,
    ),
    "qwen3_next": dict(
        _TINY_COMMON,
        **_LINEAR,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    ),
    "qwen3_5_text": dict(
        _TINY_COMMON,
        **_LINEAR,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    ),
    "qwen3_5_moe_text": dict(
        _TINY_COMMON,
        **_LINEAR,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "deepseek_v3": dict(_MLA, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1),
    "deepseek_v32": dict(_MLA, **_DSA, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1),
    "glm_moe_dsa": dict(_MLA, **_DSA, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                        indexer_types=["full", "shared", "full"], n_group=1, topk_group=1),
    "kimi_linear": dict(
        _MLA,
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
}

#: Multimodal wrappers: their text model is what longstraw runs; a minimal vision tower completes the config.
TINY_MULTIMODAL: dict[str, tuple[str, dict]] = {
    "gemma3": ("gemma3_text", dict(
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4,
    )),
    "qwen3_5": ("qwen3_5_text", dict(
        vision_config=dict(hidden_size=16, intermediate_size=32, depth=1, num_heads=2, out_hidden_size=64),
    )),
}

#: The dense model of the memory benchmark: hidden 128, 4 layers, 2 KV heads of 32.
BENCH_DENSE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
#: The hybrid model of the memory benchmark (qwen3_next-like: 3 linear + 1 full attention layers, MoE).
BENCH_HYBRID = dict(
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

#: The compressed-attention model of the memory benchmark (glm_moe_dsa): 4 layers of MLA (16 heads, latent 64 +
#: rotary 16) with DSA (8 indexer heads of 32, top-256; layers 2 and 4 share the selection of the layer before),
#: MoE from layer 2. Per token and layer it keeps 112 values where the expanded K/V would take 16 × (48 + 32) = 1280.
BENCH_DSA = dict(
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


def tiny_config(arch: str, **overrides) -> PreTrainedConfig:
    """A tiny random-initialisable config of a supported architecture (fp32 unless overridden)."""
    if arch in TINY_MULTIMODAL:
        text_arch, fields = TINY_MULTIMODAL[arch]
        return CONFIG_MAPPING[arch](text_config={**TINY_CONFIGS[text_arch], **overrides}, **fields)
    if arch not in TINY_CONFIGS:
        raise UnsupportedArchitectureError(
            f"no tiny config for {arch!r}; choose from {sorted(TINY_CONFIGS) + sorted(TINY_MULTIMODAL)}")
    fields = {**TINY_CONFIGS[arch], **overrides}
    n = fields["num_hidden_layers"]
    for name in _PER_LAYER:  # a different depth repeats the tiny config's per-layer pattern
        if name in fields and name not in overrides and len(fields[name]) != n:
            fields[name] = [fields[name][i % len(fields[name])] for i in range(n)]
    return CONFIG_MAPPING[arch](**fields)


#: config fields with one entry per decoder layer
_PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types")


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, attn_implementation="sdpa", **overrides):
    """A tiny random model of `arch` (eval mode, `dtype`), reproducible from `seed`."""
    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()
