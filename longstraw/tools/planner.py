"""The memory planner: will a run fit, per rank, and which knob would make it fit.

`plan(PlanConfig(...))` predicts, from a transformers config alone (no weights), what one GRPO step holds
per rank, in bytes:
- `weights`: parameters in the model dtype (÷ FSDP ranks);
- `optimizer`: trainable parameters, their gradients and AdamW's two float32 moments (LoRA: float32
  adapters of rank r on every linear layer of the decoder; full fine-tuning: gradients in the model dtype,
  moments in float32; ÷ FSDP ranks);
- `durable_state`: what capture keeps (each kind's `LayerState.durable_bytes`, the same formulas the tests hold equal to
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
Rows sharing a document (`longstraw.train.sharing`): `prompt_length` is the shared prefix, captured once for all the
rows of the document, and `row_suffix` the tokens each row adds after it (its question). A row's suffix is read into a
branch held while the row samples and replays (detached: its own K/V, `row_suffix` × the own K/V per token, beside the
sampler's and the replay's transients), or replayed with each response (exact: its graph, as `row_suffix` more response
tokens); the rows go one at a time, so the memory is one prefix state + one row's suffix growth, whatever the number
of rows.
`step` = durable state + state gradient + the largest transient: the memory a step adds to a loaded model
and optimizer (what `longstraw compare` and the planner benchmark measure). `peak` adds weights and
optimizer. The activation terms are estimates (documented per term); the state terms are exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig

from ..kinds import state_bytes
from ..model.capability import layer_plan
from ..model.chunking import (
    AUTO_CHUNK_BUDGET,  # noqa: F401 - the planner's before model/chunking.py: kept here for one release
    AUTO_CHUNKS,  # noqa: F401 - likewise
    ELEMENT_BYTES,
    auto_chunk_size,
    chunk_bytes_per_token,
    config_value,
    dimensions,
    kind_class,
    replay_graph_bytes,
)
from ..model.positions import position_note
from ..ops.attention import TILE_ELEMENTS
from ..testing.models import TINY_CONFIGS, TINY_MULTIMODAL, tiny_config
from .backend_choice import choose_backend


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
    #: ranks the routed experts are spread over (`expert_parallel`): their weights, adapters and moments ÷ it
    expert_parallel: int = 1
    checkpoint_layers: bool = False
    #: device memory per rank in GiB (None: no verdict)
    device_memory_gib: float | None = None
    #: tokens a row adds after a prefix it shares with other rows (its question; `prompt_length` is then the shared
    #: prefix, captured once); 0: rows do not share
    row_suffix: int = 0
    #: responses replayed together (the trainer's `replay_batch`, `longstraw.replay.batched`): their graphs at once
    replay_batch: int = 1

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"plan: {msg}")

        need(isinstance(self.prompt_length, int) and self.prompt_length >= 1, "prompt_length must be an int >= 1")
        for name in (
            "num_generations",
            "completion_length",
            "chunk_size",
            "block_size",
            "context_parallel",
            "fsdp",
            "expert_parallel",
            "replay_batch",
        ):
            if name == "chunk_size" and self.chunk_size is None:
                continue
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, f"{name} must be an int >= 1")
        need(isinstance(self.lora_rank, int) and self.lora_rank >= 0, "lora_rank must be an int >= 0 (0: full)")
        need(isinstance(self.row_suffix, int) and self.row_suffix >= 0, "row_suffix must be an int >= 0")
        need(self.prompt_grad in ("detached", "exact"), "prompt_grad must be 'detached' or 'exact'")
        need(self.dtype in ELEMENT_BYTES, f"dtype must be one of {sorted(ELEMENT_BYTES)}")
        need(self.state_dtype in (None, "fp8", "int8"), "state_dtype must be None, 'fp8' or 'int8'")
        need(self.state_dtype is None or self.prompt_grad == "detached", "a quantized state needs prompt_grad detached")
        need(self.device_memory_gib is None or self.device_memory_gib > 0, "device_memory_gib must be > 0")


def load_config(model):
    """A transformers text config from a config object, a folder / config.json, or a tiny family name."""
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
            cfg = CONFIG_MAPPING[data.pop("model_type")](**data)
        elif (path / "config.json").exists():
            cfg = AutoConfig.from_pretrained(path)
        else:
            raise ValueError(f"plan: {model!r} is neither a config, a model folder, a config.json nor a tiny family")
    return cfg.get_text_config(decoder=True)


def _experts(cfg) -> int:
    """Routed experts per MoE layer (0: a dense model)."""
    return (
        config_value(cfg, "num_experts", 0)
        or config_value(cfg, "n_routed_experts", 0)
        or config_value(cfg, "num_local_experts", 0)
    )


def _params(cfg, lora_rank: int) -> tuple[int, int, int, int]:
    """(parameters outside the routed experts, the routed experts' own, LoRA parameters outside them, LoRA of the
    experts' 3-D weights) estimated from the config: embeddings, LM head, attention and MLP projections (MoE: every
    expert, every layer), norms ignored. PEFT's `all-linear` adapts the experts' weights `[E, in, out]` with lora_A
    `[E · r, in]` and lora_B `[out, r · E]` (r doubled for a fused gate_up_proj)."""
    d = dimensions(cfg)
    h, layers = d["h"], d["layers"]
    attn = [(h, d["q"]), (h, d["kv"]), (h, d["kv"]), (d["q"], h)]
    experts = _experts(cfg)
    moe_i = config_value(cfg, "moe_intermediate_size", 0) or config_value(cfg, "intermediate_size", 0)
    dense_i = config_value(cfg, "intermediate_size", 4 * h)
    mlp = [(h, dense_i), (h, dense_i), (dense_i, h)]
    dense = layers * (sum(a * b for a, b in attn) + (0 if experts else sum(a * b for a, b in mlp)))
    dense += 2 * d["vocab"] * h
    routed = layers * 3 * h * moe_i * experts
    lora = layers * lora_rank * (sum(a + b for a, b in attn) + sum(a + b for a, b in mlp)) if lora_rank else 0
    # PEFT 0.21 gives the fused gate_up_proj `[E, 2 i, h]` rank 2 r, down_proj `[E, h, i]` rank r
    lora_routed = layers * lora_rank * experts * (2 * (h + 2 * moe_i) + (moe_i + h)) if lora_rank else 0
    return dense, routed, lora, lora_routed


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
    #: the recommended `rollout_backend` and why (`longstraw.tools.backend_choice`)
    rollout_backend: str = "own"
    rollout_backend_reason: str = ""
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
            (f"replay graph ({self.config.get('replay_batch', 1)} at once)", self.replay_graph),
            ("step (state + largest transient)", self.step),
            ("predicted peak", self.peak),
        ]
        lines = [f"{name:>34}: {b / gib:10.3f} GiB" for name, b in rows]
        if self.fits is not None:
            lines.append(
                f"{'verdict':>34}: {'fits' if self.fits else 'does NOT fit'} in {self.config['device_memory_gib']} GiB"
            )
        lines.append(f"{'rollout backend':>34}: {self.rollout_backend} ({self.rollout_backend_reason})")
        lines += [f"  - {s}" for s in self.suggestions]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _durable(cfg, plan_kinds, tokens_local: int, elem: int, state_dtype) -> int:
    q = {None: None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[state_dtype]
    total = 0
    for i, kind in enumerate(plan_kinds):
        total += state_bytes(kind, cfg, i, tokens_local, elem, q if kind_class(kind).grows_with_prompt else None)
    return total


def plan(pc: PlanConfig) -> Plan:
    cfg = load_config(pc.model)
    kinds = layer_plan(cfg)
    elem = ELEMENT_BYTES[pc.dtype]
    d = dimensions(cfg)
    captured = pc.prompt_length - 1
    chunk_size = pc.chunk_size or auto_chunk_size(cfg, pc.prompt_length, pc.dtype)
    local = math.ceil(captured / pc.context_parallel)
    state = _durable(cfg, kinds, local, elem, pc.state_dtype)
    dense, routed, lora_dense, lora_routed = _params(cfg, pc.lora_rank)
    n_params = dense + routed
    # spread experts (`expert_parallel`): each rank holds 1 / EP of the routed experts, their adapters and moments
    weights = dense * elem // pc.fsdp + routed * elem // pc.expert_parallel
    if pc.lora_rank:
        optimizer = (lora_dense + lora_routed // pc.expert_parallel) * 4 * 4
    else:
        optimizer = dense * (elem + 8) // pc.fsdp + routed * (elem + 8) // pc.expert_parallel

    state_grad = 0
    if pc.prompt_grad == "exact":
        chunks = math.ceil(captured / chunk_size)
        state_grad = state
        for i, kind in enumerate(kinds):
            if not kind_class(
                kind
            ).grows_with_prompt:  # boundary states kept per chunk (linear attention, sliding windows)
                state_grad += chunks * state_bytes(kind, cfg, i, min(local, 1 << 30), elem)
    own_per_token, act, ffn, recurrence = chunk_bytes_per_token(cfg, kinds, elem)
    c = min(chunk_size, captured) if captured else 1
    chunk = c
    if pc.context_parallel > 1:
        # the context-parallel capture runs each rank's whole slice through an attention layer at once, and its
        # exact-mode reverse pass keeps the slice's whole graph (`longstraw.distributed`): the slice, not the chunk,
        # bounds them; recurrent layers still run a chunk at a time (`longstraw.model.prepare._forward_in_chunks`)
        c = local
    # the blockwise kernel (`LayerState.reads_with_blockwise_kernel`: sliding / chunked windows, DSA scoring; and
    # softcapping) holds a few score tiles of `TILE_ELEMENTS` floats; the fused CPU kernel keeps per-thread blocks only
    blockwise = any(kind_class(k).reads_with_blockwise_kernel for k in kinds) or getattr(
        cfg, "attn_logit_softcapping", None
    )
    attn_tile = 4 * 4 * TILE_ELEMENTS if blockwise else 0
    if pc.context_parallel > 1:
        # the exchange's float32 accumulators, partials and gathered chunks over the whole slice, and the slice's K/V
        # held twice while committed: 1.5 × the one-process terms per position (measured 1.2-1.5 ×:
        # bench/results/cp_capture_{dense,hybrid}_memory.md, 2 ranks, P = 16K / 32K); the feed-forward modules and
        # recurrent layers run a chunk at a time (`longstraw.model.prepare.ChunkedFeedForward`, `_forward_in_chunks`)
        capture_transient = 3 * c * (own_per_token + act) // 2 + chunk * (ffn + recurrence) + attn_tile
    else:
        capture_transient = c * (own_per_token + act + ffn + recurrence) + attn_tile
    if pc.expert_parallel > 1 and _experts(cfg):
        # the dispatch of one feed-forward call of a capture chunk: its (token, choice) rows out, the rows received,
        # the experts' outputs and the rows brought back (4 buffers of chunk · k rows of the hidden size)
        k = config_value(cfg, "num_experts_per_tok", 1)
        capture_transient += 4 * chunk * k * d["h"] * elem
    r, g = pc.completion_length, pc.num_generations
    # a sharing row's own suffix: a branch's own K/V held while it samples and replays (detached), or more tokens in
    # each replay's graph (exact: the suffix runs with autograd in the response's forward)
    branch = pc.row_suffix * own_per_token
    sampler = branch + g * r * own_per_token + g * d["vocab"] * 4 * 2
    # each replay's graph (`longstraw.model.chunking.replay_graph_bytes`); per layer and token, what autograd saves
    graph = elem * (8 * d["h"] + 3 * d["q"] + 4 * d["kv"] + 6 * d["i"])
    replayed = r + pc.row_suffix if pc.prompt_grad == "exact" else r
    replay_graph = replay_graph_bytes(cfg, kinds, elem, replayed, r, pc.checkpoint_layers)
    # k responses replayed together hold k graphs (the LM head's chunk once)
    head_chunk = 4 * min(r, 1024) * min(d["vocab"], 32768)
    replay_graph = min(pc.replay_batch, g) * (replay_graph - head_chunk) + head_chunk
    if pc.prompt_grad == "detached":
        replay_graph += branch
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
    note = position_note(cfg, pc.prompt_length + pc.row_suffix)
    if note is not None:
        notes.append(note)
    fits = None if pc.device_memory_gib is None else peak <= pc.device_memory_gib * 2**30
    suggestions = _suggest(pc, fits, state, capture_transient, replay_graph, chunk_size)
    # a vLLM server: the model's weights (unsharded) and the K/V of the prompt and the G samples, in one process
    vllm_bytes = n_params * elem + _durable(cfg, kinds, pc.prompt_length + g * r, elem, None)
    choice = choose_backend(
        pc.prompt_length, r, vllm_bytes, None if pc.device_memory_gib is None else int(pc.device_memory_gib * 2**30)
    )
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
        choice.backend,
        choice.reason,
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
