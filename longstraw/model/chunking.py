"""The capture chunk a model gets when the user sets none, and the per-token byte terms it is chosen from.

`auto_chunk_size(cfg, P, dtype)`: the largest of `AUTO_CHUNKS` whose capture transient (one chunk through one layer
at a time) fits `AUTO_CHUNK_BUDGET`. The terms are the planner's (`longstraw.tools.planner`, which imports them from
here): the capture reads them from the config alone, below the planner, so that the prompt state needs no tool.
"""

from __future__ import annotations

from ..kinds import LayerState, layer_kind, registered_layer_types, state_bytes
from .capability import layer_plan

#: bytes per element of each model dtype
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def kind_class(kind: str) -> type[LayerState]:
    """The `LayerState` class serving `kind`; `LayerState` itself (every term at its default, none) for a kind no class
    serves, which `state_bytes` reports where it matters."""
    return layer_kind(kind) if kind in registered_layer_types() else LayerState


#: kinds whose durable state grows with P (`LayerState.grows_with_prompt`: split over context-parallel ranks,
#: quantizable)
GROWING_KINDS = tuple(sorted(k for k in registered_layer_types() if layer_kind(k).grows_with_prompt))
#: kinds whose branch appends its own K/V or latents per token (`LayerState.appends_own_kv`)
OWN_KV_KINDS = tuple(sorted(k for k in registered_layer_types() if layer_kind(k).appends_own_kv))


def config_value(cfg, name, default=0):
    """`cfg.name`, or `default` where the config does not set it."""
    try:
        value = getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute (Gemma 4): read layer 0's
        value = getattr(cfg.per_layer_config[0], name, None)
    return default if value is None else value


def dimensions(cfg) -> dict:
    """The widths the byte terms use: hidden, query, key / value, MLP (the larger of dense and routed), vocabulary,
    layers."""
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = config_value(cfg, "head_dim", h // heads) or h // heads
    kv = config_value(cfg, "num_key_value_heads", heads)
    dense_i = config_value(cfg, "intermediate_size", 4 * h)
    moe_i = config_value(cfg, "moe_intermediate_size", 0)
    topk = config_value(cfg, "num_experts_per_tok", 0)
    shared = config_value(cfg, "shared_expert_intermediate_size", 0) or moe_i * config_value(cfg, "n_shared_experts", 0)
    routed = moe_i * topk + shared
    return dict(
        h=h,
        q=heads * head_dim,
        kv=kv * head_dim,
        i=max(dense_i, routed),
        vocab=cfg.vocab_size,
        layers=cfg.num_hidden_layers,
    )


def chunk_bytes_per_token(cfg, kinds, elem: int) -> tuple[int, int, int, int]:
    """Bytes per prompt token of one capture chunk, without autograd: (own K/V or latents of every layer, one
    layer's live activations, the MLP's gate / up, a recurrent layer's chunked recurrence)."""
    d = dimensions(cfg)
    classes = [kind_class(k) for k in kinds]
    # own K/V (or latents) per token of every layer, full precision: what a chunk or a branch appends
    own_per_token = sum(
        state_bytes(k, cfg, i, 1, elem) if classes[i].appends_own_kv else 0 for i, k in enumerate(kinds)
    )
    # one layer's live activations per token without autograd (residual, normed input, q / k / v, the MLP's
    # gate / up); the per-kind extras (`LayerState.capture_activation_bytes`, e.g. MLA / DSA in
    # `longstraw.kinds.latent_attention`), and every coefficient, calibrated on bench/plan_accuracy.py's models
    act = elem * (2 * d["h"] + d["q"] + 2 * d["kv"])
    act += max((c.capture_activation_bytes(cfg, elem) for c in set(classes)), default=0)
    ffn = elem * 2 * d["i"]  # the MLP's gate / up
    # a recurrent layer's chunked recurrence (`LayerState.recurrence_bytes`: gated DeltaNet in
    # `longstraw.kinds.linear_attention`)
    recurrence = max((c.recurrence_bytes(cfg) for c in set(classes)), default=0)
    return own_per_token, act, ffn, recurrence


def replay_graph_bytes(cfg, kinds, elem: int, tokens: int, predicted: int, checkpoint_layers: bool = False) -> int:
    """One replay's autograd graph: `tokens` positions run with autograd (the response, and in exact mode a row's own
    suffix), `predicted` of them scored by the LM head. What autograd saves per layer and token (inputs of norms,
    projections, RoPE, attention and the MLP's gate / up / activation: about 2.5 × the live activations, calibrated
    on the dense benchmark model; with `checkpoint_layers`, each layer's input and one layer's graph), the own K/V
    or latents every layer appends, and one chunk of the LM head's float32 logits (`longstraw.ops.logprobs`). A
    batch of k replays (`longstraw.replay.batched`) holds k of these (the head's chunk once)."""
    d = dimensions(cfg)
    own_per_token = chunk_bytes_per_token(cfg, kinds, elem)[0]
    graph = elem * (8 * d["h"] + 3 * d["q"] + 4 * d["kv"] + 6 * d["i"])
    saved = d["layers"] * (d["h"] * elem if checkpoint_layers else graph) + (graph if checkpoint_layers else 0)
    return tokens * (saved + own_per_token) + 4 * min(predicted, 1024) * min(d["vocab"], 32768)


#: what `replay_batch: auto` lets the graphs of the responses replayed together take (`AUTO_CHUNK_BUDGET`'s twin):
#: independent of the prompt, so a step's memory stays the state + this
AUTO_REPLAY_BUDGET = 1 << 30


#: what `auto_chunk_size` lets one capture chunk's transients take (the planner's `Plan.capture_transient`)
AUTO_CHUNK_BUDGET = 512 << 20
#: the chunk sizes it chooses among, largest first: 4,096 is the fastest measured on both real models (dense
#: SmolLM2-135M and sliding-window Gemma 3 270M, docs/capture speed table), and below 512 the per-chunk
#: overhead of a forward shows
AUTO_CHUNKS = (4096, 2048, 1024, 512)


def auto_chunk_size(cfg, prompt_length: int | None = None, dtype: str = "bf16") -> int:
    """The capture chunk for a model config when the user sets none: the largest of `AUTO_CHUNKS` whose capture
    transient (one chunk through one layer at a time, as `plan` estimates it) fits `AUTO_CHUNK_BUDGET`, and no
    larger than the prompt. `dtype`: "fp32", "bf16" or "fp16" (the model's)."""
    kinds = layer_plan(cfg)
    own, act, ffn, rec = chunk_bytes_per_token(cfg, kinds, ELEMENT_BYTES.get(dtype, 2))
    per_token = own + act + ffn + rec
    chunk = next((c for c in AUTO_CHUNKS if c * per_token <= AUTO_CHUNK_BUDGET), AUTO_CHUNKS[-1])
    if prompt_length is not None:
        chunk = max(1, min(chunk, prompt_length - 1))
    return chunk
