"""DeepSeek-V4 compressed attention: one GRPO step's memory and time against P and G, and the durable state
against the bytes-per-token formula of docs/models.md.

Model: `longstraw.testing.models.BENCH_DSV4` (a tiny `deepseek_v4`: CSA / HCA / CSA / HCA at rates 4 and 128, window
128, indexer top-64, MoE), LoRA on the attention projections, R = 64, one torch thread. Each configuration
runs in a fresh process (`longstraw.tools.compare.measure_in_fresh_process`); step memory = peak RSS during the
step − RSS just before it. Per row, `formula_bytes` is the durable state the formula of docs/models.md gives for P − 1
captured tokens (window keys once, entries, tails, CSA overlaps; see `expected_bytes`), and `g_spread` (on
the G-largest row of each P and method) the step memory's change from the smallest G: max(5 %, 8 MiB) is
the bar.

    python bench/compressed_step.py --chunk-size 1024  # → bench/results/dsv4_step.{json,md,png}
    python bench/compressed_step.py --P 4096 --G 2 8 --out /tmp/quick
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _bench import finish, record
from memory_step import plot

from longstraw.tools.compare import format_table, measure_in_fresh_process


def expected_bytes(P: int, dtype_bytes: int = 4) -> int:
    """Durable bytes of `BENCH_DSV4` after capturing P − 1 tokens: per CSA layer (head_dim + index_head_dim) per
    complete window of 4, per HCA layer head_dim per window of 128, plus per layer the last W − 1 keys, the raw
    tail of the current window (kv and gate) and, for CSA, the overlap half of the last window (kv and gate)."""
    from longstraw.testing.models import BENCH_DSV4 as cfg

    c, d, di, w = P - 1, cfg["head_dim"], cfg["index_head_dim"], cfg["sliding_window"]
    total = 0
    for kind in cfg["layer_types"]:
        m = cfg["compress_rates"][kind]
        streams = [(d, 2 * d), (di, 2 * di)] if kind == "compressed_sparse_attention" else [(d, d)]
        total += d * min(c, w - 1)
        for dim, width in streams:
            total += c // m * dim + 2 * (c % m) * width
            if kind == "compressed_sparse_attention" and c >= m:
                total += 2 * m * dim
    return total * dtype_bytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["longstraw"])
    ap.add_argument("--P", nargs="+", type=int, default=[16384, 65536, 131072])
    ap.add_argument("--G", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="fix glibc's mmap threshold (bytes) in every measured process, so RSS follows live tensors")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dsv4_step"))
    ap.add_argument("--replot", action="store_true", help="only redraw OUT.png and OUT.md from OUT.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        rows = json.loads(out.with_suffix(".json").read_text())
        finish(rows, out, plot, format_table)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for P in args.P:
        for method in args.methods:
            first = None
            for G in sorted(args.G):
                row = measure_in_fresh_process("dsv4", method, P, G, args.R, args.threads, args.chunk_size,
                                               limit_gb=args.limit_gb, mmap_threshold=args.mmap_threshold)
                row["formula_bytes"] = expected_bytes(P)
                if "durable_bytes" in row:
                    row["formula_holds"] = row["durable_bytes"] == row["formula_bytes"]
                    row["durable_bytes_per_token"] = round(row["durable_bytes"] / P, 3)
                if "step_mem_mb" in row:
                    if first is None:
                        first = row["step_mem_mb"]
                    else:
                        spread = row["step_mem_mb"] - first
                        row["g_spread_mb"] = round(spread, 1)
                        row["g_flat"] = abs(spread) <= max(0.05 * first, 8.0)
                record(rows, row, out)
    finish(rows, out, plot, format_table)


if __name__ == "__main__":
    main()
