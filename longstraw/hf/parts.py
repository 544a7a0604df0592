"""How to reach a transformers model's parts: the base model under a PEFT wrapper, the decoder stack, its configs,
each layer's token mixer, the device. A leaf: it imports nothing of longstraw."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import transformers
from transformers import PreTrainedConfig


def base_model(model) -> transformers.PreTrainedModel:
    """The transformers model under an optional PEFT wrapper (adapters stay injected in its modules)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_of(base) -> torch.nn.Module:
    """The decoder stack (the module holding `.layers`) of a transformers causal LM. `get_decoder()` answers the
    model itself where `base_model_prefix` does not name the stack (Llama 4's text model, transformers 5.24)."""
    decoder = base.get_decoder()
    if getattr(decoder, "layers", None) is None:
        for name in ("model", base.base_model_prefix):
            inner = getattr(decoder, name, None)
            if inner is not None and getattr(inner, "layers", None) is not None:
                return inner
    return decoder


def text_config(model) -> PreTrainedConfig:
    return base_model(model).config.get_text_config(decoder=True)


@dataclass
class ModelParts:
    """What capture and replay call: `decoder(input_ids=..., ...)` → hidden `[1, T, hidden]`; `lm_head`."""

    model: torch.nn.Module
    decoder: torch.nn.Module
    lm_head: torch.nn.Module
    config: PreTrainedConfig
    final_logit_softcapping: float | None
    #: every config the model's modules read (`longstraw.model.prepare.model_configs`): a longstraw forward names its
    #: attention implementation on them for its duration
    configs: Sequence[PreTrainedConfig] = ()
    #: factor the causal-LM class multiplies the logits by before softcapping (Cohere's `logit_scale`,
    #: 1 / Granite's `logits_scaling`); None: 1
    logit_scale: float | None = None
    #: the longstraw layer kind of each decoder layer (`longstraw.model.capability.model_plan`: the config's plan
    #: corrected by what the attention modules pass)
    plan: Sequence[str] = ()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits


def model_configs(model) -> list[PreTrainedConfig]:
    """Every distinct config the modules of `model` read (the model's, its sub-configs, per-module ones)."""
    base = base_model(model)
    seen: dict[int, PreTrainedConfig] = {}
    candidates: list[object] = [base.config, base.config.get_text_config(decoder=True)]
    candidates += [getattr(m, "config", None) for m in base.modules()]
    for cfg in candidates:
        if isinstance(cfg, PreTrainedConfig):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


def attention_module(block):
    """The attention (or mixer) module of a decoder layer, or None."""
    for name in ("self_attn", "attention", "attn", "mixer"):  # Nemotron-H: `mixer`
        module = getattr(block, name, None)
        if module is not None:
            return module
    return None


def model_device(model) -> torch.device:
    """The one device all of `model`'s parameters live on; a clear error for the meta device or a model split
    over several devices (which needs a process group: see docs/distributed.md)."""
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ValueError("the model has no parameters")
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            "the model has parameters on the meta device (not loaded): load its weights first, "
            "e.g. from_pretrained(...) without device_map='meta' / init_empty_weights"
        )
    if len(devices) > 1:
        raise ValueError(
            f"the model's parameters are spread over {sorted(map(str, devices))}: longstraw runs a model "
            f"on one device per process; move it with model.to(device)"
        )
    return devices.pop()
