"""Sliding-window attention on CPU: the blockwise kernel against PyTorch's flash kernel with its additive mask.

Two measurements, each alternating the two so that a shared machine's noise hits both alike:

1. One part alone, forward and backward (dq, dk, dv), in float32 with --threads torch threads, the median of
   --repeats calls per kernel: a capture chunk of R queries over its own keys (the square windowed block) and over
   the earlier prompt keys its window reaches, and a replayed turn of 300 queries over its own keys and over a long
   prompt state, for Gemma 3's shapes (window 512, 4 query heads over 1 key head, head dim 256) and Mistral's
   (window 4,096, 32 over 8, head dim 128). Every call's output is checked against the other kernel's.
2. One capture of Gemma 3 270M (`longstraw real gemma3`, float32, 15 of its 18 layers sliding) at --capture-P
   tokens, each kernel in its own fresh process, --capture-threads threads; "blockwise" turns the masked path off
   (`fused.FLASH_CPU.masked = False`: the windowed parts go to the blockwise kernel, as before it existed); then
   DECODE_TOKENS greedy tokens from the state (one query row per step), whose tokens the two kernels must agree on.

    python bench/windowed_kernel.py                    # both (a few minutes on quiet cores)
    python bench/windowed_kernel.py --capture-P 0      # the parts alone
Writes bench/results/windowed_kernel.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _bench import finish, record  # noqa: E402

#: greedy tokens decoded from each capture (one query row a step: the windowed parts' smallest case)
DECODE_TOKENS = 32
#: name: (query heads, key heads, head dim, window)
SHAPES = {"gemma3": (4, 1, 256, 512), "mistral": (32, 8, 128, 4096)}


def cases(window: int, chunk: int) -> dict[str, tuple[int, int, int, int]]:
    """name: (queries R, keys T, first query position, first key position)."""
    return {
        "capture chunk, own keys": (chunk, chunk, 4 * chunk, 4 * chunk),
        "capture chunk, prompt keys": (chunk, 4 * chunk, 4 * chunk, 0),
        "replayed turn, own keys": (300, 300, 30000, 30000),
        "replayed turn, prompt keys": (300, 30000, 30000, 0),
    }


def part_times(shape: str, case: str, threads: int, repeats: int, chunk: int) -> dict:
    import torch

    from longstraw.ops.kernels import KERNELS, Part

    torch.set_num_threads(threads)
    h, hkv, d, window = SHAPES[shape]
    r, t, qs, ks = cases(window, chunk)[case]
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, n_h, n, d, generator=g) for n_h, n in ((h, r), (hkv, t), (hkv, t), (h, r)))
    part = Part(qs, ks, window, None, d**-0.5, 1024)
    kernels = {"blockwise": KERNELS["blockwise"], "flash_cpu": KERNELS["flash_cpu"]}
    if KERNELS["flash_cpu"].why_not(q, k, v, part) is not None:
        raise SystemExit(f"flash_cpu does not take this part: {KERNELS['flash_cpu'].why_not(q, k, v, part)}")
    times: dict[str, dict[str, list[float]]] = {name: {"forward": [], "backward": []} for name in kernels}
    results = {}
    for i in range(repeats + 1):  # the first round warms up
        for name, kernel in kernels.items():
            t0 = time.perf_counter()
            out, lse = kernel.forward(q, k, v, part)
            t1 = time.perf_counter()
            grads = kernel.backward(do, q, k, v, out, lse, part, True)
            t2 = time.perf_counter()
            if i:
                times[name]["forward"].append(t1 - t0)
                times[name]["backward"].append(t2 - t1)
            results[name] = (out, *grads)
    err = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(results["flash_cpu"], results["blockwise"])
    )
    row = dict(what="part", shape=shape, case=case, R=r, T=t, window=window, threads=threads, max_rel_diff=err)
    for name in kernels:
        for step in ("forward", "backward"):
            row[f"{name}_{step}_s"] = statistics.median(times[name][step])
            row[f"{name}_{step}_runs"] = times[name][step]
    row["forward_speedup"] = row["blockwise_forward_s"] / row["flash_cpu_forward_s"]
    row["backward_speedup"] = row["blockwise_backward_s"] / row["flash_cpu_backward_s"]
    return row


def capture_child(P: int, kernel: str, threads: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import longstraw
    from longstraw.ops.kernels import fused
    from longstraw.tools.real_models import model_path

    torch.set_num_threads(threads)
    if kernel == "blockwise":
        fused.FLASH_CPU.masked = False
    model = AutoModelForCausalLM.from_pretrained(model_path("gemma3"), dtype=torch.float32).eval()
    prompt = torch.randint(100, 200000, (P,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        t0 = time.perf_counter()
        with longstraw.capture(model, prompt) as state:
            seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            tokens = state.sample(1, DECODE_TOKENS, temperature=0.0).tokens[0].tolist()
            decode = time.perf_counter() - t0
    print(json.dumps(dict(seconds=seconds, decode_seconds=decode, tokens=tokens)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=2048, help="queries of a capture chunk")
    ap.add_argument("--capture-P", type=int, default=8192, help="prompt length of the Gemma 3 captures (0: none)")
    ap.add_argument("--capture-repeats", type=int, default=2)
    ap.add_argument("--capture-threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "windowed_kernel"))
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        P, kernel, threads = args.child
        capture_child(int(P), kernel, int(threads))
        return
    out = Path(args.out)
    rows: list[dict] = []
    for shape in SHAPES:
        for case in cases(SHAPES[shape][3], args.chunk):
            record(rows, part_times(shape, case, args.threads, args.repeats, args.chunk), out)
    if args.capture_P:
        runs: dict[str, list[dict]] = {"blockwise": [], "flash_cpu": []}
        for _ in range(args.capture_repeats):
            for kernel in runs:
                res = subprocess.run([sys.executable, __file__, "--child", str(args.capture_P), kernel,
                                      str(args.capture_threads)], capture_output=True, text=True, check=True)
                runs[kernel].append(json.loads(res.stdout.strip().splitlines()[-1]))
        best = {k: min(r["seconds"] for r in v) for k, v in runs.items()}
        decode = {k: min(r["decode_seconds"] for r in v) for k, v in runs.items()}
        record(rows, dict(what="capture", model="gemma3", P=args.capture_P, threads=args.capture_threads,
                          blockwise_s=best["blockwise"], flash_cpu_s=best["flash_cpu"],
                          speedup=best["blockwise"] / best["flash_cpu"], decode_tokens=DECODE_TOKENS,
                          blockwise_decode_s=decode["blockwise"], flash_cpu_decode_s=decode["flash_cpu"],
                          same_greedy_tokens=runs["blockwise"][0]["tokens"] == runs["flash_cpu"][0]["tokens"],
                          runs=runs), out)
    finish(rows, out, plot, table)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [r for r in rows if r["what"] == "part"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    labels = [f"{r['shape']}: {r['case']}" for r in parts]
    y = range(len(parts))
    ax.barh([i + 0.2 for i in y], [r["forward_speedup"] for r in parts], height=0.4, label="forward")
    ax.barh([i - 0.2 for i in y], [r["backward_speedup"] for r in parts], height=0.4, label="backward")
    ax.axvline(1, color="k", lw=0.8)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel("blockwise time / flash_cpu (masked) time")
    ax.set_title("Sliding-window parts on CPU, float32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows) -> str:
    lines = ["| shape | part | R × T | threads | forward blockwise → flash_cpu (s) | backward (s) | "
             "max rel. difference |", "|---|---|---|---:|---|---|---:|"]
    for r in rows:
        if r["what"] != "part":
            continue
        lines.append(f"| {r['shape']} (window {r['window']:,}) | {r['case']} | {r['R']:,} × {r['T']:,} | "
                     f"{r['threads']} | {r['blockwise_forward_s']:.4f} → {r['flash_cpu_forward_s']:.4f} "
                     f"({r['forward_speedup']:.2f}×) | {r['blockwise_backward_s']:.4f} → "
                     f"{r['flash_cpu_backward_s']:.4f} ({r['backward_speedup']:.2f}×) | {r['max_rel_diff']:.1e} |")
    for r in rows:
        if r["what"] == "capture":
            lines.append(f"\nGemma 3 270M capture of {r['P']:,} tokens, float32, {r['threads']} threads, fresh "
                         f"process each: blockwise {r['blockwise_s']:.1f} s → flash_cpu {r['flash_cpu_s']:.1f} s "
                         f"({r['speedup']:.2f}×; best of {len(r['runs']['blockwise'])}); {r['decode_tokens']} greedy "
                         f"tokens from it {r['blockwise_decode_s']:.2f} s → {r['flash_cpu_decode_s']:.2f} s, the "
                         f"same tokens: {r['same_greedy_tokens']}.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
