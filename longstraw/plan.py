"""The memory planner: will a run fit, per rank, and which knob would make it fit.

`plan(PlanConfig(...))` predicts, from a transformers config alone (no weights), what one GRPO step holds
per rank, in bytes:
- `weights`: parameters in the model dtype (÷ FSDP ranks);
- `optimizer`: trainable parameters, their gradients and AdamW's two float32 moments (LoRA: float32
  adapters of rank r on every linear layer of the decoder; full fine-tuning: gradients in the model dtype,
  moments in float32; ÷ FSDP ranks);
- `durable_state`: what capture keeps (`longstraw.kinds.sizes`, the same formulas the tests hold equal to
  `PromptState.nbytes`); states that grow with P are split over the context-parallel ranks;
- `state_grad`: exact mode's gradient buffer the size of the state, plus the boundary states of
  linear-attention and sliding layers kept per chunk;
- the step's transients, of which one is live at a time: `capture_transient` (one chunk through the model
  without autograd: its activations and its own K/V before they are committed), `sampler` (G sequences'
  own K/V while decoding R tokens, their logits), `replay_graph` (one response's autograd graph; with
  replay checkpointing, each layer's input plus one layer's graph), and in exact mode the reverse pass's
  graph of one chunk. With context parallelism (`context_parallel` > 1) capture runs each rank's whole slice
  through an attention layer at once and the exact reverse pass keeps the slice's graph (`longstraw.distributed`):
  the slice, P / ranks, takes the chunk's place in both, except for the recurrent layers' intermediates
  (gated DeltaNet's chunked recurrence), which capture still holds for one chunk.
`step` = durable state + state gradient + the largest transient: the memory a step adds to a loaded model
and optimizer (what `longstraw compare` and the planner benchmark measure). `peak` adds weights and
optimizer. The activation terms are estimates (documented per term); the state terms are exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .kinds.sizes import state_bytes
from .ops.attention import TILE_ELEMENTS
from .positions import position_note
from .support import layer_plan

_ELEM = {"fp32": 4, "bf16": 2, "fp16": 2}
_GROWING = ("full_attention", "latent_attention", "indexed_attention")
_ATTENTION = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass
class PlanConfig:
    """One run to plan. `model`: a transformers config, a local model folder or config.json, or a built-in tiny
    family name."""

    model: object
    prompt_length: int
    num_generations: int = 8
    completion_length: int = 256
    prompt_grad: str = "detached"
    dtype: str = "bf16"
    #: None, "fp8" or "int8" (`capture(state_dtype=...)`)
    state_dtype: str | None = None
    #: the durable state in host memory (`state_device="cpu"`): off the device
    state_offload: bool = False
    #: LoRA rank on every linear layer of the decoder; 0: full fine-tuning
    lora_rank: int = 16
    #: capture chunk in tokens; None: `auto_chunk_size` for the model
    chunk_size: int | None = None
    block_size: int = 1024
    context_parallel: int = 1
    fsdp: int = 1
    checkpoint_layers: bool = False
    #: device memory per rank in GiB (None: no verdict)
    device_memory_gib: float | None = None

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"plan: {msg}")

        need(isinstance(self.prompt_length, int) and self.prompt_length >= 1, "prompt_length must be an int >= 1")
        for name in ("num_generations", "completion_length", "chunk_size", "block_size", "context_parallel", "fsdp"):
            if name == "chunk_size" and self.chunk_size is None:
                continue
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be an int >= 1")
        need(isinstance(self.lora_rank, int) and self.lora_rank >= 0, "lora_rank must be an int >= 0 (0: full)")
        need(self.prompt_grad in ("detached", "exact"), "prompt_grad must be 'detached' or 'exact'")
        need(self.dtype in _ELEM, f"dtype must be one of {sorted(_ELEM)}")
        need(self.state_dtype in (None, "fp8", "int8"), "state_dtype must be None, 'fp8' or 'int8'")
        need(self.state_dtype is None or self.prompt_grad == "detached", "a quantized state needs prompt_grad detached")
        need(self.device_memory_gib is None or self.device_memory_gib > 0, "device_memory_gib must be > 0")


def load_config(model):
    """A transformers text config from a config object, a folder / config.json, or a tiny family name."""
    from transformers import AutoConfig, PreTrainedConfig

    from .models import TINY_CONFIGS, TINY_MULTIMODAL, tiny_config

    if isinstance(model, PreTrainedConfig):
        cfg = model
    elif isinstance(model, str) and (model in TINY_CONFIGS or model in TINY_MULTIMODAL):
        cfg = tiny_config(model)
    else:
        path = Path(model)
        if path.is_file():
            data = json.loads(path.read_text())
            if "model_type" not in data:
                raise ValueError(f"plan: {path} has no 'model_type' field")
            from transformers import CONFIG_MAPPING

            cfg = CONFIG_MAPPING[data.pop("model_type")](**data)
        elif (path / "config.json").exists():
            cfg = AutoConfig.from_pretrained(path)
        else:
            raise ValueError(f"plan: {model!r} is neither a config, a model folder, a config.json nor a tiny family")
    return cfg.get_text_config(decoder=True)


def _get(cfg, name, default=0):
    try:
        value = getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - a per-layer attribute (Gemma 4): read layer 0's
        value = getattr(cfg.per_layer_config[0], name, None)
    return default if value is None else value


def _dims(cfg) -> dict:
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = _get(cfg, "head_dim", h // heads) or h // heads
    kv = _get(cfg, "num_key_value_heads", heads)
    dense_i = _get(cfg, "intermediate_size", 4 * h)
    moe_i = _get(cfg, "moe_intermediate_size", 0)
    topk = _get(cfg, "num_experts_per_tok", 0)
    shared = _get(cfg, "shared_expert_intermediate_size", 0) or moe_i * _get(cfg, "n_shared_experts", 0)
    routed = moe_i * topk + shared
    return dict(
        h=h,
        q=heads * head_dim,
        kv=kv * head_dim,
        i=max(dense_i, routed),
        vocab=cfg.vocab_size,
        layers=cfg.num_hidden_layers,
    )


def _params(cfg, lora_rank: int) -> tuple[int, int]:
    """(all parameters, LoRA parameters) estimated from the config: embeddings, LM head, attention and MLP
    projections (MoE: every expert), norms ignored."""
    d = _dims(cfg)
    h, layers = d["h"], d["layers"]
    attn = [(h, d["q"]), (h, d["kv"]), (h, d["kv"]), (d["q"], h)]
    experts = _get(cfg, "num_experts", 0) or _get(cfg, "n_routed_experts", 0) or _get(cfg, "num_local_experts", 0)
    moe_i = _get(cfg, "moe_intermediate_size", 0) or _get(cfg, "intermediate_size", 0)
    dense_i = _get(cfg, "intermediate_size", 4 * h)
    mlp = [(h, dense_i), (h, dense_i), (dense_i, h)]
    per_layer = sum(a * b for a, b in attn) + (3 * h * moe_i * experts if experts else sum(a * b for a, b in mlp))
    total = layers * per_layer + 2 * d["vocab"] * h
    lora = layers * lora_rank * (sum(a + b for a, b in attn) + sum(a + b for a, b in mlp)) if lora_rank else 0
    return total, lora


@dataclass
class Plan:
    """Predicted bytes per rank (see the module docstring) and the verdict."""

    config: dict
    weights: int
    optimizer: int
    durable_state: int
    state_grad: int
    capture_transient: int
    sampler: int
    replay_graph: int
    step: int
    peak: int
    fits: bool | None
    suggestions: list[str] = field(default_factory=list)
    #: caveats of this prediction
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def __str__(self) -> str:
        gib = 2**30
        rows = [
            ("weights", self.weights),
            ("trainable + optimizer", self.optimizer),
            ("durable state", self.durable_state),
            ("exact-mode state gradient", self.state_grad),
            ("capture transient (one chunk)", self.capture_transient),
            ("sampler", self.sampler),
            ("one replay graph", self.replay_graph),
            ("step (state + largest transient)", self.step),
            ("predicted peak", self.peak),
        ]
        lines = [f"{name:>34}: {b / gib:10.3f} GiB" for name, b in rows]
        if self.fits is not None:
            lines.append(
                f"{'verdict':>34}: {'fits' if self.fits else 'does NOT fit'} in {self.config['device_memory_gib']} GiB"
            )
        lines += [f"  - {s}" for s in self.suggestions]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _durable(cfg, plan_kinds, tokens_local: int, elem: int, state_dtype) -> int:
    import torch

    q = {None: None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[state_dtype]
    total = 0
    for i, kind in enumerate(plan_kinds):
        total += state_bytes(kind, cfg, i, tokens_local, elem, q if kind in _GROWING else None)
    return total


def _per_token(cfg, kinds, elem: int) -> tuple[int, int, int, int]:
    """Bytes per prompt token of one capture chunk, without autograd: (own K/V or latents of every layer, one
    layer's live activations, the MLP's gate / up, a recurrent layer's chunked recurrence)."""
    d = _dims(cfg)
    # own K/V (or latents) per token of every layer, full precision: what a chunk or a branch appends
    own_per_token = sum(
        state_bytes(k, cfg, i, 1, elem) if k in _ATTENTION + _GROWING else 0 for i, k in enumerate(kinds)
    )
    # one layer's live activations per token without autograd (residual, normed input, q / k / v, the MLP's
    # gate / up); the per-kind extras below, and every coefficient, calibrated on bench/plan_accuracy.py's models
    act = elem * (2 * d["h"] + d["q"] + 2 * d["kv"])
    ffn = elem * 2 * d["i"]  # the MLP's gate / up
    if "latent_attention" in kinds or "indexed_attention" in kinds:
        # MLA: absorbed queries, latent-space output and per-head expansion (dense MLA also its latent-width
        # attention output; DSA gathers top-k latents instead)
        factor = 5 if "latent_attention" in kinds else 3
        act += elem * cfg.num_attention_heads * factor * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    recurrence = 0
    if "linear_attention" in kinds and getattr(cfg, "linear_num_value_heads", None):
        # gated DeltaNet's chunked recurrence (64-token chunks, float32): per value head, the intra-chunk
        # scores and decay mask (3 × 64) and the key / value corrections (4 × (dk + dv)), about twice over
        # live in transformers 5.24's torch path
        recurrence = (
            2 * 4 * cfg.linear_num_value_heads * (3 * 64 + 4 * (cfg.linear_key_head_dim + cfg.linear_value_head_dim))
        )
    return own_per_token, act, ffn, recurrence


#: what `auto_chunk_size` lets one capture chunk's transients take (`Plan.capture_transient`)
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
    own, act, ffn, rec = _per_token(cfg, kinds, _ELEM.get(dtype, 2))
    per_token = own + act + ffn + rec
    chunk = next((c for c in AUTO_CHUNKS if c * per_token <= AUTO_CHUNK_BUDGET), AUTO_CHUNKS[-1])
    if prompt_length is not None:
        chunk = max(1, min(chunk, prompt_length - 1))
    return chunk


def plan(pc: PlanConfig) -> Plan:
    cfg = load_config(pc.model)
    kinds = layer_plan(cfg)
    elem = _ELEM[pc.dtype]
    d = _dims(cfg)
    captured = pc.prompt_length - 1
    chunk_size = pc.chunk_size or auto_chunk_size(cfg, pc.prompt_length, pc.dtype)
    local = math.ceil(captured / pc.context_parallel)
    state = _durable(cfg, kinds, local, elem, pc.state_dtype)
    n_params, n_lora = _params(cfg, pc.lora_rank)
    weights = n_params * elem // pc.fsdp
    optimizer = n_lora * 4 * 4 if pc.lora_rank else n_params * (elem + 8) // pc.fsdp

    state_grad = 0
    if pc.prompt_grad == "exact":
        chunks = math.ceil(captured / chunk_size)
        state_grad = state
        for i, kind in enumerate(kinds):
            if kind not in _GROWING:  # boundary states kept per chunk (linear attention, sliding windows)
                state_grad += chunks * state_bytes(kind, cfg, i, min(local, 1 << 30), elem)
    own_per_token, act, ffn, recurrence = _per_token(cfg, kinds, elem)
    c = min(chunk_size, captured) if captured else 1
    chunk = c
    if pc.context_parallel > 1:
        # the context-parallel capture runs each rank's whole slice through an attention layer at once, and its
        # exact-mode reverse pass keeps the slice's whole graph (`longstraw.distributed`): the slice, not the chunk,
        # bounds them; recurrent layers still run a chunk at a time (`longstraw.prepare._forward_in_chunks`)
        c = local
    # the blockwise kernel (sliding / chunked windows, softcapping, DSA scoring) holds a few score tiles of
    # `TILE_ELEMENTS` floats; the fused CPU kernel keeps per-thread blocks only
    blockwise = any(k in ("sliding_attention", "chunked_attention", "indexed_attention") for k in kinds) or getattr(
        cfg, "attn_logit_softcapping", None
    )
    attn_tile = 4 * 4 * TILE_ELEMENTS if blockwise else 0
    if pc.context_parallel > 1:
        # the exchange's float32 accumulators, partials and gathered chunks over the whole slice, and the slice's K/V
        # held twice while committed: 1.5 × the one-process terms per position (measured 1.2-1.5 ×:
        # bench/results/cp_capture_{dense,hybrid}_memory.md, 2 ranks, P = 16K / 32K); the feed-forward modules and
        # recurrent layers run a chunk at a time (`longstraw.prepare.ChunkedFeedForward`, `_forward_in_chunks`)
        capture_transient = 3 * c * (own_per_token + act) // 2 + chunk * (ffn + recurrence) + attn_tile
    else:
        capture_transient = c * (own_per_token + act + ffn + recurrence) + attn_tile
    r, g = pc.completion_length, pc.num_generations
    sampler = g * r * own_per_token + g * d["vocab"] * 4 * 2
    # what autograd saves per layer and token (inputs of norms, projections, RoPE, attention and the MLP's
    # gate / up / activation), about 2.5 × the live activations (calibrated on the dense benchmark model)
    graph = elem * (8 * d["h"] + 3 * d["q"] + 4 * d["kv"] + 6 * d["i"])
    saved = d["layers"] * (d["h"] * elem if pc.checkpoint_layers else graph) + (graph if pc.checkpoint_layers else 0)
    replay_graph = r * (saved + own_per_token) + 4 * min(r, 1024) * min(d["vocab"], 32768)
    # exact mode's reverse pass recomputes one chunk with autograd
    reverse_graph = c * (d["layers"] * graph + own_per_token) if pc.prompt_grad == "exact" else 0
    if pc.state_offload:
        state = 0
    step = state + state_grad + max(capture_transient, sampler, replay_graph, reverse_graph)
    peak = weights + optimizer + step
    notes = []
    if pc.prompt_grad == "exact":
        # measured (bench/results/plan_accuracy.md): exact steps came out between 31 % above (DSA) and 64 % below
        # (hybrid) this prediction; count the reverse pass twice before claiming a fit
        notes.append(
            "exact mode: the reverse pass's memory is predicted only roughly (MLA / DSA steps measured up to "
            "31 % above the prediction); the verdict counts it twice"
        )
        peak += reverse_graph
    note = position_note(cfg, pc.prompt_length)
    if note is not None:
        notes.append(note)
    fits = None if pc.device_memory_gib is None else peak <= pc.device_memory_gib * 2**30
    suggestions = _suggest(pc, fits, state, capture_transient, replay_graph, chunk_size)
    settings = {f.name: getattr(pc, f.name) for f in fields(pc)} | {
        "model": str(getattr(cfg, "model_type", pc.model)),
        "chunk_size": chunk_size,
    }
    return Plan(
        settings,
        weights,
        optimizer,
        state,
        state_grad,
        capture_transient,
        sampler,
        replay_graph,
        step,
        peak,
        fits,
        suggestions,
        notes,
    )


def _suggest(pc: PlanConfig, fits, state, capture_transient, replay_graph, chunk_size: int) -> list[str]:
    if fits is None or fits:
        return []
    out = []
    if pc.state_dtype is None and pc.prompt_grad == "detached":
        out.append(
            f"state_dtype='fp8': durable state {state / 2**30:.1f} → ~{state / 4 / 2**30:.1f} GiB (fp32) "
            "or half of that from bf16"
        )
    if not pc.state_offload:
        out.append("state_offload (state_device='cpu'): the durable state leaves the device")
    if pc.context_parallel > 1:
        out.append(
            f"context_parallel={pc.context_parallel * 2}: the growing state and the capture transient (an "
            "attention layer's whole slice; with several ranks chunk_size bounds only the feed-forward and "
            "recurrent parts) per rank halve"
        )
    else:
        out.append(f"context_parallel={pc.context_parallel * 2}: the growing state per rank halves")
    if capture_transient > replay_graph and chunk_size > 512 and pc.context_parallel == 1:
        out.append(f"chunk_size={chunk_size // 2}: the capture transient roughly halves")
    if not pc.checkpoint_layers and replay_graph > capture_transient:
        out.append("checkpoint_layers=True: one replay keeps each layer's input instead of its activations")
    if pc.lora_rank == 0:
        out.append(f"fsdp={pc.fsdp * 2} or LoRA: weights, gradients and optimizer state are sharded / smaller")
    return out
