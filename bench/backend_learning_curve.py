"""Does a run learn as well with vLLM sampling its rollouts as with the own sampler? The same task, steps and seeds.

    python bench/backend_learning_curve.py          # → bench/results/backend_learning_curve.{json,md,png}
    python bench/backend_learning_curve.py --steps 2 --eval-rows 4 --out /tmp/quick --tag quick

SmolLM2-135M-Instruct (`longstraw real smollm2`, fp32) with a LoRA adapter (r 16) on the long-document task with
distractors at 2K tokens (`longstraw.tasks.documents`, reward `contains_answer`; SmolLM2 starts near 0.5 there, so
the held-out accuracy can move either way). Two runs from the same weights, data, seeds and settings, 20 GRPO steps
of 2 prompts × 8 responses each, differing only in `rollout_backend`:
- `own`: longstraw's sampler, from the captured prompt state;
- `vllm`: a vLLM server the trainer starts on the model (`longstraw vllm-serve`'s environment, `longstraw.train.
  vllm_server.serve_policy`), the adapter hot-loaded every step, with TRL's importance-sampling correction at its
  defaults (`vllm_importance_sampling_mode: sequence_mask`, clip 3.0) against the sampler's own log-probs.
Per step: the sampled reward (the learning curve at equal steps), rollout seconds, the sampler mismatch (TRL's
`sampling/*` metrics) and the adapter sync seconds. Held-out: 64 rows (other seeds) scored greedily by the same
evaluator before training (once: the runs start from the same weights) and after each run; Wilson 95 % intervals,
the gain's a paired bootstrap over the rows. Rows are written as they are measured; a rerun of the same command goes
on where an interrupted one stopped (a finished phase is kept, a run resumes from its checkpoints).

Cost on this machine (2 cores): ~11 minutes per held-out pass, ~30 s per step with the own sampler; the vLLM server
takes ~3 minutes to start.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402
from real_learning_curve import paired_bootstrap, wilson  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = ("own", "vllm")
STEP_KEYS = ("reward", "time_sample", "time_capture", "time_replay", "time_step", "vllm/sync_s",
             "sampling/sampling_logp_difference/mean", "sampling/kl", "sampling/importance_sampling_ratio/mean",
             "sampling/corrected_frac")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--train-rows", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="bench/out/backend_learning_curve")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from longstraw.tasks.documents import write_document_task
    from longstraw.tasks.jsonl import load_jsonl
    from longstraw.tools.real_models import model_path
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    path = model_path("smollm2")
    out = Path(args.out + (f"-{args.tag}" if args.tag else ""))
    result = RESULTS / f"backend_learning_curve{'-' + args.tag if args.tag else ''}"
    tok = AutoTokenizer.from_pretrained(path)
    files = write_document_task(tok, out / "data", [args.length], args.train_rows, args.eval_rows, "distractors")
    held = load_jsonl(files[f"eval-{args.length}"], tok)
    rows: list[dict] = json.loads(result.with_suffix(".json").read_text()) if result.with_suffix(".json").exists() else []
    done = {r["when"] for r in rows}

    def trainer(backend: str) -> Trainer:
        cfg = TrainConfig(model=str(path), dataset=str(files["train"]), eval_fraction=0.0,
                          reward_funcs=["contains_answer"], lora=True, lora_r=16, lora_alpha=32,
                          num_generations=args.G, prompts_per_step=args.prompts_per_step, num_steps=args.steps,
                          max_completion_length=16, threads=args.threads, output_dir=str(out / backend),
                          learning_rate=1e-4, eval_at_start=False, num_completions_to_print=0,
                          rollout_backend=backend, vllm_timeout_s=900.0)
        return Trainer(cfg)

    def score(t: Trainer, when: str) -> list[float]:
        t.model.eval()
        t0 = time.perf_counter()
        got = [s["reward"] for s in t.score_examples(held)]
        record(rows, dict(when=when, length=args.length, rows=len(got), accuracy=sum(got) / len(got),
                          ci95=wilson(sum(got), len(got)), seconds=time.perf_counter() - t0, per_row=got), result)
        t.model.train()
        return got

    for backend in args.backends:
        if f"after-{backend}" in done:
            continue
        t = trainer(backend)
        try:
            if "before" not in done:  # the same weights and rows for every backend: scored once
                score(t, "before")
                done.add("before")
            t0 = time.perf_counter()
            metrics = t.train()
            steps = [json.loads(line) for line in (out / backend / "metrics.jsonl").read_text().splitlines()]
            steps = [m for m in steps if m.get("phase") == "grpo"]
            record(rows, dict(when=f"training-{backend}", steps=len(steps), seconds_this_call=time.perf_counter() - t0,
                              trained_this_call=len(metrics),
                              per_step=[{k: m[k] for k in ("step", *STEP_KEYS) if k in m} for m in steps]), result)
            score(t, f"after-{backend}")
        finally:
            t.close()
    by = {r["when"]: r for r in rows}
    for backend in args.backends:
        if f"after-{backend}" in by and "before" in by and f"gain-{backend}" not in by:
            before, after = by["before"]["per_row"], by[f"after-{backend}"]["per_row"]
            lo, hi = paired_bootstrap(before, after)
            record(rows, dict(when=f"gain-{backend}", gain=sum(after) / len(after) - sum(before) / len(before),
                              ci95=(lo, hi)), result)
    finish(rows, result, _plot, _table)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _table(rows: list[dict]) -> str:
    by = {r["when"]: r for r in rows}
    lines = ["| sampler | held-out before | after (95 % CI) | gain (95 % CI) | sampled reward, steps 1–5 → last 5 | "
             "rollout s / step | sync s / step | mean abs. Δ log-prob | IS-corrected share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    before = by.get("before")
    for backend in BACKENDS:
        train, after, gain = by.get(f"training-{backend}"), by.get(f"after-{backend}"), by.get(f"gain-{backend}")
        if train is None or after is None or gain is None or before is None:
            continue
        steps = train["per_step"]
        rewards = [m["reward"] for m in steps]

        def col(key: str, fmt: str) -> str:
            values = [m[key] for m in steps if key in m]
            return format(_mean(values), fmt) if values else "–"

        lines.append(
            f"| {backend} | {before['accuracy']:.3f} | {after['accuracy']:.3f} ({after['ci95'][0]:.3f}–"
            f"{after['ci95'][1]:.3f}) | {gain['gain']:+.3f} ({gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f}) | "
            f"{_mean(rewards[:5]):.3f} → {_mean(rewards[-5:]):.3f} | {col('time_sample', '.1f')} | "
            f"{col('vllm/sync_s', '.2f')} | {col('sampling/sampling_logp_difference/mean', '.2e')} | "
            f"{col('sampling/corrected_frac', '.3f')} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax, bx = fig.subplots(1, 2)
    by = {r["when"]: r for r in rows}
    for backend, style, color in zip(BACKENDS, ("o-", "s--"), ("tab:blue", "tab:red")):
        train = by.get(f"training-{backend}")
        if train is None:
            continue
        steps = [m["step"] for m in train["per_step"]]
        rewards = [m["reward"] for m in train["per_step"]]
        smooth = [_mean(rewards[max(0, i - 4): i + 1]) for i in range(len(rewards))]
        ax.plot(steps, rewards, style, color=color, alpha=0.3, label=f"{backend}: per step")
        ax.plot(steps, smooth, style[1:], color=color, label=f"{backend}: mean of the last 5")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("sampled reward (16 responses)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    names, accs, lows, highs = [], [], [], []
    for when in ("before", *(f"after-{b}" for b in BACKENDS)):
        r = by.get(when)
        if r is not None:
            names.append(when)
            accs.append(r["accuracy"])
            lows.append(r["accuracy"] - r["ci95"][0])
            highs.append(r["ci95"][1] - r["accuracy"])
    bx.errorbar(range(len(names)), accs, yerr=[lows, highs], fmt="o", capsize=5)
    bx.set_xticks(range(len(names)), names)
    bx.set_ylim(0, 1)
    bx.set_ylabel("held-out greedy accuracy (Wilson 95 %)")
    fig.suptitle("SmolLM2-135M-Instruct, documents with distractors at 2K: own sampler vs vLLM, equal steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
