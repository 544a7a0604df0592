"""PNG plots of a run's output folder: reward and loss, held-out accuracy per context length, memory.

reward.png has one panel per phase, each against its own steps: GRPO reward and loss against the GRPO
step count (a short GRPO phase after a long warm-up stays readable), the supervised warm-up's loss
against the warm-up steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure  # pyplot's global state and backend are not needed to write a PNG


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _smooth(values: list[float]) -> tuple[list[float], int]:
    k = max(1, len(values) // 20)
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))
    ], k


def _grpo_panel(ax, grpo: list[dict]) -> None:
    x = list(range(1, len(grpo) + 1))
    reward = [r["reward"] for r in grpo]
    ax.plot(x, reward, ".", alpha=0.35, label="reward (per step)")
    smooth, k = _smooth(reward)
    ax.plot(x, smooth, "-", label=f"reward (mean of {k})")
    ax.set_xlabel(f"GRPO step (run steps {grpo[0]['step']}..{grpo[-1]['step']})")
    ax.set_ylabel("mean reward")
    loss_ax = ax.twinx()
    loss_ax.plot(x, [r["loss"] for r in grpo], "-", color="tab:red", alpha=0.5, label="GRPO loss")
    loss_ax.set_ylabel("GRPO loss")
    ax.set_title("GRPO")
    ax.legend(loc="upper left", fontsize=8)
    loss_ax.legend(loc="upper right", fontsize=8)


def _warmup_panel(ax, sft: list[dict]) -> None:
    ax.plot([r["step"] for r in sft], [r["loss"] for r in sft], "-", color="gray")
    ax.set_xlabel("warm-up step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("supervised warm-up")


def _save(fig, path: Path, written: list) -> None:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    written.append(path)


def plot_run(run: str | Path, baselines: dict | None = None) -> list[Path]:
    """Write reward.png, eval_accuracy.png and memory.png into `run`; returns the files written."""
    run = Path(run)
    rows = _rows(run)
    written: list[Path] = []
    if not rows:
        return written
    grpo = [r for r in rows if r.get("phase") == "grpo"]
    sft = [r for r in rows if r.get("phase") == "sft"]
    panels = [p for p in (("grpo", grpo), ("sft", sft)) if p[1]]
    fig = Figure(figsize=(6.5, 3.3 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)
    for ax, (kind, part) in zip(axes[:, 0], panels):
        (_grpo_panel if kind == "grpo" else _warmup_panel)(ax, part)
    _save(fig, run / "reward.png", written)

    evals = [(r["step"], r["eval"]) for r in rows if "eval" in r]
    final = run / "eval.json"
    if final.exists():
        evals.append((rows[-1]["step"], json.loads(final.read_text())["accuracy"]))
    if evals:
        fig = Figure(figsize=(6.5, 4))
        ax = fig.subplots()
        for length in sorted({k for _, e in evals for k in e}, key=lambda k: (not k.isdigit(), len(k), k)):
            pts = [(s, e[length]) for s, e in evals if length in e]
            ax.plot(*zip(*pts), "o-", label=f"P = {length}" if length.isdigit() else length)
        for name, value in (baselines or {}).items():
            ax.axhline(value, ls=":", color="gray")
            ax.text(0, value, f" {name} {value:.3f}", va="bottom", fontsize=8, color="gray")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out greedy accuracy (mean reward)")
        ax.set_title("held-out accuracy")
        ax.legend(fontsize=8)
        _save(fig, run / "eval_accuracy.png", written)

    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["step_mem_mb"] for r in rows], ".-", label="step (peak of the stages)")
    for stage in ("capture", "sample", "replay"):
        key = f"mem_{stage}_mb"
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], ".", alpha=0.6, label=stage)
    ax.plot(steps, [r["durable_bytes"] / 2**20 for r in rows], "--", label="durable state")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB above the step's start")
    ax.set_title("peak memory per step and stage")
    ax.legend(fontsize=8)
    _save(fig, run / "memory.png", written)
    return written
