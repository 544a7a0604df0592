"""The trainer in TRL's shape: `GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)`.

A TRL script changes its import and little else:

    from datasets import load_dataset
    from longstraw import GRPOConfig, GRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer

    dataset = load_dataset("json", data_files="rows.jsonl", split="train")   # a "prompt" column (text or a chat)

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    trainer = GRPOTrainer(
        model="path/to/model",                 # a local folder, or a transformers model object
        reward_funcs=reward_len,
        args=GRPOConfig(output_dir="run", learning_rate=1e-5, longstraw={"chunk_size": 4096}),
        train_dataset=dataset,
    )
    trainer.train()

`GRPOConfig` holds TRL's names for what longstraw does the same way, with TRL 1.16's defaults (learning rate 1e-6,
G = 8, 512 completion tokens, linear decay, seed 42, ...), and `longstraw`: `TrainConfig` fields TRL has no name for
(`chunk_size`, `prompt_grad`, `share_prefixes`, `recapture_every`, `state_dtype`, `threads`, `device`, ...). A
`trl.GRPOConfig` is read the same way; a TRL option longstraw does not do (vLLM generation, fp16, a generation batch
spanning several optimizer steps, ...) is refused by name rather than ignored. How the names map:

- one optimizer step = one generation batch of `per_device_train_batch_size × gradient_accumulation_steps × processes`
  completions, `/ num_generations` prompts (`prompts_per_step`), as in TRL when `steps_per_generation` is its default;
- `max_steps` (or, at -1, `num_train_epochs` over the dataset: ⌊rows / prompts_per_step⌋ · `num_iterations` steps an
  epoch), `save_steps` → `save_every`, `lr_scheduler_type`, `warmup_steps` / `warmup_ratio`, `adam_beta1/2`,
  `gradient_checkpointing` → `checkpoint_layers` (the replay's activation checkpointing), `bf16` → `dtype`;
- `peft_config` → the adapter (none: full fine-tuning, as in TRL); `eval_dataset` → the held-out rows (none: the end
  of the run scores the training rows); `logging_steps` is accepted and moot (metrics.jsonl gets every step).

Datasets: a `datasets.Dataset`, a list of row dicts, or a path (any format of `longstraw.tasks.dataset_files`),
rows as `longstraw.tasks.jsonl` describes them (TRL's conversational `prompt` included); reward functions: callables
with TRL's signature, or longstraw's names and import paths. As TRL's trainer: `train(resume_from_checkpoint=None |
True | path)` (from the start, which an `output_dir` holding a run's checkpoints refuses; from the latest checkpoint;
from `OUTPUT/checkpoint-N` or `OUTPUT/checkpoints/step-N`) returns transformers' `TrainOutput`; each checkpoint
also writes the model where TRL writes it, `OUTPUT/checkpoint-N` (`save_checkpoint`); `state.log_history` holds each
step's metrics (with TRL's names as well: `longstraw.train.metrics.trl_logs`); `save_model(dir)` writes the adapter
(or the model) into `dir` itself; `args` is the config as given.

transformers' `TrainerCallback`s (`callbacks=[...]`, `add_callback`, `pop_callback`, `remove_callback`) are called as
transformers' trainer calls them: `on_init_end` (built), `on_train_begin`; each step `on_step_begin`, `on_step_end`,
`on_log` (`logs`: the step's metrics, with TRL's names, `trl_logs`), `on_save` after a checkpoint; `on_train_end`.
Each gets transformers' `(args, state, control, **kwargs)`: `args` the config as given, `state` the trainer's
`TrainerState` (`global_step` the steps done, `log_history` the logs so far), kwargs `model`, `processing_class`,
`optimizer`, `lr_scheduler`. `control.should_training_stop` set by a callback ends the run after that step (its
checkpoint written), as in transformers; the other `control` flags are moot (every step is logged, checkpoints follow
`save_steps`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import TrainOutput

from ..tasks import Example
from ..tasks.dataset_files import load_rows, table_rows
from ..testing.models import TINY_CONFIGS
from .checkpoint import latest_name
from .config import TrainConfig
from .metrics import trl_logs
from .run_record import IN_MEMORY, non_default_fields
from .trainer import Trainer, check_output_dir

_LR_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


@dataclass
class GRPOConfig:
    """TRL's `GRPOConfig` names (TRL 1.16 defaults) that mean the same here, and `longstraw`: `TrainConfig` fields by
    their own names. Validated at construction; `train_config(...)` gives the `TrainConfig` of a run."""

    output_dir: str | None = None
    learning_rate: float = 1e-6
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    num_generations: int = 8
    max_completion_length: int = 512
    max_steps: int = -1
    num_train_epochs: float = 3.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = 0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    loss_type: str = "dapo"
    scale_rewards: str | bool = "group"
    importance_sampling_level: str = "token"
    mask_truncated_completions: bool = False
    reward_weights: list[float] | None = None
    entropy_coef: float = 0.0
    use_bias_correction_kl: bool = True
    seed: int = 42
    max_grad_norm: float = 1.0
    warmup_steps: int | float = 0
    warmup_ratio: float | None = None
    lr_scheduler_type: str = "linear"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    save_steps: int | float = 500
    logging_steps: int | float = 10
    bf16: bool | None = None
    gradient_checkpointing: bool = False
    report_to: str | list[str] | None = "none"
    log_completions: bool = False
    num_completions_to_print: int | None = None
    use_cpu: bool = False
    use_vllm: bool = False
    #: `TrainConfig` fields with no TRL name, e.g. {"chunk_size": 4096, "share_prefixes": True, "threads": 2}
    longstraw: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _refuse(self, "GRPOConfig")
        own = set(TrainConfig.field_names()) - set(_SET_BY_TRL) - {"model", "dataset", "eval_dataset"}
        bad = sorted(set(self.longstraw) - own)
        if bad:
            named = {k: _SET_BY_TRL[k] for k in bad if k in _SET_BY_TRL}
            raise ValueError(
                f"GRPOConfig.longstraw: {bad} are not TrainConfig fields TRL has no name for"
                + (f" (set them by their TRL names: {named})" if named else "")
                + f"; the fields: {sorted(own)}"
            )
        if self.steps_per_generation not in (None, self.gradient_accumulation_steps):
            raise ValueError(
                "GRPOConfig: steps_per_generation other than gradient_accumulation_steps (one generation batch for "
                "several optimizer steps) is not done by longstraw; for several updates per batch use num_iterations"
            )
        if self.lr_scheduler_type not in _LR_SCHEDULERS:
            raise ValueError(
                f"GRPOConfig: lr_scheduler_type {self.lr_scheduler_type!r}: one of {sorted(_LR_SCHEDULERS)} here"
            )
        reports = _report_to(self.report_to)
        if not set(reports) <= {"tensorboard", "wandb"}:
            raise ValueError(
                f"GRPOConfig: report_to {self.report_to!r}: 'tensorboard', 'wandb' (or 'none') here, named ('all' "
                "is not read)"
            )
        if isinstance(self.save_steps, float) and self.save_steps < 1:
            raise ValueError("GRPOConfig: save_steps as a fraction of the run is not done here: give a step count")
        self.prompts_per_step(1)  # the batch arithmetic is checked now

    def prompts_per_step(self, processes: int) -> int:
        """Prompts of one optimizer step: its generation batch of completions over `num_generations`."""
        batch = self.generation_batch_size or self.per_device_train_batch_size * self.gradient_accumulation_steps
        batch = batch if self.generation_batch_size else batch * processes
        if batch % self.num_generations:
            raise ValueError(
                f"GRPOConfig: the generation batch ({batch} completions: per_device_train_batch_size × "
                f"gradient_accumulation_steps × processes) must be divisible by num_generations "
                f"({self.num_generations})"
            )
        return batch // self.num_generations

    def num_steps(self, rows: int, processes: int) -> int:
        """`max_steps`, or `num_train_epochs` over `rows` dataset rows."""
        if self.max_steps > 0:
            return self.max_steps
        per_epoch = max(rows // self.prompts_per_step(processes), 1) * self.num_iterations
        return max(math.ceil(self.num_train_epochs * per_epoch), 1)

    def train_config(self, model: str, rows: int, lora: dict | None) -> TrainConfig:
        """The `TrainConfig` of a run of `rows` dataset rows on `model` (a folder or a built-in tiny name); `lora`:
        the adapter's rank, alpha and target modules (None: full fine-tuning)."""
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        steps = self.num_steps(rows, processes)
        warmup = self.warmup_steps
        if self.warmup_ratio:
            warmup = math.ceil(self.warmup_ratio * steps)
        elif isinstance(warmup, float) and warmup < 1:  # transformers 5: a float below 1 is a ratio of the run
            warmup = math.ceil(warmup * steps)
        scale = self.scale_rewards
        scale = ("group" if scale else "none") if isinstance(scale, bool) else scale
        values: dict[str, Any] = dict(
            model=model,
            lora=lora is not None,
            **(lora or {}),
            output_dir=self.output_dir or "trainer_output",
            learning_rate=self.learning_rate,
            prompts_per_step=self.prompts_per_step(processes),
            num_generations=self.num_generations,
            max_completion_length=self.max_completion_length,
            num_steps=steps,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
            beta=self.beta,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            num_iterations=self.num_iterations,
            loss_type=self.loss_type,
            scale_rewards=scale,
            importance_sampling_level=self.importance_sampling_level,
            mask_truncated_completions=self.mask_truncated_completions,
            reward_weights=list(self.reward_weights or []),
            entropy_coef=self.entropy_coef,
            use_bias_correction_kl=self.use_bias_correction_kl,
            seed=self.seed,
            max_grad_norm=self.max_grad_norm,
            warmup_steps=int(warmup),
            lr_scheduler=_LR_SCHEDULERS[self.lr_scheduler_type],
            weight_decay=self.weight_decay,
            adam_betas=[self.adam_beta1, self.adam_beta2],
            save_every=int(self.save_steps),
            dtype="auto" if self.bf16 is None else ("bf16" if self.bf16 else "fp32"),
            checkpoint_layers=self.gradient_checkpointing,
            report_to=_report_to(self.report_to),
            log_completions=self.log_completions,
            num_completions_to_print=self.num_completions_to_print or 0,
            **({"device": "cpu"} if self.use_cpu else {}),
            eval_fraction=0.0,  # TRL holds nothing out: without an eval_dataset the end scores the training rows
        )
        values.update(self.longstraw)
        return TrainConfig(**values)

    @classmethod
    def from_trl(cls, args) -> GRPOConfig:
        """This config read from a `trl.GRPOConfig` (or any object with its attribute names); a field set off its
        default that is neither mapped nor moot is refused by name (`refuse_unmapped`)."""
        _refuse(args, "trl.GRPOConfig")
        refuse_unmapped(args)
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values.pop("longstraw", None)
        scheduler = values.get("lr_scheduler_type", "linear")
        values["lr_scheduler_type"] = getattr(scheduler, "value", scheduler)  # transformers' SchedulerType enum
        if values.get("steps_per_generation") is not None:  # TRL fills in both from the batch sizes
            values["generation_batch_size"] = None
        return cls(**values)


#: TRL options longstraw does not implement, with the value that leaves each off (a `trl.GRPOConfig` holds them all)
REFUSED = {
    "use_vllm": False,
    "fp16": False,
    "delta": None,
    "min_p": None,
    "repetition_penalty": 1.0,
    "top_entropy_quantile": 1.0,
    "sync_ref_model": False,
    "use_liger_kernel": False,
    "generation_kwargs": None,
    "num_generations_eval": None,
    "use_adaptive_entropy": False,
    "off_policy_mask_threshold": None,
    "multi_objective_aggregation": "sum_then_normalize",
}

#: `trl.GRPOConfig` fields that change nothing longstraw does, by why (docs/training.md, "TRL's fields"): accepted at
#: any value. Any other field that is neither a `GRPOConfig` field here (mapped) nor in `REFUSED` is refused by name
#: when set off its default (`refuse_unmapped`).
MOOT: dict[str, str] = {
    **dict.fromkeys(
        (
            "logging_strategy",
            "logging_first_step",
            "log_on_each_node",
            "logging_nan_inf_filter",
            "include_num_input_tokens_seen",
            "log_level",
            "log_level_replica",
            "disable_tqdm",
            "run_name",
            "project",
            "trackio_space_id",
            "trackio_bucket_id",
            "trackio_static_space_id",
            "log_multimodal",
            "log_unique_prompts",
            "skip_memory_metrics",
            "debug",
        ),
        "logging: metrics.jsonl gets every step's metrics",
    ),
    **dict.fromkeys(
        (
            "dataloader_drop_last",
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
            "dataloader_multiprocessing_context",
            "dataloader_in_order",
            "remove_unused_columns",
            "label_names",
            "length_column_name",
            "accelerator_config",
            "do_train",
            "do_eval",
            "do_predict",
            "resume_from_checkpoint",
            "local_rank",
            "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb",
            "ddp_broadcast_buffers",
            "ddp_static_graph",
            "restore_callback_states_from_checkpoint",
        ),
        "data loading and launching: rows are drawn from (seed, step), an incomplete last batch of an epoch dropped, "
        "every column reaches the reward functions; `train(resume_from_checkpoint=...)` decides a resume",
    ),
    **dict.fromkeys(
        (
            "eval_steps",
            "eval_delay",
            "per_device_eval_batch_size",
            "prediction_loss_only",
            "eval_do_concat_batches",
            "eval_use_gather_object",
            "eval_accumulation_steps",
            "include_for_metrics",
            "batch_eval_metrics",
            "metric_for_best_model",
            "greater_is_better",
        ),
        "evaluation details, read only with an eval_strategy (which is refused)",
    ),
    **dict.fromkeys(
        ("hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision"),
        "the Hub, read only with push_to_hub (which is refused)",
    ),
    **dict.fromkeys(
        (
            "activation_checkpointing",
            "activation_checkpointing_kwargs",
            "gradient_checkpointing_kwargs",
            "use_cache",
            "cache_implementation",
            "torch_empty_cache_steps",
            "pad_to_multiple_of",
            "ds3_gather_for_generation",
            "use_transformers_continuous_batching",
            "transformers_continuous_batching_config",
            "use_transformers_paged",
        ),
        "the engine: longstraw's own replay checkpointing (gradient_checkpointing) and sampler from one captured state",
    ),
    **{
        name: "read only with use_vllm (which is refused)"
        for name in (
            "vllm_mode",
            "vllm_model_impl",
            "vllm_enable_sleep_mode",
            "vllm_structured_outputs_regex",
            "vllm_server_base_url",
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_group_port",
            "vllm_gpu_memory_utilization",
            "vllm_max_model_length",
            "vllm_tensor_parallel_size",
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_cap",
        )
    },
    **dict.fromkeys(
        ("sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg"),
        "read only by a loss_type longstraw refuses (sapo, vespo)",
    ),
    "vespo_lambda_neg": "read only by a loss_type longstraw refuses (sapo, vespo)",
    **dict.fromkeys(("ref_model_mixup_alpha", "ref_model_sync_steps"), "read only with sync_ref_model (refused)"),
    **dict.fromkeys(
        ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"),
        "read only with use_adaptive_entropy (refused)",
    ),
}

#: values of a field that mean what longstraw does anyway (taken as its default)
_SAME: dict[str, tuple] = {"optim": ("adamw_torch", "adamw_torch_fused")}


def _declared_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def refuse_unmapped(args, what: str = "trl.GRPOConfig") -> None:
    """Refuse, in one line naming them, the fields of a TRL config (a dataclass) set off their declared defaults
    that are neither mapped (`GRPOConfig`'s fields), refused already (`REFUSED`) nor moot (`MOOT`)."""
    if not dataclasses.is_dataclass(args):
        return
    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    off = {}
    for f in dataclasses.fields(args):
        if f.name in ours or f.name in REFUSED or f.name in MOOT or not hasattr(args, f.name):
            continue
        value, default = getattr(args, f.name), _declared_default(f)
        empty: tuple = (None, "", [], {})
        if value == default or (value in empty and default in empty) or value in _SAME.get(f.name, ()):
            continue
        off[f.name] = (value, default)
    if off:
        named = ", ".join(f"{k}={v!r}" for k, (v, _) in off.items())
        back = ", ".join(f"{k}={d!r}" for k, (_, d) in off.items())
        raise ValueError(
            f'{what}: {named}: not done by longstraw (neither mapped nor moot; docs/training.md, "TRL\'s fields"); '
            f"leave {back}"
        )


#: TrainConfig fields set through TRL's names or GRPOTrainer's arguments → that name
_SET_BY_TRL = {
    "output_dir": "output_dir",
    "learning_rate": "learning_rate",
    "num_generations": "num_generations",
    "max_completion_length": "max_completion_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "beta": "beta",
    "epsilon": "epsilon",
    "epsilon_high": "epsilon_high",
    "num_iterations": "num_iterations",
    "loss_type": "loss_type",
    "scale_rewards": "scale_rewards",
    "importance_sampling_level": "importance_sampling_level",
    "mask_truncated_completions": "mask_truncated_completions",
    "reward_weights": "reward_weights",
    "entropy_coef": "entropy_coef",
    "use_bias_correction_kl": "use_bias_correction_kl",
    "seed": "seed",
    "max_grad_norm": "max_grad_norm",
    "warmup_steps": "warmup_steps",
    "lr_scheduler": "lr_scheduler_type",
    "weight_decay": "weight_decay",
    "adam_betas": "adam_beta1, adam_beta2",
    "save_every": "save_steps",
    "dtype": "bf16",
    "checkpoint_layers": "gradient_checkpointing",
    "report_to": "report_to",
    "log_completions": "log_completions",
    "num_completions_to_print": "num_completions_to_print",
    "prompts_per_step": "per_device_train_batch_size",
    "num_steps": "max_steps",
    "reward_funcs": "reward_funcs",
    "lora": "peft_config",
    "lora_r": "peft_config",
    "lora_alpha": "peft_config",
    "lora_target_modules": "peft_config",
    "train_embeddings": "peft_config",
}


def _refuse(args, what: str) -> None:
    """Stop on a TRL option set that longstraw does not do (rather than ignore it)."""
    on = {k: getattr(args, k) for k in REFUSED if hasattr(args, k) and getattr(args, k) != REFUSED[k]}
    if on:
        raise ValueError(f"{what}: {on} not done by longstraw; leave them at { ({k: REFUSED[k] for k in on}) }")


def _report_to(value) -> list[str]:
    if value is None or value == "none" or value == ["none"]:
        return []
    return [value] if isinstance(value, str) else list(value)


def dataset_rows(dataset, tokenizer, where: str, dropped: list[str] | None = None) -> list[Example]:
    """A `datasets.Dataset`, a list of row dicts or a path, as examples; `dropped`: a list to which a refused row's
    reason is added instead of raising (`drop_invalid_rows`)."""
    if isinstance(dataset, str | Path):
        return load_rows(dataset, tokenizer, dropped)
    if isinstance(dataset, dict):
        raise TypeError(f"{where}: a DatasetDict (or a dict): give one split, e.g. dataset['train']")
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"{where}: an iterable dataset has no end to train epochs over: give a Dataset or a list")
    return table_rows(dataset, where, tokenizer, dropped)


def _in_memory(dataset) -> str:
    """How the record names rows handed over in memory."""
    return IN_MEMORY[0] if type(dataset).__name__ == "Dataset" else IN_MEMORY[1]


class _Callbacks(CallbackHandler):
    """transformers' `CallbackHandler` (its `call_event`, `add_callback`, `pop_callback`, `remove_callback`) without
    its warning about a missing `DefaultFlowCallback`: the run's loop decides logging and saving itself."""

    def __init__(self, callbacks, model, processing_class, optimizer, lr_scheduler):
        self.callbacks = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None


class GRPOTrainer(Trainer):
    """`Trainer` built from TRL's arguments (module doc). `model`: a local folder, a built-in tiny name, or a
    transformers model object (trained as it is; its folder, or a copy saved to `OUTPUT/source_model` when it has
    none, is what a resumed run's export reads); `processing_class`: its tokenizer (default: the folder's)."""

    def __init__(
        self,
        model,
        reward_funcs,
        args: GRPOConfig | Any = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        peft_config=None,
        rollout_func=None,
        callbacks=None,
    ):
        given = args
        if args is None:
            args = GRPOConfig()
        elif not isinstance(args, GRPOConfig):
            args = GRPOConfig.from_trl(args)
        if train_dataset is None:
            raise ValueError("GRPOTrainer: train_dataset is required (a Dataset, a list of rows, or a path)")
        check_output_dir(args.output_dir or "trainer_output")
        funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs):  # before any work
            raise ValueError(
                f"GRPOTrainer: reward_weights has {len(args.reward_weights)} weights for {len(funcs)} reward_funcs: "
                "give one weight per reward function, in reward_funcs' order"
            )
        folder, obj = self._model(model, args)
        tok = processing_class
        if tok is None and folder not in TINY_CONFIGS:
            tok = AutoTokenizer.from_pretrained(folder)
        dropped: list[str] | None = [] if args.longstraw.get("drop_invalid_rows") else None
        rows = dataset_rows(train_dataset, tok, "train_dataset", dropped)
        held = None if eval_dataset is None else dataset_rows(eval_dataset, tok, "eval_dataset", dropped)
        lora = None
        if peft_config is not None:
            targets = peft_config.target_modules
            lora = dict(
                lora_r=peft_config.r,
                lora_alpha=int(peft_config.lora_alpha),
                lora_target_modules=sorted(targets) if isinstance(targets, set | list) else targets,
                train_embeddings=bool(peft_config.modules_to_save),
            )
        cfg = args.train_config(folder, len(rows), lora)
        given_data = (("dataset", train_dataset), ("eval_dataset", eval_dataset))
        files: dict[str, Any] = {k: str(v) for k, v in given_data if isinstance(v, str | Path)}
        if files:  # the files themselves, which `longstraw eval RUN` reads again
            cfg = dataclasses.replace(cfg, **files)
        super().__init__(
            cfg,
            reward_funcs=funcs,
            rollout_func=rollout_func,
            model=obj,
            tokenizer=tok,
            peft_config=peft_config,
            rows=rows,
            eval_rows=held,
            dropped=dropped,
            data_source=files.get("dataset") or _in_memory(train_dataset),
        )
        self.record["trl_config"] = non_default_fields(args if given is None else given)
        if len(self.data.rows or []) != len(rows):  # rows dropped by the check (`drop_invalid_rows`)
            self._recount(args.train_config(folder, len(self.data.rows or []), lora))
        #: the config as given, TRL's `trainer.args` (a `trl.GRPOConfig` stays one)
        self.args = args if given is None else given
        #: transformers' `TrainerState`: `global_step`, `max_steps`, and `log_history` (each step's metrics, as in
        #: metrics.jsonl, then the last `train()`'s summary)
        self.state = TrainerState(
            max_steps=self.cfg.num_steps,
            save_steps=cfg.save_every,
            is_local_process_zero=self.ranks.main,
            is_world_process_zero=self.ranks.main,
        )
        #: the checkpoint `train` resumes from: None (none), "" (the latest) or a checkpoint's name ("step-2")
        self._resume: str | None = None
        #: transformers' callbacks (module doc) and the `TrainerControl` they share
        self.callback_handler = _Callbacks(callbacks or [], self.model, tok, self.opt, self.sched)
        self.control = TrainerControl()
        self._saved = False  # whether the step that just ended wrote a checkpoint (`on_save`)
        self.control = self._event("on_init_end")

    def _event(self, name: str, **kwargs) -> TrainerControl:
        return self.callback_handler.call_event(name, self.args, self.state, self.control, **kwargs)

    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """transformers' `add_callback`: a `TrainerCallback` class or instance, called after those given."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> TrainerCallback | None:
        """transformers' `pop_callback`: remove and return the callback (a class: its first instance)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        """transformers' `remove_callback`."""
        self.callback_handler.remove_callback(callback)

    def train_step(self, step: int) -> dict:
        self.control = self._event("on_step_begin")
        return super().train_step(step)

    def save_checkpoint(self) -> Path | None:
        """The run's checkpoint (`OUTPUT/checkpoints/step-N`, what a resume reads) and, where TRL writes its
        checkpoints, the model at this step in `OUTPUT/checkpoint-N`: a PEFT adapter folder
        (`PeftModel.from_pretrained(base, OUTPUT/checkpoint-N)`; a built-in tiny base is written beside it in
        `checkpoint-N/base`) or, with full fine-tuning, a transformers folder (rank 0 writes)."""
        path = super().save_checkpoint()
        if self.ranks.main:
            self.checkpoints.save_model(self.out / f"checkpoint-{self.step}", self.step)
        self._saved = True
        return path

    def _after_step(self, m: dict) -> bool:
        """Each step's events: `on_step_end`, `on_log` (the step's metrics under TRL's names as well, appended to
        `state.log_history`), `on_save` when the step wrote a checkpoint; True when a callback asked to stop."""
        self.state.global_step = self.step
        logs = trl_logs(m)
        self.state.log_history.append(logs)
        self.control = self._event("on_step_end")
        self.control = self._event("on_log", logs=logs)
        if self._saved:
            self._saved = False
            self.control = self._event("on_save")
        return bool(self.control.should_training_stop)

    def _recount(self, counted: TrainConfig) -> None:
        """The step counts of `counted` (epochs over the rows that train, and a warm-up ratio of them) in the run's
        config, which the schedule reads, and the first step's learning rate from it."""
        if (counted.num_steps, counted.warmup_steps) == (self.cfg.num_steps, self.cfg.warmup_steps):
            return
        self.cfg.num_steps, self.cfg.warmup_steps = counted.num_steps, counted.warmup_steps
        lrs = [base * f(0) for base, f in zip(self.sched.base_lrs, self.sched.lr_lambdas)]
        for group, lr in zip(self.opt.param_groups, lrs):
            group["lr"] = lr
        self.sched._last_lr = lrs

    def train(self, resume_from_checkpoint: bool | str | Path | None = None) -> TrainOutput:  # type: ignore[override]
        """TRL's `train`: from the start (None or False), from the latest checkpoint in `output_dir` (True), or from
        one of this run's checkpoints (`OUTPUT/checkpoint-N`, TRL's folder, or `OUTPUT/checkpoints/step-N`). From the
        start in an `output_dir` that holds a run's checkpoints is refused (TRL would train over them). Returns
        transformers' `TrainOutput`; each step's metrics are in `state.log_history` (and metrics.jsonl)."""
        root = self.checkpoints.root
        latest = latest_name(root)
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            if latest is not None:
                raise ValueError(
                    f"GRPOTrainer.train: {self.out} holds a run's checkpoints (the latest: {latest}); pass "
                    "resume_from_checkpoint=True to resume it, or give a new output_dir to start over"
                )
            self._resume = None
        elif resume_from_checkpoint is True:
            if latest is None:
                raise ValueError(
                    f"GRPOTrainer.train: resume_from_checkpoint=True but {root} holds no checkpoint; pass None to "
                    "train from the start"
                )
            self._resume = ""
        else:
            path = Path(resume_from_checkpoint)
            if path.resolve().parent == self.out.resolve() and re.fullmatch(r"checkpoint-\d+", path.name):
                path = root / f"step-{path.name.split('-')[1]}"  # TRL's folder of a step: the run's checkpoint of it
            if path.resolve().parent != root.resolve() or not (path / "trainer_state.json").is_file():
                raise ValueError(
                    f"GRPOTrainer.train: resume_from_checkpoint {path} is not a checkpoint of this run: give one of "
                    f"{self.out}/checkpoint-N, {root}/step-N, or True for the latest"
                )
            self._resume = path.name
        start = time.perf_counter()
        self.state.log_history = []
        self.control = TrainerControl()
        self.control = self._event("on_train_begin")
        rows = super().train(on_step=self._after_step)
        losses = [r["loss"] for r in rows if math.isfinite(r["loss"])]
        summary = {"train_runtime": time.perf_counter() - start, "train_loss": sum(losses) / max(len(losses), 1)}
        metrics = self.out / "metrics.jsonl"  # the whole run's, resumed steps included (rank 0 writes it)
        history = [json.loads(line) for line in metrics.read_text().splitlines()] if self.ranks.main else rows
        self.state.global_step = self.step
        self.state.log_history = [*(trl_logs(m) for m in history), {**summary, "step": self.step}]
        self.control = self._event("on_train_end")
        return TrainOutput(self.step, summary["train_loss"], summary)

    def load_checkpoint(self) -> bool:
        """The checkpoint `train(resume_from_checkpoint=...)` names (none: from the start)."""
        if self._resume is None:
            return False
        step = self.checkpoints.load(self._resume or None)
        if step is None:
            raise ValueError(f"GRPOTrainer.train: {self.checkpoints.root} holds no checkpoint to resume from")
        self.step = self.state.global_step = step
        return True

    def save_model(self, output_dir: str | Path | None = None) -> None:
        """TRL's `save_model`: the model as trained so far in `output_dir` (default: `args.output_dir`) itself, a
        PEFT adapter folder (`PeftModel.from_pretrained(base, output_dir)`) or, with full fine-tuning, a
        transformers folder, with the tokenizer (rank 0 writes)."""
        out = Path(output_dir) if output_dir is not None else self.out
        check_output_dir(out)
        if self.ranks.main:
            self.checkpoints.save_model(out, self.step)

    @staticmethod
    def _model(model, args: GRPOConfig) -> tuple[str, Any]:
        """(the model's folder or built-in name, the model object or None)."""
        if isinstance(model, str | Path):
            name = str(model)
            if name in TINY_CONFIGS or Path(name).is_dir():
                return name, None
            raise ValueError(
                f"GRPOTrainer: model {name!r} is neither a local folder nor a built-in tiny architecture "
                f"{sorted(TINY_CONFIGS)} (no hub downloads: download it first, or pass the model object)"
            )
        if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
            raise TypeError("GRPOTrainer: model must be a folder path or a transformers model object")
        source = getattr(model, "name_or_path", "") or ""
        if source and Path(source).is_dir():
            return source, model
        folder = Path(args.output_dir or "trainer_output") / "source_model"
        model.save_pretrained(folder)  # what an export rebuilds the base from (the object has no folder)
        return str(folder), model
