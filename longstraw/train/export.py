"""The trained model as any tool loads it.

Full fine-tuning → `OUTPUT/model/`: a transformers folder (config.json, generation_config.json,
model.safetensors, the tokenizer files), for `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained`.

LoRA → `OUTPUT/adapter/`: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors, the
tokenizer files), for `PeftModel.from_pretrained(base, "OUTPUT/adapter")`. Its
`base_model_name_or_path` names the base: the model folder the run started from, or, for a built-in
tiny model (random weights that exist nowhere else), `OUTPUT/base/`, written here. With
`merge_adapter: true` the merged model is also written to `OUTPUT/model/` as for full fine-tuning.
"""

from __future__ import annotations

import copy
from pathlib import Path

from .checkpoint import is_peft


def _save_transformers(model, tokenizer, path: Path) -> None:
    gen = getattr(model, "generation_config", None)
    if gen is not None:  # greedy decoding stops where longstraw's sampler stops
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(tokenizer, name, None)
            if value is not None and getattr(gen, name, None) is None:
                setattr(gen, name, value)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def export_model(
    model, tokenizer, out: Path, *, merge_adapter: bool = False, base_model=None, base_path: str | None = None
) -> dict[str, Path]:
    """Write the model's final folders under `out`; returns {"model" | "adapter" | "base": folder}.

    For a PEFT model: `base_path` is the folder of its base weights, or None with `base_model` (the
    freshly built base, e.g. a built-in tiny model) to be written to `out/base`.
    """
    out = Path(out)
    written: dict[str, Path] = {}
    if not is_peft(model):
        _save_transformers(model, tokenizer, out / "model")
        return {"model": out / "model"}
    if base_path is None:
        if base_model is None:
            raise ValueError("a PEFT export needs the base model's folder or the base model itself")
        _save_transformers(base_model, tokenizer, out / "base")
        base_path = str((out / "base").resolve())
        written["base"] = out / "base"
    _save_adapter(model, tokenizer, out / "adapter", base_path)
    written["adapter"] = out / "adapter"
    if merge_adapter:
        # a copy: the trainer's model keeps its adapter (memory: the weights twice, once, at the end)
        merged = copy.deepcopy(model).merge_and_unload()
        _save_transformers(merged, tokenizer, out / "model")
        written["model"] = out / "model"
    return written


def save_model_folder(model, tokenizer, path: Path, *, base_model=None, base_path: str | None = None) -> None:
    """The model in the folder `path` itself, as TRL's `save_model` writes it: a transformers folder, or for a PEFT
    model an adapter folder whose base is `base_path` (or `base_model`, written to `path/base`)."""
    path = Path(path)
    if not is_peft(model):
        _save_transformers(model, tokenizer, path)
        return
    if base_path is None:
        if base_model is None:
            raise ValueError("a PEFT save needs the base model's folder or the base model itself")
        _save_transformers(base_model, tokenizer, path / "base")
        base_path = str((path / "base").resolve())
    _save_adapter(model, tokenizer, path, base_path)


def _save_adapter(model, tokenizer, path: Path, base_path: str) -> None:
    """The adapter and the tokenizer in `path`, its config naming `base_path` (the live config left as it was)."""
    config = model.peft_config[model.active_adapter]
    previous, config.base_model_name_or_path = config.base_model_name_or_path, base_path
    try:
        model.save_pretrained(path)
    finally:
        config.base_model_name_or_path = previous
    tokenizer.save_pretrained(path)
