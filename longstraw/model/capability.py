"""Which models longstraw serves: decided by capability, not by name.

A model is served when every decoder layer's token mixer maps to a longstraw layer kind
(`longstraw.kinds`) and its attention runs through transformers' attention interface (where
longstraw's split attention takes over). `check_capability` decides that from the config and the
module classes, before any state is allocated, and names what it cannot represent. Whether the
numbers then agree with the unmodified model is the self-check's job (`longstraw.check`), run at
first use for every configuration outside the tested families (`longstraw.archs`).

Where each layer's window comes from (transformers 5.24):
- `config.layer_types` when the config has it (Qwen2 derives it from `use_sliding_window` /
  `max_window_layers`; Gemma, OLMo 3, gpt-oss, Cohere 2 list it; Llama 4 names `chunked_attention`);
- otherwise every layer slides when `config.sliding_window` is set (Mistral, Mixtral, Phi-3,
  StarCoder 2: their models pick the sliding mask for all layers from that field alone);
- a family spec may rename layer types where the name does not say what the layer keeps (MLA);
- then what each layer's attention module passes to the attention interface wins (`longstraw.model.observe`, one
  4-token forward): a layer the config calls sliding whose module passes no `sliding_window` is full attention (a
  field its architecture never reads), one whose module passes a window is sliding, and a window that differs
  from the config's is refused naming the layer and both values.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Sequence

import transformers
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from ..archs import FAMILIES, family
from ..errors import UnsupportedArchitectureError
from ..hf.parts import ModelParts, attention_module, base_model, decoder_of, model_configs, text_config
from ..kinds import layer_kind, registered_layer_types
from .observe import MAX_PROBE, PROBE_TOKENS, observe_attention


def tested_families() -> list[str]:
    return sorted(FAMILIES) + sorted(f.wrapper[0] for f in FAMILIES.values() if f.wrapper)


def _families_hint() -> str:
    return f"tested families: {', '.join(tested_families())}"


def config_layer_types(cfg: PreTrainedConfig) -> list[str]:
    """Each decoder layer's type as the config alone says it (`layer_types`, else `sliding_window` on every layer)."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        window = getattr(cfg, "sliding_window", None)
        sliding = bool(window) and getattr(cfg, "use_sliding_window", True) is not False
        types = ["sliding_attention" if sliding else "full_attention"] * cfg.num_hidden_layers
    return list(types)


def _observed_types(cfg: PreTrainedConfig, types: list[str], observed: dict) -> list[str]:
    """`types` corrected by the observed attention calls (`longstraw.model.observe`): a layer's window is the
    `sliding_window` its module passes or the window its mask shows; where those two disagree, or the window is not
    the config's `sliding_window` (the one window longstraw's states keep), the model is refused naming the layer
    and both values."""
    out = list(types)
    declared = getattr(cfg, "sliding_window", None)
    for i, call in observed.items():
        if i >= len(out):
            continue
        if out[i] not in ("full_attention", "sliding_attention"):
            continue  # chunked (Llama 4: the config's chunk, checked against the mask's by the self-check), latent, ...
        where = f"{cfg.model_type!r} layer {i} ({out[i]})"
        if call.mask in ("chunk", "other"):
            raise UnsupportedArchitectureError(
                f"{where}: its attention mask is a {call.mask} pattern (span {call.mask_span}) that the config's layer "
                "plan does not describe"
            )
        arg = call.sliding_window
        shown = call.mask_span if call.mask == "window" else None
        if (
            arg is not None
            and call.mask is not None
            and shown != arg
            and (call.mask != "causal" or _probe_covers(cfg, arg))
        ):
            raise UnsupportedArchitectureError(
                f"{where}: its attention module passes sliding_window={arg} but its mask shows "
                f"{'no window' if shown is None else f'a window of {shown}'}; which one the model applies depends on "
                "its attention implementation"
            )
        window = arg if arg is not None else shown
        if window is None:
            out[i] = "full_attention"  # e.g. a `sliding_window` field the architecture never reads
            continue
        if not declared or int(declared) != window:
            raise UnsupportedArchitectureError(
                f"{where}: the layer attends within a window of {window} but the config's sliding_window is "
                f"{declared!r}; longstraw keeps one window per model"
            )
        out[i] = "sliding_attention"
    return out


def _probe_covers(cfg, window: int) -> bool:
    """Whether the probe forward (`longstraw.model.observe`) was long enough for a window of `window` to show."""

    declared = max([int(getattr(cfg, n, 0) or 0) for n in ("sliding_window", "attention_chunk_size")] + [0])
    return max(PROBE_TOKENS, min(declared + 2, MAX_PROBE)) >= window + 2


def model_layer_types(model) -> list[str]:
    """Each decoder layer's transformers layer type as `model` runs it: the config's, corrected by the observed
    attention calls (before any family renames them to longstraw kinds)."""

    cfg = text_config(model)
    return _observed_types(cfg, config_layer_types(cfg), observe_attention(model))


def layer_plan(cfg: PreTrainedConfig, observed: dict | None = None) -> list[str]:
    """The longstraw layer kind of each decoder layer, read from wherever the config keeps it, corrected by what the
    layers' attention modules were observed to pass (`observed`: `longstraw.model.observe.observe_attention`; None:
    the config alone, as `longstraw plan` reads a config without weights)."""
    types = config_layer_types(cfg)
    if observed is not None:
        types = _observed_types(cfg, types, observed)
    fam = family(cfg.model_type)
    kinds = fam.layer_kinds if fam is not None else {}
    plan = [kinds.get(t, t) for t in types]
    if fam is None and getattr(cfg, "kv_lora_rank", None) and "full_attention" in plan:
        # an MLA model of a family longstraw has no spec for: its layers would be read as plain K/V
        raise UnsupportedArchitectureError(
            f"{cfg.model_type!r} uses multi-head latent attention (kv_lora_rank={cfg.kv_lora_rank}) but longstraw has "
            f"no family spec for it (its rotary function and latent layout); {_families_hint()}"
        )
    return plan


def head_transform(cfg: PreTrainedConfig) -> tuple[float | None, float | None]:
    """(logit scale, final softcap) the causal-LM class applies to the LM head's output (transformers 5.24:
    Cohere multiplies by `logit_scale`, Granite divides by `logits_scaling`, Gemma 2-4 softcap)."""
    scale = 1.0
    if getattr(cfg, "logit_scale", None) is not None:
        scale *= float(cfg.logit_scale)
    if getattr(cfg, "logits_scaling", None) is not None:
        scale /= float(cfg.logits_scaling)
    if getattr(cfg, "output_multiplier", None) is not None:
        scale *= float(cfg.output_multiplier)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return (None if scale == 1.0 else scale), (None if not softcap else float(softcap))


@functools.cache
def _uses_attention_interface(cls) -> bool:
    """Whether an attention module class dispatches its attention through `ALL_ATTENTION_FUNCTIONS`."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


@functools.cache
def _own_cache_classes(module_name: str) -> tuple[str, ...]:
    """Cache classes a modeling module defines for itself (a model that keeps state outside the Cache API)."""
    mod = sys.modules.get(module_name)
    if mod is None:
        return ()
    return tuple(
        sorted(
            name
            for name, obj in vars(mod).items()
            if isinstance(obj, type) and issubclass(obj, Cache) and obj.__module__ == module_name
        )
    )


def check_capability(model) -> PreTrainedConfig:
    """The text config of `model` if longstraw can represent every decoder layer of it; otherwise
    `UnsupportedArchitectureError` naming the layer type, class or variant it cannot, and the tested families."""
    base = base_model(model)
    if not isinstance(base, transformers.PreTrainedModel):
        raise UnsupportedArchitectureError(
            f"{type(base).__name__} is not a transformers PreTrainedModel; longstraw runs transformers causal LMs"
        )
    cls = type(base)
    if cls.__module__.startswith("transformers_modules"):
        raise UnsupportedArchitectureError(
            f"{cls.__name__} is remote code (trust_remote_code); longstraw runs transformers' own model classes, "
            f"whose cache and attention interfaces it plugs into; {_families_hint()}"
        )
    own = _own_cache_classes(cls.__module__)
    if own:
        raise UnsupportedArchitectureError(
            f"{cls.__name__} keeps its state in a cache class of its own ({', '.join(own)}), outside the transformers "
            f"Cache layers longstraw replaces; {_families_hint()}"
        )
    cfg = text_config(model)
    try:
        decoder = decoder_of(base)
    except Exception as err:  # noqa: BLE001 - any failure means there is no decoder to run
        raise UnsupportedArchitectureError(f"{cls.__name__} has no decoder stack (get_decoder: {err})") from None
    blocks = getattr(decoder, "layers", None)
    if blocks is None or len(blocks) != cfg.num_hidden_layers:
        raise UnsupportedArchitectureError(
            f"{cls.__name__}: expected {cfg.num_hidden_layers} decoder layers in `{type(decoder).__name__}.layers`"
        )
    _check_kinds(cfg, layer_plan(cfg))  # layer types the config names, before running the model
    _check_layers(cfg, model_plan(model), blocks)  # each layer as its attention calls say it runs
    shared = getattr(cfg, "num_kv_shared_layers", 0) or 0
    if shared:
        raise UnsupportedArchitectureError(
            f"{cfg.model_type!r} shares K/V across its last {shared} layers (num_kv_shared_layers), which longstraw "
            "does not represent yet"
        )
    return cfg


def _check_kinds(cfg, plan: list[str]) -> None:
    known = registered_layer_types()
    for i, kind in enumerate(plan):
        if kind not in known:
            raise UnsupportedArchitectureError(
                f"{cfg.model_type!r} layer {i} is of type {kind!r}, which longstraw has no durable state for "
                f"(layer kinds: {', '.join(sorted(known))}); {_families_hint()}"
            )


def _check_layers(cfg, plan: list[str], blocks) -> None:
    _check_kinds(cfg, plan)
    fam = family(cfg.model_type)
    for i, (kind, block) in enumerate(zip(plan, blocks)):
        state = layer_kind(kind)
        if state.uses_attention_interface:
            attn = attention_module(block)
            # ignored below: a class is hashable; mypy checks type[X] against `Hashable` as if it were an instance
            if attn is None or not _uses_attention_interface(type(attn)):  # type: ignore[arg-type]
                what = type(block).__name__ if attn is None else type(attn).__name__
                raise UnsupportedArchitectureError(
                    f"{cfg.model_type!r} layer {i} ({kind}): {what} does not run its attention through transformers' "
                    f"attention interface, so longstraw cannot read the prompt state there; {_families_hint()}"
                )
        reason = state.check_layer(cfg, i, block, fam)
        if reason is not None:
            raise UnsupportedArchitectureError(f"{cfg.model_type!r} layer {i} ({kind}): {reason}; {_families_hint()}")


def model_plan(model) -> list[str]:
    """The layer plan of `model`: its config's, corrected by what its attention modules pass (`layer_plan`)."""

    return layer_plan(text_config(model), observe_attention(model))


#: the attention implementations the tested families were tested with; any other (a function a user registered
#: with `AttentionInterface.register`) is self-checked first, since longstraw's attention takes its place
STANDARD_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def untested_because(model, parts: ModelParts | None = None) -> str | None:
    """Why `model`'s configuration is outside what was tested (so `capture` self-checks it first), or None: a family
    outside `longstraw.archs`, an attention implementation outside `STANDARD_ATTENTION`, or a layer plan that the
    attention calls changed (the config says something its modules do not do)."""
    parts = parts or model_parts(model)
    cfg = parts.config
    if family(cfg.model_type) is None:
        return f"{cfg.model_type!r} is not a tested family"
    implementations = sorted(
        {c._attn_implementation for c in parts.configs if c._attn_implementation} or {cfg._attn_implementation}
    )
    other = [name for name in implementations if name not in STANDARD_ATTENTION]
    if other:
        return f"attention implementation {other[0]!r} (tested: {', '.join(STANDARD_ATTENTION)})"
    if list(parts.plan) != layer_plan(cfg):
        return "its attention calls differ from its config's layer plan"
    return None


def model_parts(model) -> ModelParts:
    """Decoder, LM head and logit transforms of a servable `model` (`check_capability` first)."""
    cfg = check_capability(model)
    base = base_model(model)
    scale, softcap = head_transform(cfg)

    return ModelParts(
        model=base,
        decoder=decoder_of(base),
        lm_head=base.get_output_embeddings(),
        config=cfg,
        final_logit_softcapping=softcap,
        logit_scale=scale,
        configs=model_configs(base),
        plan=model_plan(model),
    )


def layer_states(cfg: PreTrainedConfig, capacity: int, plan: Sequence[str] | None = None) -> list:
    """A fresh durable state per decoder layer for a prompt of `capacity` captured tokens (`plan`: the model's layer
    plan, `ModelParts.plan`; None: the config's)."""
    return [layer_kind(kind)(cfg, i, capacity) for i, kind in enumerate(plan or layer_plan(cfg))]
