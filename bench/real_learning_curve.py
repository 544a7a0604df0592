"""Does the real model get better at reading long documents? Held-out greedy accuracy before and after GRPO.

    python bench/real_learning_curve.py                                   # detached, fp32, 2K and 6K tokens
    python bench/real_learning_curve.py --prompt-grad exact --tag exact
    python bench/real_learning_curve.py --dtype bf16 --tag bf16

SmolLM2-135M-Instruct (`longstraw real smollm2`) with a LoRA adapter (r 16) learns the long-document task of
`longstraw.tasks.documents` (real English: the standard library's docstrings, a 4-digit code hidden at a random
depth, the question at the end, reward `contains_answer`). Training rows cycle through the lengths; each length has
its own `--eval-rows` held-out rows (other seeds), scored greedily before the first step and after the last.
Accuracy intervals are Wilson 95 % intervals; the gain's is a paired bootstrap over the held-out rows (2,000
resamples). Rows are written as they are measured to `bench/results/real_learning_curve[-TAG].json` (an interrupted
run keeps them), then the `.md` table and the `.png` figure.

Cost on 2 quiet cores (fp32, AMD EPYC Zen 4, `--tag needle`): a greedy answer takes ~6 s at 2K tokens and ~20 s at
6K, so 64 held-out rows per length cost ~27 minutes per evaluation, and a training step of 2 prompts × 8 responses
(one of each length) about 66 s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def paired_bootstrap(before: list[float], after: list[float], resamples: int = 2000, seed: int = 0):
    """95 % interval of mean(after − before) by resampling the held-out rows."""
    rng = random.Random(seed)
    diffs = [a - b for a, b in zip(after, before)]
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 6144])
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--train-rows", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--variant", choices=["needle", "distractors"], default="needle")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--prompt-grad", choices=["detached", "exact"], default="detached")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--train-embeddings", action="store_true",
                    help="also train the embeddings and LM head in full beside the adapter (the trainer's default for "
                         "checkpoints until 2026-12-04: the results files from before then were run with it)")
    ap.add_argument("--out", default="bench/out/real_learning_curve")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from longstraw.train.config import TrainConfig
    from longstraw.tools.real_models import model_path
    from longstraw.tasks.documents import write_document_task
    from longstraw.tasks.jsonl import load_jsonl
    from longstraw.train.trainer import Trainer

    path = model_path("smollm2")
    out = Path(args.out + (f"-{args.tag}" if args.tag else ""))
    tok = AutoTokenizer.from_pretrained(path)
    files = write_document_task(tok, out / "data", args.lengths, args.train_rows, args.eval_rows, args.variant)
    cfg = TrainConfig(model=str(path), dataset=str(files["train"]), eval_fraction=0.0, reward_funcs=["contains_answer"],
                      lora=True, lora_r=16, lora_alpha=32, num_generations=args.G, prompts_per_step=args.prompts_per_step,
                      num_steps=args.steps, max_completion_length=16, dtype=args.dtype, prompt_grad=args.prompt_grad,
                      threads=args.threads, output_dir=str(out / "run"), learning_rate=1e-4,
                      eval_at_start=False, num_completions_to_print=1, train_embeddings=args.train_embeddings)
    trainer = Trainer(cfg)
    held = {n: load_jsonl(files[f"eval-{n}"], tok) for n in args.lengths}
    result = RESULTS / f"real_learning_curve{'-' + args.tag if args.tag else ''}"
    rows: list[dict] = []

    def score(when: str) -> dict:
        trainer.model.eval()
        got = {}
        for n, examples in held.items():
            t0 = time.perf_counter()
            got[n] = [s["reward"] for s in trainer.score_examples(examples)]
            acc = sum(got[n]) / len(got[n])
            record(rows, dict(when=when, length=n, rows=len(got[n]), accuracy=acc, ci95=wilson(sum(got[n]), len(got[n])),
                              seconds=time.perf_counter() - t0, dtype=args.dtype, prompt_grad=args.prompt_grad,
                              steps=args.steps, G=args.G, per_row=got[n]), result)
        trainer.model.train()
        return got

    before = score("before")
    t0 = time.perf_counter()
    metrics = trainer.train()
    record(rows, dict(when="training", steps=len(metrics), seconds=time.perf_counter() - t0,
                      reward_first=[m["reward"] for m in metrics[:8]], reward_last=[m["reward"] for m in metrics[-8:]]),
           result)
    after = score("after")
    for n in args.lengths:
        lo, hi = paired_bootstrap(before[n], after[n])
        record(rows, dict(when="gain", length=n, gain=sum(after[n]) / len(after[n]) - sum(before[n]) / len(before[n]),
                          ci95=(lo, hi)), result)
    finish(rows, result, _plot, _table)
    (out / "done.json").write_text(json.dumps(rows))


def _table(rows: list[dict]) -> str:
    lines = ["| length | before | after | gain (95 % CI) |", "|---:|---:|---:|---:|"]
    by = {(r["when"], r.get("length")): r for r in rows}
    for (when, n), r in by.items():
        if when == "gain":
            b, a = by[("before", n)], by[("after", n)]
            lines.append(f"| {n} | {b['accuracy']:.3f} | {a['accuracy']:.3f} | {r['gain']:+.3f} "
                         f"({r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}) |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for when, style in (("before", "o--"), ("after", "s-")):
        pts = sorted((r["length"], r["accuracy"], r["ci95"]) for r in rows if r["when"] == when)
        if pts:
            xs, ys, cis = zip(*pts)
            ax.errorbar(xs, ys, yerr=[[y - c[0] for y, c in zip(ys, cis)], [c[1] - y for y, c in zip(ys, cis)]],
                        fmt=style, capsize=4, label=f"{when} GRPO")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("SmolLM2-135M-Instruct, long-document retrieval")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
