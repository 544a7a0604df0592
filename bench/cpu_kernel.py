"""longstraw's compiled CPU attention kernel (`simd_cpu`) against PyTorch's fused CPU flash attention (`flash_cpu`).

Two measurements, each alternating the two kernels so that a shared machine's noise hits both alike:

1. The kernel alone: one prompt part — R query rows (query heads folded) over T keys, every key visible —
   per head dim, in float32, with 1 and with --threads torch threads; scores per second (R·T / seconds), the
   median of --repeats calls per kernel.
2. One capture of the stress model (`bench/stress.py`: the tiny hybrid with a 2-query-head / 1-KV-head × 16
   full-attention layer) at --capture-P tokens with the fp8 state and with the float32 state, chunk 2,048,
   --capture-threads torch threads, each kernel in its own fresh process (`longstraw.ops.kernels.use`). Two processes
   of 2 threads on 2 cores (this one beside another run) slow each other's OpenMP regions by several times and at
   random: measure on quiet cores, or with 1 thread.

    python bench/cpu_kernel.py                       # both (a few minutes)
    python bench/cpu_kernel.py --capture-P 0         # the kernel alone
Writes bench/results/cpu_kernel.{json,md,png}.
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


def kernel_rates(d: int, rows: int, keys: int, threads: int, repeats: int) -> dict:
    import torch

    from longstraw.ops.kernels import native

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(1, 1, n, d, generator=g) for n in (rows, keys, keys))
    aten = torch.ops.aten
    calls = {"simd_cpu": lambda: native.attend_full(q, k, v, d ** -0.5),
             "flash_cpu": lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=d ** -0.5)}
    times = {name: [] for name in calls}
    for name, call in calls.items():
        call()  # warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: rows * keys / statistics.median(ts) for name, ts in times.items()}


def capture_child(P: int, state_dtype: str | None, kernel: str, threads: int) -> None:
    import torch

    import longstraw
    from longstraw.ops import kernels

    sys.path.insert(0, str(HERE))
    from stress import RUNS, model_for

    torch.set_num_threads(threads)
    model = model_for(dict(RUNS["fp8_2m"], P=P))
    prompt = torch.randint(0, model.config.vocab_size, (P,), generator=torch.Generator().manual_seed(0))
    with kernels.use(kernel):
        t0 = time.perf_counter()
        state = longstraw.capture(model, prompt, chunk_size=2048, state_dtype=state_dtype)
        seconds = time.perf_counter() - t0
        state.release()
    print(json.dumps(dict(seconds=seconds)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--keys", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--capture-P", type=int, default=131072, help="prompt length of the capture runs (0: none)")
    ap.add_argument("--capture-repeats", type=int, default=2)
    ap.add_argument("--capture-threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "cpu_kernel"))
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        P, sd, kernel, threads = args.child
        capture_child(int(P), None if sd == "fp32" else sd, kernel, int(threads))
        return
    out = Path(args.out)
    rows: list[dict] = []
    for threads in sorted({1, args.threads}):
        for d in args.head_dims:
            rates = kernel_rates(d, args.rows, args.keys, threads, args.repeats)
            record(rows, dict(what="kernel", head_dim=d, rows=args.rows, keys=args.keys, threads=threads,
                              simd_cpu=rates["simd_cpu"], flash_cpu=rates["flash_cpu"],
                              ratio=round(rates["simd_cpu"] / rates["flash_cpu"], 3)), out)
    if args.capture_P:
        for sd in ("fp8", "fp32"):
            secs = {"simd_cpu": [], "flash_cpu": []}
            for _ in range(args.capture_repeats):
                for kernel in secs:
                    res = subprocess.run([sys.executable, __file__, "--child", str(args.capture_P), sd, kernel,
                                          str(args.capture_threads)],
                                         capture_output=True, text=True, check=True)
                    secs[kernel].append(json.loads(res.stdout.strip().splitlines()[-1])["seconds"])
            record(rows, dict(what="capture", P=args.capture_P, state=sd, threads=args.capture_threads,
                              simd_cpu_s=round(min(secs["simd_cpu"]), 2), flash_cpu_s=round(min(secs["flash_cpu"]), 2),
                              runs=secs, ratio=round(min(secs["flash_cpu"]) / min(secs["simd_cpu"]), 3)), out)
    finish(rows, out, plot, table)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for threads in sorted({r["threads"] for r in rows if r["what"] == "kernel"}):
        pts = [r for r in rows if r["what"] == "kernel" and r["threads"] == threads]
        dims = [r["head_dim"] for r in pts]
        ax.plot(dims, [r["simd_cpu"] / 1e9 for r in pts], "o-", label=f"simd_cpu, {threads} thread(s)")
        ax.plot(dims, [r["flash_cpu"] / 1e9 for r in pts], "s--", label=f"flash_cpu, {threads} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("head dim")
    ax.set_ylabel("10⁹ scores / s (float32, no mask)")
    ax.set_title("CPU attention over a prompt part")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows) -> str:
    lines = ["| head dim | threads | simd_cpu (10⁹ scores/s) | flash_cpu | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        if r["what"] == "kernel":
            lines.append(f"| {r['head_dim']} | {r['threads']} | {r['simd_cpu'] / 1e9:.2f} | {r['flash_cpu'] / 1e9:.2f} | "
                         f"{r['ratio']:.2f}× |")
    caps = [r for r in rows if r["what"] == "capture"]
    if caps:
        lines += ["", "| capture of the stress model | P | simd_cpu (s) | flash_cpu (s) | ratio |", "|---|---|---|---|---|"]
        for r in caps:
            lines.append(f"| {r['state']} state, chunk 2,048, {r['threads']} thread(s) | {r['P']:,} | {r['simd_cpu_s']} | "
                         f"{r['flash_cpu_s']} | {r['ratio']:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
