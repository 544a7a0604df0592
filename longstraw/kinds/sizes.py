"""Durable-state bytes per layer kind, from the config alone (what `longstraw.tools.planner` predicts and the tests hold
equal to a captured `PromptState.nbytes`).

`state_bytes(kind, config, layer_idx, tokens, elem, state_dtype)`: bytes one decoder layer of `kind` keeps
after `tokens` captured prompt tokens, the model's values taking `elem` bytes each; `state_dtype` an 8-bit
dtype for the kinds that grow with P (`longstraw.ops.quant`: 1 byte per value + a float32 scale per 64 tokens
× head, the unfinished last block in the model's dtype). A kind without a formula here raises
`KeyError` naming it (the planner then says it cannot predict that model).
"""

from __future__ import annotations

from collections.abc import Callable

from ..ops.quant import QUANT_BLOCK

_FORMULAS: dict[str, Callable] = {}


def formula(*kinds: str):
    def register(fn):
        for kind in kinds:
            _FORMULAS[kind] = fn
        return fn

    return register


def _layer_config(config, layer_idx: int):
    per_layer = getattr(config, "per_layer_config", None)  # Gemma 4: per-layer head sizes
    return per_layer[layer_idx] if per_layer is not None else config


def _grown(tokens: int, heads: int, width: int, elem: int, state_dtype) -> int:
    """Bytes of `tokens` × `heads` rows of `width` values, full precision or 8-bit with block scales."""
    if state_dtype is None:
        return tokens * heads * width * elem
    full = tokens - tokens % QUANT_BLOCK
    return heads * (full * width + full // QUANT_BLOCK * 4 + (tokens - full) * width * elem)


@formula("full_attention")
def _kv(config, layer_idx, tokens, elem, state_dtype):
    c = _layer_config(config, layer_idx)
    return 2 * _grown(tokens, c.num_key_value_heads, c.head_dim, elem, state_dtype)


@formula("sliding_attention")
def _sliding(config, layer_idx, tokens, elem, state_dtype):
    c = _layer_config(config, layer_idx)
    return 2 * min(tokens, int(config.sliding_window) - 1) * c.num_key_value_heads * c.head_dim * elem


@formula("chunked_attention")
def _chunked(config, layer_idx, tokens, elem, state_dtype):
    c = _layer_config(config, layer_idx)
    return 2 * (tokens % int(config.attention_chunk_size)) * c.num_key_value_heads * c.head_dim * elem


@formula("latent_attention", "indexed_attention")
def _latent(config, layer_idx, tokens, elem, state_dtype):
    total = _grown(tokens, 1, config.kv_lora_rank + config.qk_rope_head_dim, elem, state_dtype)
    types = getattr(config, "indexer_types", None)
    if getattr(config, "index_head_dim", None) and (types is None or types[layer_idx] != "shared"):
        total += tokens * config.index_head_dim * elem  # DSA indexer keys stay in the model's dtype
    return total


def _first(config, *names):
    return next(getattr(config, n) for n in names if getattr(config, n, None) is not None)


def _mamba2(config, elem) -> int:
    """Mamba-2: conv window of K inputs over [x | B | C] + SSM state heads × head_dim × state (field names per
    family, transformers 5.24); Jamba's Mamba-1: conv window over d_inner + SSM state d_inner × d_state."""
    if config.model_type == "jamba":
        d_inner = config.mamba_expand * config.hidden_size
        return elem * d_inner * (config.mamba_d_conv + config.mamba_d_state)
    heads = _first(config, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads")
    head_dim = _first(config, "mamba_head_dim", "mamba_d_head", "mamba_headdim")
    state = _first(config, "ssm_state_size", "mamba_d_state")
    groups = _first(config, "n_groups", "mamba_n_groups", "mamba_ngroups")
    kernel = _first(config, "conv_kernel", "mamba_d_conv")
    return elem * ((heads * head_dim + 2 * groups * state) * kernel + heads * head_dim * state)


@formula("moe", "mlp")
def _mixerless(config, layer_idx, tokens, elem, state_dtype):
    return 0


@formula("conv")
def _short_conv(config, layer_idx, tokens, elem, state_dtype):
    return 0 if tokens == 0 else elem * config.hidden_size * (config.conv_L_cache - 1)


@formula("hybrid")
def _hybrid(config, layer_idx, tokens, elem, state_dtype):
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv = 2 * _grown(tokens, heads, config.head_dim, elem, None)
    return kv + (_mamba2(config, elem) if tokens else 0)


@formula("linear_attention")
def _linear(config, layer_idx, tokens, elem, state_dtype):
    if tokens == 0:
        return 0
    if not hasattr(config, "linear_num_key_heads") and config.model_type != "kimi_linear":
        return _mamba2(config, elem)
    if config.model_type == "kimi_linear":  # Kimi delta attention: conv over q, k, v + a d × d state per head
        d = config.linear_num_heads * config.linear_head_dim
        return elem * (3 * d * config.linear_conv_kernel_dim + config.linear_num_heads * config.linear_head_dim**2)
    # gated DeltaNet (Qwen3-Next, Qwen3.5): conv window over [q | k | v], recurrent state per value head
    conv_dim = (
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim
    )
    rec = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return elem * (conv_dim * config.linear_conv_kernel_dim + rec)


@formula("compressed_sparse_attention", "heavily_compressed_attention")
def _compressed(config, layer_idx, tokens, elem, state_dtype):
    """DeepSeek-V4: window keys (K = V, once) + per compressed stream (CSA: entries and indexer keys; HCA: entries)
    the entries written so far, the raw tail's kv + gate, and CSA's overlap kv + gate of the last window."""
    kind = (
        "compressed_sparse_attention"
        if layer_idx is not None and config.layer_types[layer_idx] == "compressed_sparse_attention"
        else "heavily_compressed_attention"
    )
    m, d = config.compress_rates[kind], config.head_dim
    total = elem * d * min(tokens, config.sliding_window - 1)
    sparse = kind == "compressed_sparse_attention"
    streams = [(d, 2 * d), (config.index_head_dim, 2 * config.index_head_dim)] if sparse else [(d, d)]
    for dim, width in streams:
        total += elem * (tokens // m * dim + 2 * (tokens % m) * width)
        if sparse and tokens >= m:
            total += elem * 2 * m * dim
    return total


def state_bytes(kind: str, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
    try:
        fn = _FORMULAS[kind]
    except KeyError:
        raise KeyError(f"no durable-state formula for layer kind {kind!r}") from None
    return int(fn(config, layer_idx, tokens, elem, state_dtype))


def kinds_with_formulas() -> frozenset[str]:
    return frozenset(_FORMULAS)
