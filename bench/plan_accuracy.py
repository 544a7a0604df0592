"""The planner against measured steps: predicted step memory vs peak RSS of one GRPO step, side by side.

Each configuration (model family, P, G, detached / exact) is measured in a fresh process with
`longstraw.tools.compare` (one torch thread, R = 64, chunk 4096, LoRA r = 8 on the attention projections,
glibc's mmap threshold fixed at 64 KiB so RSS follows live tensors): step memory = peak RSS during the
step − RSS before it, i.e. what the step adds to a loaded model (`Plan.step`). The planner sees only the
model's config.

    python bench/plan_accuracy.py        # → bench/results/plan_accuracy.{json,md}
    python bench/plan_accuracy.py --held-out    # then configurations the coefficients were not fitted on
    python bench/plan_accuracy.py --repredict   # the same measurements, the current planner
    python bench/plan_accuracy.py --full        # FULL: full fine-tuning instead of LoRA, appended to OUT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _bench import record

from longstraw.tools.compare import bench_model, measure_in_fresh_process
from longstraw.tools.planner import PlanConfig, plan

HERE = Path(__file__).resolve().parent

CONFIGS = [  # (model, P, G, method)
    ("dense", 4096, 2, "longstraw"), ("dense", 16384, 8, "longstraw"), ("dense", 65536, 2, "longstraw"),
    ("dense", 16384, 8, "longstraw_exact"),
    ("sliding", 16384, 2, "longstraw"), ("sliding", 65536, 8, "longstraw"),
    ("hybrid", 16384, 8, "longstraw"), ("hybrid", 65536, 2, "longstraw"), ("hybrid", 16384, 2, "longstraw_exact"),
    ("mla", 16384, 2, "longstraw"), ("mla", 65536, 8, "longstraw"),
    ("dsa", 16384, 8, "longstraw"), ("dsa", 65536, 2, "longstraw"),
]
#: measured after the planner's coefficients were fitted to CONFIGS: an out-of-sample check
HELD_OUT = [
    ("sliding", 4096, 8, "longstraw_exact"), ("mla", 4096, 2, "longstraw_exact"), ("hybrid", 4096, 8, "longstraw"),
    ("dsa", 4096, 2, "longstraw_exact"), ("dense", 32768, 4, "longstraw"), ("hybrid", 32768, 4, "longstraw_exact"),
]


#: full fine-tuning (every parameter trainable), measured after the coefficients were fitted: out of sample too
FULL = [
    ("dense", 16384, 8, "longstraw"), ("sliding", 16384, 2, "longstraw"), ("hybrid", 16384, 2, "longstraw"),
    ("mla", 16384, 8, "longstraw"), ("dsa", 16384, 2, "longstraw"), ("dense", 16384, 2, "longstraw_exact"),
]


def predicted(model: str, p: int, g: int, method: str, r: int, full: bool = False) -> dict:
    cfg = bench_model(model).config
    pl = plan(PlanConfig(cfg, p, num_generations=g, completion_length=r, dtype="fp32", lora_rank=0 if full else 8,
                         prompt_grad="exact" if method == "longstraw_exact" else "detached", chunk_size=4096))
    return dict(predicted_step_mb=round(pl.step / 2**20, 1), predicted_state_mb=round(pl.durable_state / 2**20, 2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--only", nargs="*", default=None, help="model names to run (default: all)")
    ap.add_argument("--out", default=str(HERE / "results" / "plan_accuracy"))
    ap.add_argument("--held-out", action="store_true", help="measure HELD_OUT and append them to OUT.json")
    ap.add_argument("--full", action="store_true", help="measure FULL (full fine-tuning) and append them to OUT.json")
    ap.add_argument("--repredict", action="store_true",
                    help="keep the measured rows of OUT.json, recompute the planner's predictions")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    out = Path(args.out)
    if args.repredict or args.held_out or args.full:
        rows = json.loads(out.with_suffix(".json").read_text())
    if args.repredict:
        for row in rows:
            row.update(predicted(row["model"], row["P"], row["G"], row["method"], row["R"],
                                 row.get("trainable") == "full"))
            if "step_mem_mb" in row:
                row["error"] = round(row["predicted_step_mb"] / row["step_mem_mb"] - 1, 3)
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    todo = [] if args.repredict else HELD_OUT if args.held_out else FULL if args.full else CONFIGS
    for model, p, g, method in todo:
        if args.only and model not in args.only:
            continue
        row = measure_in_fresh_process(model, method, p, g, args.R, threads=1, chunk_size=4096, limit_gb=16,
                                       mmap_threshold=65536, full=args.full)
        row.update(predicted(model, p, g, method, args.R, args.full), held_out=args.held_out or args.full)
        if "step_mem_mb" in row:
            row["error"] = round(row["predicted_step_mb"] / row["step_mem_mb"] - 1, 3)
        record(rows, row, out)
    lines = ["| model | P | G | mode | trainable | durable state MiB (measured / planned) | step MiB measured | planned "
             "| error | fitted on it |", "|---|---:|---:|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "step_mem_mb" not in r:
            continue
        mode = "exact" if r["method"] == "longstraw_exact" else "detached"
        lines.append(f"| {r['model']} | {r['P']} | {r['G']} | {mode} | {'full' if r.get('trainable') == 'full' else 'LoRA'} "
                     f"| {r['durable_mb']:.2f} / "
                     f"{r['predicted_state_mb']:.2f} | {r['step_mem_mb']:.1f} | {r['predicted_step_mb']:.1f} | "
                     f"{100 * r['error']:+.0f} % | {'no (held out)' if r.get('held_out') else 'yes'} |")
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
