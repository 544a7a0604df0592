"""The built-in demos: `longstraw demo` (a tiny model learns key-value retrieval from long prompts, `DEMO_CONFIG`) and
`longstraw demo --real` (a real pretrained model learns to read a long document, `REAL_DEMO_CONFIG`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from ..tasks.documents import write_document_task
from ..tools.real_models import model_path
from ..train.config import TrainConfig
from .flags import config_overrides
from .training import launch, rank, report, run_training

#: The built-in demo: a 2-layer llama-style model (hidden 64) learns key-value retrieval, first
#: supervised (full sequence, every pair rehearsed once in the prompt: 4 answers per prompt instead of
#: 1) while prompts grow from 22 to 1,024 tokens of filler-separated pairs, then with GRPO at 1,024
#: tokens. In our trials the retrieval circuit formed within ~1,500 steps with an initialisation scale
#: of 0.05 and lr 1e-3, and not at all with transformers' default 0.02 or lr 2e-3 in the same budget.
DEMO_CONFIG: dict[str, Any] = dict(
    model="llama",
    model_overrides={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "initializer_range": 0.05,
    },
    output_dir="runs/demo",
    task="kv_retrieval",
    task_options={"num_pairs": 4, "num_values": 16, "num_keys": 32},
    lora=False,
    curriculum=[22, 64, 256, 1024],
    curriculum_steps=[1500, 500, 400],
    sft_warmup_steps=2400,
    num_steps=2460,
    prompts_per_step=32,
    num_generations=8,
    max_completion_length=1,
    restrict_to_answer_tokens=True,
    learning_rate=1e-3,
    eval_every=600,
    eval_lengths=[64, 256, 1024],
    eval_examples=64,
    # ~2,500 short steps of 256 completions each: a completions file per step would be ~120 MB, a printout per step
    # a flood; the demo's progress bar and final table say what it learned
    log_completions=False,
    num_completions_to_print=0,
    save_every=100,
    threads=2,
)


#: `longstraw demo --real`: SmolLM2-135M-Instruct (`longstraw real smollm2`, installed on first use) with a LoRA
#: adapter learns the needle variant of `longstraw.tasks.documents` — a 4-digit access code hidden at a random depth
#: in ~`REAL_DEMO_LENGTH` tokens of the standard library's docstrings, asked for at the end, in chat form, reward
#: `contains_answer` — held-out greedy accuracy measured before the first step and after the last (`eval.json`).
#: The base model answers about 6 in 10 rows at 6K tokens and nearly all at 2K (bench/real_learning_curve.py).
REAL_DEMO_CONFIG = dict(
    output_dir="runs/demo-real",
    reward_funcs=["contains_answer"],
    lora=True,
    lora_r=16,
    lora_alpha=32,
    num_generations=8,
    prompts_per_step=2,
    num_steps=12,
    max_completion_length=16,
    learning_rate=1e-4,
    eval_examples=16,
    eval_at_start=True,
    num_completions_to_print=1,
    save_every=4,
    threads=2,
)
REAL_DEMO_LENGTH = 4096


def real_demo_config(overrides: dict | None = None, length: int = REAL_DEMO_LENGTH, variant: str = "needle"):
    """The `demo --real` config: the real model's folder, and the documents task written into OUTPUT/data (train rows
    for every step, `eval_examples` held-out rows of other seeds) unless it is there from an earlier run."""
    values = {**REAL_DEMO_CONFIG, **(overrides or {})}
    path = model_path("smollm2")
    data = Path(values["output_dir"]) / "data"
    train, held = data / "train.jsonl", data / f"eval-{length}.jsonl"
    if not (train.exists() and held.exists()):
        rows = max(1, values["num_steps"]) * values["prompts_per_step"]
        write_document_task(AutoTokenizer.from_pretrained(path), data, [length], rows, values["eval_examples"], variant)
    values.update(model=str(path), dataset=str(train), eval_dataset=str(held), eval_fraction=0.0)
    return TrainConfig.from_dict(values)


def cmd_demo_real(args) -> int:
    try:
        cfg = real_demo_config(config_overrides(args), args.length, args.variant)
    except RuntimeError as err:  # the model could not be installed
        print(f"longstraw: error: {err}", file=sys.stderr)
        return 1
    print(
        f"longstraw demo --real: SmolLM2-135M-Instruct with a LoRA adapter (r {cfg.lora_r}) learns to find a code "
        f"hidden in {args.length:,}-token documents ({args.variant}); {cfg.num_steps} GRPO steps of "
        f"{cfg.prompts_per_step} prompts x G={cfg.num_generations}, {cfg.eval_examples} held-out rows scored before "
        f"and after. Output: {cfg.output_dir}\n"
    )
    t0 = time.perf_counter()
    trainer, accuracy = run_training(cfg)
    print(f"\nheld-out greedy accuracy after {time.perf_counter() - t0:.0f} s:\n")
    print(report(trainer, accuracy, **trainer.eval_summary))
    print(f"\noutput: {cfg.output_dir} (adapter/, metrics.jsonl, completions/, eval.json, plots)")
    return 0


def demo_config(overrides: dict | None = None):
    values = dict(DEMO_CONFIG)
    values.update(overrides or {})
    return TrainConfig.from_dict(values)


def cmd_demo(args) -> int:
    if args.real:
        if args.nproc != 1:
            print("longstraw: error: demo --real runs in one process", file=sys.stderr)
            return 2
        return cmd_demo_real(args)
    overrides = config_overrides(args)
    launched = launch(args, demo_config(overrides))  # (the config is checked before any rank starts)
    if launched is not None:
        return launched
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks_here > 1 and "threads" not in overrides:  # the demo's threads are meant for the whole machine
        overrides["threads"] = max(1, DEMO_CONFIG["threads"] // ranks_here)
    cfg = demo_config(overrides)
    if rank() != 0:
        run_training(cfg)
        return 0
    print(
        f"longstraw demo: a {cfg.model} model learns key-value retrieval ({cfg.task_options['num_pairs']} pairs, "
        f"{cfg.task_options['num_values']} values) with prompts growing {cfg.curriculum} tokens; "
        f"{cfg.sft_warmup_steps} supervised warm-up steps then GRPO (G={cfg.num_generations}). "
        f"Output: {cfg.output_dir}\n"
    )
    t0 = time.perf_counter()
    trainer, accuracy = run_training(cfg)
    print(
        f"\nheld-out greedy accuracy after {time.perf_counter() - t0:.0f} s ({cfg.eval_examples} prompts per length):\n"
    )
    print(report(trainer, accuracy, **trainer.eval_summary))
    base = max(trainer.baselines().values(), default=0.0)
    long = {int(k): v for k, v in accuracy.items() if k.isdigit() and int(k) >= 1024}
    if long and base > 0:
        length, acc = max(long.items())
        print(f"\nat {length} tokens: {acc / base:.1f}x the better baseline ({base:.3f}).")
    return 0
