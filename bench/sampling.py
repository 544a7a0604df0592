"""Memory and time of sampling G responses from one long prompt: longstraw vs transformers' generate.

longstraw: capture the prompt once, then `state.sample(num=G, ...)` (all G read the one prompt state).
transformers: `model.generate(num_return_sequences=G)`, which prefills G copies of the prompt and
keeps G KV caches. Both sample exactly R tokens per response at temperature 1 (no stop token), on
the benchmark's tiny dense and hybrid models, one torch thread, each configuration in a fresh process
whose address space is capped at `--limit-gb` (a run over it fails its allocation and is reported so;
the cap counts address space, which torch reserves somewhat beyond the memory it touches).

    python bench/sampling.py      # → bench/results/sampling.{json,md,png}
    python bench/sampling.py --models dsa --P 512 1024 2048 8192 32768 --limit-gb 16 --mmap-threshold 65536 \
        --out bench/results/dsa_sampling                      # glm_moe_dsa (MLA + DSA, MoE)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _bench import finish, memory_time_figure, record

from longstraw.tools.compare import SAMPLERS, format_table, measure_in_fresh_process


def plot(rows, path: Path) -> None:
    styles = {"dense": "-", "hybrid": "--", "dsa": ":"}
    series = [(f"{model} {method}", styles.get(model, "-.") + marker,
               [(r["P"], r["step_mem_mb"], r["wall_s"]) for r in rows
                if r["model"] == model and r["method"] == method and "step_mem_mb" in r])
              for model in sorted({r["model"] for r in rows})
              for method, marker in (("hf_generate", "s"), ("longstraw", "^"))]
    memory_time_figure(series, "prompt length P (tokens)", ("memory while sampling (MiB, peak RSS − before)", "time (s)"),
                       f"sampling G={rows[0]['G']} responses of {rows[0]['R']} tokens, 1 thread", path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["dense", "hybrid"])
    ap.add_argument("--P", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    ap.add_argument("--G", type=int, default=32)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="fix glibc's mmap threshold (bytes) in every measured process, so RSS follows live tensors")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampling"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        for P in args.P:
            for method in SAMPLERS:
                row = measure_in_fresh_process(model, method, P, args.G, args.R, args.threads, task="sample",
                                               limit_gb=args.limit_gb, mmap_threshold=args.mmap_threshold)
                record(rows, row, out)
    finish(rows, out, plot, format_table)


if __name__ == "__main__":
    main()
