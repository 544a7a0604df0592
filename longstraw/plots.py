"""PNG plots of a run's output folder: reward, held-out accuracy per context length, memory."""

from __future__ import annotations

import json
from pathlib import Path


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run: str | Path, baselines: dict | None = None) -> list[Path]:
    """Write reward.png, eval_accuracy.png and memory.png into `run`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run)
    rows = _rows(run)
    written = []
    if not rows:
        return written

    fig, ax = plt.subplots(figsize=(6.5, 4))
    grpo = [r for r in rows if r.get("phase") == "grpo"]
    sft = [r for r in rows if r.get("phase") == "sft"]
    if grpo:
        ax.plot([r["step"] for r in grpo], [r["reward"] for r in grpo], ".", alpha=0.35, label="reward (per step)")
        k = max(1, len(grpo) // 20)
        smooth = [sum(r["reward"] for r in grpo[max(0, i - k + 1) : i + 1]) / len(grpo[max(0, i - k + 1) : i + 1])
                  for i in range(len(grpo))]
        ax.plot([r["step"] for r in grpo], smooth, "-", label=f"reward (mean of {k})")
    if sft:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in sft], [r["loss"] for r in sft], "-", color="gray", alpha=0.6, label="warm-up loss")
        ax2.set_ylabel("supervised warm-up loss (nats/token)")
        ax2.legend(loc="upper right", fontsize=8)
        ax.set_zorder(ax2.get_zorder() + 1)  # rewards drawn over the warm-up curve
        ax.patch.set_visible(False)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO reward (after the supervised warm-up)" if sft else "GRPO reward")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(run / "reward.png", dpi=100)
    plt.close(fig)
    written.append(run / "reward.png")

    evals = [(r["step"], r["eval"]) for r in rows if "eval" in r]
    final = run / "eval.json"
    if final.exists():
        evals.append((rows[-1]["step"], json.loads(final.read_text())["accuracy"]))
    if evals:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for length in sorted({k for _, e in evals for k in e}, key=lambda k: (not k.isdigit(), len(k), k)):
            pts = [(s, e[length]) for s, e in evals if length in e]
            ax.plot(*zip(*pts), "o-", label=f"P = {length}" if length.isdigit() else length)
        for name, value in (baselines or {}).items():
            ax.axhline(value, ls=":", color="gray")
            ax.text(0, value, f" {name} {value:.3f}", va="bottom", fontsize=8, color="gray")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_title("held-out accuracy per context length")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(run / "eval_accuracy.png", dpi=100)
        plt.close(fig)
        written.append(run / "eval_accuracy.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot([r["step"] for r in rows], [r["step_mem_mb"] for r in rows], ".-", label="step memory (MiB)")
    ax.plot([r["step"] for r in rows], [r["durable_bytes"] / 2**20 for r in rows], "--", label="durable state (MiB)")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title("memory per step (peak RSS − RSS before the step)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run / "memory.png", dpi=100)
    plt.close(fig)
    written.append(run / "memory.png")
    return written
