"""Step memory and time of one GRPO training step: naive batched, naive serial, longstraw.

One step = forward and backward of Σ_g Σ_t advantage_g · logprob(response_g[t]) over G responses of
R tokens that share a prompt of P tokens, LoRA trainable. Each configuration runs in a fresh process
(`--worker`); step memory = peak RSS during the step − RSS just before it (peak reset through
/proc/self/clear_refs after a warm-up step). Naive batched configurations whose estimate (G × the
measured naive-serial step memory at the same P) exceeds `--limit-gb` are skipped and listed, and so
are naive configurations that process more than `--max-naive-tokens` tokens (G·(P+R)) to keep the
whole grid within about an hour on 2 cores; their per-sequence cost is the same as at smaller G.

    python bench/memory_step.py                       # full grid → bench/results/memory_step.{json,png}
    python bench/memory_step.py --models dense --P 4096 --G 2 8 --out /tmp/quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("naive_batched", "naive_serial", "longstraw")


def build(model_name: str, seed: int = 0):
    import torch
    from peft import LoraConfig, get_peft_model
    from longstraw.models import BENCH_DENSE, BENCH_HYBRID, tiny_model

    arch, fields = {"dense": ("qwen3", BENCH_DENSE), "hybrid": ("qwen3_next", BENCH_HYBRID)}[model_name]
    fields = {k: v for k, v in fields.items()}
    model = tiny_model(arch, seed=seed, **fields)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    model = get_peft_model(model, lora)
    model.train()
    return model, torch


def step(method: str, model, prompt, responses, advantages, chunk_size: int):
    """One training step; returns {"durable_mb": ...} for longstraw."""
    import torch
    import longstraw
    from longstraw.reference import full_sequence_logprobs

    info = {}
    if method == "naive_batched":
        seqs = torch.stack([torch.cat([prompt, r]) for r in responses])
        r = responses[0].numel()
        logits = model(input_ids=seqs, logits_to_keep=r + 1).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.stack(responses)[..., None]).squeeze(-1)
        (-(advantages[:, None] * lp).sum()).backward()
    elif method == "naive_serial":
        for a, resp in zip(advantages, responses):
            lp = full_sequence_logprobs(model, prompt, resp, logits_to_keep=True)
            (-(a * lp).sum()).backward()
    else:
        with longstraw.capture(model, prompt, chunk_size=chunk_size) as state:
            info["durable_mb"] = state.nbytes / 2**20
            for a, resp in zip(advantages, responses):
                lp = state.replay(resp).logprobs
                (-(a * lp).sum()).backward()
    return info


def worker(args) -> dict:
    import torch
    from longstraw.memory import peak_rss_mb, reset_peak, rss_mb

    torch.set_num_threads(args.threads)
    model, _ = build(args.model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.P,), generator=g)
    responses = [torch.randint(0, vocab, (args.R,), generator=g) for _ in range(args.G)]
    advantages = torch.randn(args.G, generator=g)
    # warm-up on a short prompt: loads kernels and allocator pools into the baseline
    step(args.method, model, prompt[:64], responses[:2], advantages[:2], args.chunk_size)
    model.zero_grad(set_to_none=False)
    before = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    info = step(args.method, model, prompt, responses, advantages, args.chunk_size)
    wall = time.perf_counter() - t0
    peak = peak_rss_mb()
    return dict(
        model=args.model, method=args.method, P=args.P, G=args.G, R=args.R, threads=torch.get_num_threads(),
        chunk_size=args.chunk_size, baseline_rss_mb=round(before, 1), peak_rss_mb=round(peak, 1),
        step_mem_mb=round(peak - before, 1), wall_s=round(wall, 3),
        durable_mb=round(info.get("durable_mb", float("nan")), 2), torch=torch.__version__,
    )


def run_one(model, method, P, G, R, threads, chunk_size) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--method", method, "--P", str(P),
           "--G", str(G), "--R", str(R), "--threads", str(threads), "--chunk-size", str(chunk_size)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return dict(model=model, method=method, P=P, G=G, R=R, error=out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    styles = {"naive_batched": "s--", "naive_serial": "o-.", "longstraw": "^-"}
    for ax, m in zip(axes[0], models):
        for method in METHODS:
            for G in sorted({r["G"] for r in rows}):
                pts = sorted((r["P"], r["step_mem_mb"]) for r in rows
                             if r["model"] == m and r["method"] == method and r["G"] == G and "step_mem_mb" in r)
                if pts:
                    ax.plot(*zip(*pts), styles[method], label=f"{method} G={G}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length P (tokens)")
        ax.set_ylabel("step memory (MiB, peak RSS − baseline)")
        ax.set_title(f"{m} tiny model, R={rows[0]['R']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows) -> str:
    lines = ["| model | P | G | method | step memory (MiB) | durable state (MiB) | step time (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            mem, t = f"skipped: {r['skipped']}", "–"
        elif "error" in r:
            mem, t = "error", "–"
        else:
            mem, t = f"{r['step_mem_mb']:.1f}", f"{r['wall_s']:.2f}"
        dur = r.get("durable_mb")
        dur = f"{dur:.2f}" if isinstance(dur, float) and dur == dur else "–"
        lines.append(f"| {r['model']} | {r['P']} | {r['G']} | {r['method']} | {mem} | {dur} | {t} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="dense")
    ap.add_argument("--method", default="longstraw")
    ap.add_argument("--models", nargs="+", default=["dense", "hybrid"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--P", nargs="+", type=int, default=[4096, 16384, 32768])
    ap.add_argument("--G", nargs="+", type=int, default=[2, 8, 32])
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--max-naive-tokens", type=int, default=600_000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_step"))
    args = ap.parse_args(argv)
    if args.worker:
        args.P, args.G = args.P[0], args.G[0]
        print(json.dumps(worker(args)))
        return
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        for P in args.P:
            serial_mb = None
            for method in ("naive_serial", "longstraw", "naive_batched"):
                if method not in args.methods:
                    continue
                for G in args.G:
                    if method != "longstraw" and G * (P + args.R) > args.max_naive_tokens:
                        rows.append(dict(model=model, method=method, P=P, G=G, R=args.R,
                                         skipped=f"time budget: G·(P+R) = {G * (P + args.R)} tokens"))
                    elif method == "naive_batched" and serial_mb is not None and G * serial_mb > args.limit_gb * 1024:
                        rows.append(dict(model=model, method=method, P=P, G=G, R=args.R,
                                         skipped=f"estimated {G * serial_mb / 1024:.0f} GB > {args.limit_gb:.0f} GB"))
                    else:
                        rows.append(run_one(model, method, P, G, args.R, args.threads, args.chunk_size))
                        if method == "naive_serial" and "step_mem_mb" in rows[-1]:
                            serial_mb = rows[-1]["step_mem_mb"] if serial_mb is None else max(serial_mb, rows[-1]["step_mem_mb"])
                    print(json.dumps(rows[-1]), flush=True)
                    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    plot([r for r in rows if "step_mem_mb" in r], out.with_suffix(".png"))
    out.with_suffix(".md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
