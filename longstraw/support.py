"""Which models longstraw serves: decided by capability, not by name.

A model is served when every decoder layer's token mixer maps to a longstraw layer kind
(`longstraw.layers`) and its attention runs through transformers' attention interface (where
longstraw's split attention takes over). `check_capability` decides that from the config and the
module classes, before any state is allocated, and names what it cannot represent. Whether the
numbers then agree with the unmodified model is the self-check's job (`longstraw.check`), run at
first use for every configuration outside the tested families (`longstraw.archs`).

Where each layer's window comes from (transformers 5.24):
- `config.layer_types` when the config has it (Qwen2 derives it from `use_sliding_window` /
  `max_window_layers`; Gemma, OLMo 3, gpt-oss, Cohere 2 list it; Llama 4 names `chunked_attention`);
- otherwise every layer slides when `config.sliding_window` is set (Mistral, Mixtral, Phi-3,
  StarCoder 2: their models pick the sliding mask for all layers from that field alone);
- a family spec may rename layer types where the name does not say what the layer keeps (MLA).
"""

from __future__ import annotations

import functools
import inspect
import sys

import transformers
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from .archs import FAMILIES, family
from .layers import layer_kind, registered_layer_types
from .models import ModelParts, UnsupportedArchitectureError, base_model, decoder_of, text_config

#: layer kinds whose attention math goes through transformers' attention interface
_INTERFACE_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
#: layer kinds that keep MLA latents (their attention module gets a stand-in, `longstraw.prepare`)
LATENT_KINDS = ("latent_attention", "indexed_attention")


def tested_families() -> list[str]:
    return sorted(FAMILIES) + sorted(f.wrapper[0] for f in FAMILIES.values() if f.wrapper)


def _families_hint() -> str:
    return f"tested families: {', '.join(tested_families())}"


def layer_plan(cfg: PreTrainedConfig) -> list[str]:
    """The longstraw layer kind of each decoder layer, read from wherever the config keeps it."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        window = getattr(cfg, "sliding_window", None)
        sliding = bool(window) and getattr(cfg, "use_sliding_window", True) is not False
        types = ["sliding_attention" if sliding else "full_attention"] * cfg.num_hidden_layers
    fam = family(cfg.model_type)
    kinds = fam.layer_kinds if fam is not None else {}
    plan = [kinds.get(t, t) for t in types]
    if fam is None and getattr(cfg, "kv_lora_rank", None) and "full_attention" in plan:
        # an MLA model of a family longstraw has no spec for: its layers would be read as plain K/V
        raise UnsupportedArchitectureError(
            f"{cfg.model_type!r} uses multi-head latent attention (kv_lora_rank={cfg.kv_lora_rank}) but longstraw has "
            f"no family spec for it (its rotary function and latent layout); {_families_hint()}")
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
    return tuple(sorted(name for name, obj in vars(mod).items()
                        if isinstance(obj, type) and issubclass(obj, Cache) and obj.__module__ == module_name))


def _attention_module(block):
    for name in ("self_attn", "attention", "attn", "mixer"):  # Nemotron-H: `mixer`
        module = getattr(block, name, None)
        if module is not None:
            return module
    return None


def check_capability(model) -> PreTrainedConfig:
    """The text config of `model` if longstraw can represent every decoder layer of it; otherwise
    `UnsupportedArchitectureError` naming the layer type, class or variant it cannot, and the tested families."""
    base = base_model(model)
    if not isinstance(base, transformers.PreTrainedModel):
        raise UnsupportedArchitectureError(
            f"{type(base).__name__} is not a transformers PreTrainedModel; longstraw runs transformers causal LMs")
    cls = type(base)
    if cls.__module__.startswith("transformers_modules"):
        raise UnsupportedArchitectureError(
            f"{cls.__name__} is remote code (trust_remote_code); longstraw runs transformers' own model classes, "
            f"whose cache and attention interfaces it plugs into; {_families_hint()}")
    own = _own_cache_classes(cls.__module__)
    if own:
        raise UnsupportedArchitectureError(
            f"{cls.__name__} keeps its state in a cache class of its own ({', '.join(own)}), outside the transformers "
            f"Cache layers longstraw replaces; {_families_hint()}")
    cfg = text_config(model)
    try:
        decoder = decoder_of(base)
    except Exception as err:  # noqa: BLE001 - any failure means there is no decoder to run
        raise UnsupportedArchitectureError(f"{cls.__name__} has no decoder stack (get_decoder: {err})") from None
    blocks = getattr(decoder, "layers", None)
    plan = layer_plan(cfg)
    if blocks is None or len(blocks) != len(plan):
        raise UnsupportedArchitectureError(
            f"{cls.__name__}: expected {len(plan)} decoder layers in `{type(decoder).__name__}.layers`")
    known = registered_layer_types()
    for i, (kind, block) in enumerate(zip(plan, blocks)):
        if kind not in known:
            raise UnsupportedArchitectureError(
                f"{cfg.model_type!r} layer {i} is of type {kind!r}, which longstraw has no durable state for "
                f"(layer kinds: {', '.join(sorted(known))}); {_families_hint()}")
        if kind in _INTERFACE_KINDS:
            attn = _attention_module(block)
            if attn is None or not _uses_attention_interface(type(attn)):
                what = type(block).__name__ if attn is None else type(attn).__name__
                raise UnsupportedArchitectureError(
                    f"{cfg.model_type!r} layer {i} ({kind}): {what} does not run its attention through transformers' "
                    f"attention interface, so longstraw cannot read the prompt state there; {_families_hint()}")
        if kind in LATENT_KINDS and (family(cfg.model_type) is None or family(cfg.model_type).latent_rotary is None):
            raise UnsupportedArchitectureError(
                f"{cfg.model_type!r} layer {i} is latent attention without a family spec; {_families_hint()}")
    shared = getattr(cfg, "num_kv_shared_layers", 0) or 0
    if shared:
        raise UnsupportedArchitectureError(
            f"{cfg.model_type!r} shares K/V across its last {shared} layers (num_kv_shared_layers), which longstraw "
            "does not represent yet")
    return cfg


def model_parts(model) -> ModelParts:
    """Decoder, LM head and logit transforms of a servable `model` (`check_capability` first)."""
    cfg = check_capability(model)
    base = base_model(model)
    scale, softcap = head_transform(cfg)
    from .prepare import model_configs

    return ModelParts(model=base, decoder=decoder_of(base), lm_head=base.get_output_embeddings(), config=cfg,
                      final_logit_softcapping=softcap, logit_scale=scale, configs=model_configs(base))


def layer_states(cfg: PreTrainedConfig, capacity: int) -> list:
    """A fresh durable state per decoder layer for a prompt of `capacity` captured tokens."""
    return [layer_kind(kind)(cfg, i, capacity) for i, kind in enumerate(layer_plan(cfg))]
