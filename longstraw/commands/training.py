"""A training run from the command line: `longstraw train` and `longstraw eval`, `run_training` (train, evaluate, plot:
what the demos run too), the evaluation table they print, and `--nproc N`'s local ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..distributed.ranks import launch_local
from ..testing.models import TINY_CONFIGS
from ..train.config import TrainConfig
from ..train.devices import resolve_device
from ..train.plots import plot_run
from ..train.run_record import eval_refusal
from ..train.trainer import Trainer, check_output_dir
from .flags import config_overrides

if TYPE_CHECKING:
    from ..train.trainer import Trainer


_BASELINE_COLUMNS = {"context_blind": "context-blind 1/V", "positional": "positional shortcut 1/K"}


def report(trainer, accuracy: dict, before: dict | None = None, counts: dict | None = None) -> str:
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


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launch(args, cfg) -> int | None:
    """`--nproc N` (N > 1): run the same command as N local ranks (`longstraw.distributed.ranks.launch_local`) and
    return its exit status; None when this process is to train itself."""
    if args.nproc <= 1:
        return None
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
    cfg = TrainConfig.from_yaml(args.config, config_overrides(args))  # checked before any rank starts
    check_output_dir(cfg.output_dir)
    launched = launch(args, cfg)
    if launched is not None:
        return launched
    trainer, accuracy = run_training(cfg)
    if not trainer.ranks.main:
        return 0
    print(report(trainer, accuracy, **trainer.eval_summary))
    final = "model/" if not cfg.lora else ("adapter/, base/" if cfg.model in _tiny_names() else "adapter/")
    if cfg.lora and cfg.merge_adapter:
        final += ", model/ (merged)"
    print(f"\noutput: {cfg.output_dir} ({final}, metrics.jsonl, eval.json, checkpoints/, plots)")
    return 0


def _tiny_names():
    return TINY_CONFIGS


def cmd_eval(args) -> int:
    run = Path(args.run)
    if not (run / "config.yaml").exists():
        raise SystemExit(f"{run} holds no config.yaml: not a longstraw run folder")
    record = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("record")
    dataset, rewards = getattr(args, "dataset", None), getattr(args, "reward", None)
    refusal = None if record is None else eval_refusal(run, record, dataset, rewards)
    if refusal is not None:
        raise SystemExit(refusal)
    overrides: dict = {"output_dir": str(run), "progress": False}
    if args.state_dtype is not None:
        overrides["state_dtype"] = None if args.state_dtype == "none" else args.state_dtype
    if dataset is not None:
        overrides.update(dataset=dataset, eval_dataset=None, eval_fraction=0.0)
    if rewards is not None:
        overrides["reward_funcs"] = rewards
    cfg = TrainConfig.from_yaml(run / "config.yaml", overrides)
    trainer = Trainer(cfg)
    for key, flag in (
        ("data", "--dataset FILE holding the rows it trained on"),
        ("eval_data", "eval_dataset back the rows it held out"),
    ):
        was, now = (record or {}).get(key) or {}, trainer.record.get(key) or {}
        if "sha256" in was and "sha256" in now and was["sha256"] != now["sha256"]:
            raise SystemExit(
                f"{run} ran on {was['source']} ({was['rows']} rows, sha256 {was['sha256'][:12]}); "
                f"{now['source']} holds other rows ({now['rows']} rows, sha256 {now['sha256'][:12]}): give {flag}"
            )
    if not trainer.load_checkpoint():
        raise SystemExit(f"{run} holds no checkpoint to evaluate")
    accuracy = trainer.evaluate(args.lengths, args.examples)
    print(report(trainer, accuracy))
    return 0
