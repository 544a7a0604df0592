"""Compressed durable state: response log-prob error and state size against the full-precision state.

For the benchmark's tiny dense model (qwen3: 4 layers, 2 KV heads of 32) and its MLA/DSA model (glm_moe_dsa:
latent 64 + rotary 16, DSA top-256), each prompt length P: capture the same random prompt in float32, fp8
(e4m3) and int8 (`capture(state_dtype=...)`, a float32 scale per 64 tokens × head), replay the same
32-token response and report the max abs difference of its log-probs from the float32 replay, the
state's bytes, and capture time. One torch thread; each (model, P) in a fresh process.

    python bench/quant_error.py          # → bench/results/quant_error.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _bench import record

HERE = Path(__file__).resolve().parent


def worker(model_name: str, p: int) -> dict:
    import torch

    import longstraw
    from longstraw.tools.compare import bench_model

    torch.set_num_threads(1)
    model = bench_model(model_name).eval()
    g = torch.Generator().manual_seed(p)
    prompt = torch.randint(0, model.config.vocab_size, (p,), generator=g)
    response = torch.randint(0, model.config.vocab_size, (32,), generator=g)
    row = dict(model=model_name, P=p)
    with torch.no_grad():
        ref = None
        for name in ("fp32", "fp8", "int8"):
            t = time.perf_counter()
            state = longstraw.capture(model, prompt, chunk_size=4096, state_dtype=None if name == "fp32" else name)
            row[f"capture_s_{name}"] = round(time.perf_counter() - t, 2)
            lp = state.replay(response).logprobs
            row[f"state_mib_{name}"] = state.nbytes / 2**20
            if ref is None:
                ref = lp
            else:
                row[f"max_abs_err_{name}"] = (lp - ref).abs().max().item()
                row[f"mean_abs_err_{name}"] = (lp - ref).abs().mean().item()
            state.release()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["dense", "dsa"])
    ap.add_argument("--P", nargs="+", type=int, default=[4096, 16384, 65536])
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "quant_error"))
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    rows: list[dict] = []
    out = Path(args.out)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for model in args.models:
        for p in args.P:
            res = subprocess.run([sys.executable, __file__, "--worker", model, str(p)], env=env, capture_output=True,
                                 text=True, check=True)
            record(rows, json.loads(res.stdout.strip().splitlines()[-1]), out)
    lines = ["| model | P | state fp32 / fp8 / int8 (MiB) | fp8 ratio | max abs log-prob error fp8 / int8 "
             "| mean abs error fp8 / int8 |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['P']} | {r['state_mib_fp32']:.2f} / {r['state_mib_fp8']:.2f} / "
                     f"{r['state_mib_int8']:.2f} | {r['state_mib_fp8'] / r['state_mib_fp32']:.3f} | "
                     f"{r['max_abs_err_fp8']:.1e} / {r['max_abs_err_int8']:.1e} | "
                     f"{r['mean_abs_err_fp8']:.1e} / {r['mean_abs_err_int8']:.1e} |")
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
