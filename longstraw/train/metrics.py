"""Where a step's metrics go: `metrics.jsonl` (always), a progress bar, TensorBoard and Weights & Biases
(`report_to`); what the model wrote: `completions/step-N.jsonl` per GRPO step (`log_completions`), a few of them on
the console (`num_completions_to_print`), TensorBoard text; and TRL's names of the metrics TRL logs alike (`trl_logs`).

`metrics.jsonl` holds one JSON object per optimizer step. On resume, rows of steps after the
checkpoint (written by the interrupted run, to be redone) are dropped first. TensorBoard event files go
to `OUTPUT/tensorboard/` when `report_to: [tensorboard]` and `torch.utils.tensorboard` can be imported
(the `tensorboard` package; not a dependency of longstraw).

`report_to: [wandb]` (the `wandb` package; not a dependency either) logs each step's numbers as transformers' wandb
callback does for TRL: under `train/<name>`, TRL's names included (`trl_logs`), at wandb step
= the optimizer step. Its run files go to `OUTPUT/wandb/` (`WANDB_MODE=offline` keeps them there, for `wandb sync`
later); the project is `WANDB_PROJECT` (default "longstraw"), the run's name `output_dir`'s folder name, and a resumed
run continues the same wandb run (its id kept in `OUTPUT/wandb/run_id`).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from tqdm import tqdm

#: longstraw's metric name -> TRL 1.16's (`GRPOTrainer._metrics`), where TRL logs the same quantity
TRL_NAMES = {
    "completion_length": "completions/mean_length",
    "truncated_frac": "completions/clipped_ratio",
    "clip_ratio": "clip_ratio/region_mean",
    "lr": "learning_rate",
}


def trl_logs(metrics: dict) -> dict:
    """A step's metrics (a metrics.jsonl row) with TRL's names as well: each of `TRL_NAMES` also under TRL's name;
    `reward`, `reward_std`, `frac_reward_zero_std`, `kl`, `entropy`, `loss`, `grad_norm` and
    `rewards/<name>/mean|std` are TRL's names already; longstraw's own (`time_*`, `durable_bytes`, ...) as they are."""
    return {**metrics, **{TRL_NAMES[k]: v for k, v in metrics.items() if k in TRL_NAMES}}


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep the metrics of steps ≤ last_step (the ones a resumed run does not redo)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interruption
        if row.get("step", 0) <= last_step:
            keep.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(x + "\n" for x in keep))
    os.replace(tmp, path)


def tensorboard_available() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


class MetricsWriter:
    """Context manager: `write(metrics)` once per step."""

    def __init__(self, out: Path, resumed_step: int, cfg):
        self.path = Path(out) / "metrics.jsonl"
        self.completions = Path(out) / "completions" if cfg.log_completions else None
        self.to_print = cfg.num_completions_to_print
        trim_metrics(self.path, resumed_step)
        self.bar = self.tb = None
        self.wandb = _wandb_run(Path(out), cfg) if "wandb" in cfg.report_to else None
        if cfg.progress:
            self.bar = tqdm(
                total=cfg.num_steps, initial=resumed_step, desc="longstraw", unit="step", dynamic_ncols=True
            )
        if "tensorboard" in cfg.report_to:
            if not tensorboard_available():
                raise ValueError("report_to: tensorboard needs the `tensorboard` package (pip install tensorboard)")
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(out) / "tensorboard"), purge_step=resumed_step + 1)

    def __enter__(self) -> MetricsWriter:
        return self

    def write(self, m: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.tb is not None:
            for key, value in m.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(f"{m['phase']}/{key}" if key in ("loss",) else key, value, m["step"])
            for length, acc in m.get("eval", {}).items():
                self.tb.add_scalar(f"eval/accuracy/{length}", acc, m["step"])
        if self.wandb is not None:
            logs = {f"train/{k}": v for k, v in trl_logs(m).items() if _number(v)}
            logs.update({f"eval/accuracy/{length}": acc for length, acc in m.get("eval", {}).items()})
            self.wandb.log(logs, step=m["step"])
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{m['loss']:.3f}", "len": m["prompt_length"]}
            if "reward" in m:
                post["reward"] = f"{m['reward']:.2f}"
            self.bar.set_postfix(post, refresh=False)

    def write_completions(self, step: int, rows: list[dict]) -> None:
        """One GRPO step's completions (rows as `Trainer._completion_rows` makes them)."""
        if self.completions is not None:
            self.completions.mkdir(exist_ok=True)
            path = self.completions / f"step-{step:06d}.jsonl"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, path)
            if self.tb is not None:
                self.tb.add_text("completions", _markdown_table(rows), step)
        if self.to_print and rows:
            lines = [f"step {step}: {len(rows)} completions, e.g."]
            for r in rows[: self.to_print]:
                lines.append(
                    f"  reward {r['reward']:+.3f}  advantage {r['advantage']:+.3f}  "
                    f"…{_one_line(r['prompt_tail'])[-60:]} → {_one_line(r['completion'])[:120]!r}"
                )
            text = "\n".join(lines)
            if self.bar is not None:
                self.bar.write(text)
            else:
                print(text, flush=True)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _wandb_run(out: Path, cfg):
    """The wandb run of `out` (module doc): a new one, or on resume the one whose id `out/wandb/run_id` holds."""
    try:
        import wandb
    except ImportError:
        raise ValueError("report_to: wandb needs the `wandb` package (pip install wandb)") from None
    folder = out / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    if not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:8])
    return wandb.init(
        dir=str(out),
        project=os.environ.get("WANDB_PROJECT", "longstraw"),
        name=out.resolve().name,
        id=id_file.read_text().strip(),
        resume="allow",
        config=cfg.to_dict(),
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _markdown_table(rows: list[dict]) -> str:
    """Completions as a Markdown table (TensorBoard's text plugin renders Markdown)."""
    names = list(rows[0]["rewards"]) if rows else []
    cell = lambda t: _one_line(str(t)).replace("|", "\\|")  # noqa: E731
    head = "| prompt (end) | completion | " + " | ".join(names) + " | reward | advantage |"
    rule = "|" + "---|" * (4 + len(names))
    body = [
        f"| …{cell(r['prompt_tail'])[-80:]} | {cell(r['completion'])[:200]} | "
        + " | ".join(f"{r['rewards'][n]:.3f}" for n in names)
        + f" | {r['reward']:.3f} | {r['advantage']:.3f} |"
        for r in rows
    ]
    return "\n".join([head, rule, *body])
