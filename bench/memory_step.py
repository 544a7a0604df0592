"""Step memory and time of one GRPO training step: naive batched, naive serial, longstraw.

Grid: tiny dense (qwen3: hidden 128, 4 layers, 2 KV heads of 32) and hybrid (qwen3_next-like: 3 gated
DeltaNet + 1 full attention layer, MoE) models, P ∈ {4096, 16384, 32768}, G ∈ {2, 8, 32}, R = 64,
LoRA trainable, one torch thread. Each configuration runs in a fresh process
(`longstraw.tools.compare.measure_in_fresh_process`); step memory = peak RSS during the step − RSS just
before it. Naive batched configurations whose estimate (G × the measured naive-serial step memory at
the same P) exceeds `--limit-gb` are skipped and listed, and so are naive configurations that process
more than `--max-naive-tokens` tokens (G·(P+R)), to keep the grid near an hour on 2 cores (their
per-sequence cost is that of the smaller G).

    python bench/memory_step.py                       # → bench/results/memory_step.{json,md,png}
    python bench/memory_step.py --models dense --P 4096 --G 2 8 --out /tmp/quick
    python bench/memory_step.py --methods naive_serial naive_batched longstraw longstraw_exact \
        --P 4096 16384 32768 --chunk-size 2048 --max-naive-tokens 200000 \
        --out bench/results/exact_step                                 # exact vs detached vs naive
    python bench/memory_step.py --models dsa --methods naive_serial naive_batched longstraw \
        --G 2 8 --chunk-size 1024 --limit-gb 16 --mmap-threshold 65536 \
        --out bench/results/dsa_step                                   # glm_moe_dsa (MLA + DSA, MoE)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _bench import finish, record

from longstraw.tools.compare import METHODS, format_table, measure_in_fresh_process


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    styles = {"naive_batched": "s--", "naive_serial": "o-.", "longstraw": "^-", "longstraw_exact": "v:",
              "longstraw_ckpt": "d-"}
    for ax, m in zip(axes[0], models):
        for method in METHODS:
            for G in sorted({r["G"] for r in rows}):
                pts = sorted((r["P"], r["step_mem_mb"]) for r in rows
                             if r["model"] == m and r["method"] == method and r["G"] == G and "step_mem_mb" in r)
                if pts:
                    ax.plot(*zip(*pts), styles[method], label=f"{method} G={G}")
        failed = sorted({(r["P"], r["exceeded_gb"]) for r in rows if r["model"] == m and "exceeded_gb" in r})
        if failed:
            ax.plot([f[0] for f in failed], [f[1] * 1024 for f in failed], "kx", markersize=9,
                    label="naive: allocation failed at the address-space cap")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length P (tokens)")
        ax.set_ylabel("step memory (MiB): peak RSS − RSS before the step")
        ax.set_title(f"{m} tiny model, R={rows[0]['R']}, LoRA, 1 thread")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["dense", "hybrid"])
    ap.add_argument("--methods", nargs="+", default=["naive_batched", "naive_serial", "longstraw"])
    ap.add_argument("--P", nargs="+", type=int, default=[4096, 16384, 32768])
    ap.add_argument("--G", nargs="+", type=int, default=[2, 8, 32])
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--max-naive-tokens", type=int, default=600_000)
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="fix glibc's mmap threshold (bytes) in every measured process, so RSS follows live tensors")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_step"))
    ap.add_argument("--replot", action="store_true", help="only redraw OUT.png and OUT.md from OUT.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        rows = json.loads(out.with_suffix(".json").read_text())
        finish(rows, out, plot, format_table)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for P in args.P:
            serial_mb = None  # naive serial step memory at this P (does not depend on G)
            for method in ("naive_serial", "longstraw", "longstraw_exact", "longstraw_ckpt", "naive_batched"):
                if method not in args.methods:
                    continue
                for G in args.G:
                    base = dict(model=model, method=method, P=P, G=G, R=args.R)
                    if method.startswith("naive") and G * (P + args.R) > args.max_naive_tokens:
                        row = dict(base, skipped=f"time budget, G·(P+R) = {G * (P + args.R)} tokens")
                    elif method == "naive_batched" and serial_mb and G * serial_mb > args.limit_gb * 1024:
                        row = dict(base, skipped=f"estimated {G * serial_mb / 1024:.0f} GB > {args.limit_gb:.0f} GB")
                    else:
                        row = measure_in_fresh_process(model, method, P, G, args.R, args.threads, args.chunk_size,
                                                       limit_gb=args.limit_gb, mmap_threshold=args.mmap_threshold)
                        if method == "naive_serial" and "step_mem_mb" in row:
                            serial_mb = max(serial_mb or 0.0, row["step_mem_mb"])
                    record(rows, row, out)
    finish(rows, out, plot, format_table)


if __name__ == "__main__":
    main()
