"""Replay memory and time with and without activation checkpointing of the decoder layers.

One replay of R response tokens with backward against a captured prompt (P = 4096, chunks of 1024,
LoRA, one torch thread), `replay(checkpoint_layers=False|True)`, each configuration in a fresh process.
Replay memory = peak RSS during the replay and its backward − RSS just before (the capture and a warm-up
replay of 8 tokens come first, so the durable state is not counted; glibc's mmap threshold is fixed at
64 KiB so that RSS follows live tensors, see `longstraw.tools.compare.measure_in_fresh_process`). Models:
`dense` (qwen3), `hybrid` (qwen3_next-like, MoE), `dsa` (glm_moe_dsa: MLA + DSA, MoE).

    python bench/replay_checkpoint.py          # → bench/results/replay_checkpoint.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _bench import finish, memory_time_figure, record


def one(model_name: str, R: int, ckpt: bool, P: int) -> dict:
    import torch

    import longstraw
    from longstraw.tools.compare import bench_model
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb

    torch.set_num_threads(1)
    model = bench_model(model_name)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (P,), generator=g)
    response = torch.randint(0, vocab, (R,), generator=g)
    state = longstraw.capture(model, prompt, chunk_size=1024)
    state.replay(response[:8], checkpoint_layers=ckpt).logprobs.sum().backward()  # warm-up
    model.zero_grad(set_to_none=False)
    before = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    state.replay(response, checkpoint_layers=ckpt).logprobs.sum().backward()
    wall = time.perf_counter() - t0
    return dict(model=model_name, P=P, R=R, checkpoint_layers=ckpt, replay_mem_mb=round(peak_rss_mb() - before, 1),
                wall_s=round(wall, 3), durable_mb=round(state.nbytes / 2**20, 2), torch=torch.__version__)


def plot(rows, path: Path) -> None:
    series = [(f"{m}{' checkpoint_layers' if ckpt else ''}", style,
               [(r["R"], r["replay_mem_mb"], r["wall_s"]) for r in rows
                if r["model"] == m and r["checkpoint_layers"] == ckpt])
              for m in sorted({r["model"] for r in rows}) for ckpt, style in ((False, "o-"), (True, "s--"))]
    memory_time_figure(series, "response length R (tokens)",
                       ("replay memory (MiB): peak RSS − RSS before", "replay + backward time (s)"),
                       f"one replay with backward, P={rows[0]['P']}, LoRA, 1 thread", path)


def table(rows) -> str:
    lines = ["| model | R | checkpoint_layers | replay memory (MiB) | time (s) |", "|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['R']} | {r['checkpoint_layers']} | {r['replay_mem_mb']:.1f} | "
                     f"{r['wall_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["dense", "hybrid", "dsa"])
    ap.add_argument("--R", nargs="+", type=int, default=[256, 1024, 4096])
    ap.add_argument("--P", type=int, default=4096)
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "R", "CKPT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "replay_checkpoint"))
    args = ap.parse_args(argv)
    if args.one:
        m, r, c = args.one
        print(json.dumps(one(m, int(r), c == "1", args.P)))
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for m in args.models:
        for r in args.R:
            for ckpt in (False, True):
                cmd = [sys.executable, __file__, "--one", m, str(r), "1" if ckpt else "0", "--P", str(args.P)]
                env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
                res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True, env=env)
                record(rows, json.loads(res.stdout.strip().splitlines()[-1]), out)
    finish(rows, out, plot, table)


if __name__ == "__main__":
    main()
