"""What a run is built from before its first step: the model and its tokenizer (a built-in tiny model or a local
folder, LoRA-wrapped with `lora: true`), the reward functions, the learning-rate schedule and the random generators
that sampling draws from (the same for the same (seed, step, prompt), so that a resumed run repeats itself)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ..tasks import build_tokenizer
from ..testing.models import TINY_CONFIGS, tiny_config
from .config import TrainConfig
from .devices import resolve_device, resolve_dtype
from .rewards import RewardSet, resolve_reward


def tiny_base(cfg: TrainConfig, tok, dtype: torch.dtype = torch.float32):
    """The built-in tiny model of `cfg`, random weights drawn from cfg.seed (the same every call)."""
    mcfg = tiny_config(
        cfg.model,
        **{
            **cfg.model_overrides,
            "vocab_size": len(tok),
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
        },
    )
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32).to(dtype)


def build_model_and_tokenizer(cfg: TrainConfig, model=None, tokenizer=None, peft_config=None):
    """(model, tokenizer): a built-in tiny model with the task tokenizer, or a local folder; LoRA-wrapped
    with `lora: true`. `model`: a transformers model object instead (trained in its own dtype, moved to the config's
    device), `tokenizer` its tokenizer (default: the one in `cfg.model`'s folder); `peft_config`: a PEFT config to
    wrap the model with instead of the config's `lora_*` fields. A built-in tiny model always has its task's
    tokenizer."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    tok: PreTrainedTokenizerBase  # the task's word-level tokenizer, or the model folder's
    model_is_tiny = model is None and cfg.model in TINY_CONFIGS
    if model is not None:
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(cfg.model)
    elif cfg.model in TINY_CONFIGS:
        opts = cfg.task_options
        tok = build_tokenizer(
            num_keys=opts.get("num_keys", 64),
            num_values=opts.get("num_values", 16),
            num_filler=opts.get("num_filler", 32),
        )
        model = tiny_base(cfg, tok, dtype)
    else:
        path = Path(cfg.model)
        if not path.is_dir():
            raise ValueError(
                f"model {cfg.model!r} is neither a built-in tiny architecture {sorted(TINY_CONFIGS)} nor a local folder"
            )
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        # a field the config does not have would be kept and never read (a silent no-op): refused by name
        unknown = sorted(k for k in cfg.model_overrides if k not in config.to_dict())
        if unknown:
            raise ValueError(f"model_overrides {unknown}: not fields of {path}'s {config.model_type} config")
        for key, value in cfg.model_overrides.items():  # e.g. RoPE scaling for prompts past the model's positions
            setattr(config, key, value)
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    model = model.to(device)
    apply_chat_format(tok, cfg.chat_template_path, cfg.eos_token, model)
    if tok.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: responses could never stop")
    if peft_config is None and cfg.lora:
        extra = ["embed_tokens", "lm_head"] if cfg.train_embeddings else None
        peft_config = LoraConfig(
            r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=cfg.lora_target_modules, modules_to_save=extra
        )
    if peft_config is not None:
        if model_is_tiny:  # its init, adapter included, follows the seed `tiny_base` set
            model = get_peft_model(model, peft_config)
        else:
            with torch.random.fork_rng(devices=[]):  # the adapter's random init from the seed, whatever ran before
                torch.manual_seed(cfg.seed)
                model = get_peft_model(model, peft_config)
    return model.train(), tok


def apply_chat_format(
    tok: PreTrainedTokenizerBase, chat_template_path: str | None = None, eos_token: str | None = None, model=None
) -> None:
    """`TrainConfig`'s `chat_template_path` and `eos_token` set on `tok` (as TRL's SFTTrainer does), the
    end-of-response token on `model`'s generation config too, so that the saved model's `generate` stops where the
    sampler does. `apply_chat_format(tok, **longstraw.tools.real_models.chat_format(name))` for a tokenizer alone."""
    if chat_template_path:
        path = Path(chat_template_path)
        if path.is_dir():
            template = AutoTokenizer.from_pretrained(path).chat_template
            if not template:
                raise ValueError(f"chat_template_path {path}: the tokenizer in this folder has no chat template")
        elif path.is_file():
            template = path.read_text()
        else:
            raise ValueError(f"chat_template_path {path}: no such file or folder")
        tok.chat_template = template
    if eos_token:
        eos = tok.convert_tokens_to_ids(eos_token)
        if eos is None or (eos == tok.unk_token_id and eos_token != tok.unk_token):
            raise ValueError(f"eos_token {eos_token!r} is not a token of the tokenizer's vocabulary")
        tok.eos_token = eos_token
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.eos_token_id = eos


def reward_set(cfg: TrainConfig, task=None, custom=None) -> RewardSet:
    """`custom` callables (TRL signature) if given, else the config's entries (names or import paths), else
    the built-in `task`'s own reward (`exact_match` for a dataset's rows: `task` None)."""
    entries = list(custom or cfg.reward_funcs or [task.reward if task is not None else "exact_match"])
    funcs = [resolve_reward(e) for e in entries]
    return RewardSet(funcs, list(cfg.reward_weights or [1.0] * len(funcs)))


def lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(cfg.num_steps - cfg.warmup_steps, 1)
        return max(0.0, 1 - progress) if cfg.lr_scheduler == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return f


def generator(seed: int, *parts: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on the model's device (sampling draws where the logits are)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + hash(parts)) % (2**63))
    return g
