"""Q questions of one document per GRPO step: one capture of the document against a capture per row.

    python bench/shared_prefix_step.py                                  # SmolLM2 at 6K, Q = 1, 4, 8
    python bench/shared_prefix_step.py --model gemma3 --length 32000    # Gemma 3 270M at 32K
    → bench/results/shared_prefix_step[-MODEL-LENGTH].{json,md,png}

The many-questions documents task (`longstraw.tasks.documents.make_document_rows`: Q access-code questions about
one document of about LENGTH tokens, real English text, in the chat template, the question last). Each
(Q, mode) runs one GRPO step in a fresh process on the same rows with the same G (responses of exactly R tokens,
`ignore_eos`, so that both modes sample the same amount): `shared` captures the document once and reads each row's
question on top of it (`share_prefixes: true`, `rows_per_context: Q`); `row-by-row` captures every row's whole
prompt (`share_prefixes: false`: today's path, which captures each row twice, to sample and to replay, once the step
has more than one prompt). Step memory: peak RSS of the step − RSS before it (`longstraw.train.memory`).

The speed-up sharing allows: if capture is a fraction c of the row-by-row step, one capture instead of Q leaves
c/Q + 1 − c of it, a speed-up of at most 1 / (c/Q + 1 − c) — more only where the rest gets cheaper too. The table
gives c, that bound, the measured speed-up and its fraction of the bound, and the same against Q separate one-row
steps (Q × the Q = 1 step, c from the Q = 1 step: one capture per row, no second one).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import document_rows, finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def run_one(model: str, length: int, q: int, mode: str, G: int, R: int, threads: int, dtype: str) -> dict:
    """One measured GRPO step of Q rows of one document (in this process)."""

    from transformers import AutoTokenizer

    from longstraw.tools.real_models import model_path
    from longstraw.train.config import TrainConfig
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb
    from longstraw.train.trainer import Trainer

    path = model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    rows = document_rows(tok, length, q, 0, "document 0")
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = TrainConfig(model=str(path), dataset=str(data), eval_fraction=0.0, reward_funcs=["contains_answer"],
                          lora=True, lora_r=16, lora_alpha=32, num_generations=G, prompts_per_step=q,
                          rows_per_context=q, share_prefixes=mode == "shared", num_steps=1, max_completion_length=R,
                          ignore_eos=True, dtype=dtype, threads=threads, output_dir=str(Path(d) / "run"),
                          progress=False, eval_at_start=False, save_every=10**6)
        trainer = Trainer(cfg)
        before = rss_mb()
        reset_peak()
        t0 = time.perf_counter()
        m = trainer.train_step(0)
        wall = time.perf_counter() - t0
        peak = peak_rss_mb()
    times = {k: v for k, v in m.items() if k.startswith("time_")}
    return dict(model=model, length=length, prompt_tokens=m["prompt_length"], Q=q, mode=mode, G=G, R=R,
                threads=threads, dtype=dtype, wall_s=wall, step_mem_mb=peak - before,
                meter_step_mem_mb=m["step_mem_mb"],
                durable_mb=m["durable_bytes"] / 2**20, contexts=m["contexts"], shared_frac=m["prompt_shared_frac"],
                capture_s=times.get("time_capture", 0.0), **times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("--length", type=int, default=6144)
    ap.add_argument("--Q", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--R", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--no-row-by-row", action="store_true",
                    help="measure only the shared steps (compared with Q one-row steps: the Q = 1 step)")
    ap.add_argument("--one", nargs=2, metavar=("Q", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        q, mode = int(args.one[0]), args.one[1]
        print("RESULT " + json.dumps(run_one(args.model, args.length, q, mode, args.G, args.R, args.threads,
                                              args.dtype)), flush=True)
        return
    out = RESULTS / f"shared_prefix_step-{args.model}-{args.length}"
    rows: list[dict] = []
    for q in args.Q:
        for mode in ("shared", "row-by-row") if q > 1 and not args.no_row_by_row else ("shared",):
            cmd = [sys.executable, __file__, "--model", args.model, "--length", str(args.length), "--G", str(args.G),
                   "--R", str(args.R), "--threads", str(args.threads), "--dtype", args.dtype, "--one", str(q), mode]
            done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            got = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not got:
                record(rows, dict(model=args.model, length=args.length, Q=q, mode=mode, error=done.stderr[-2000:]), out)
                continue
            record(rows, json.loads(got[0]), out)
    finish(rows, out, _plot, _table)


def speedups(rows: list[dict]) -> list[dict]:
    """Per Q > 1: the measured speed-up of `shared` over `row-by-row` and over Q one-row steps, and the bounds."""
    ok = [r for r in rows if "error" not in r]
    by = {(r["Q"], r["mode"]): r for r in ok}
    one = by.get((1, "shared"))
    out = []
    for (q, mode), shared in sorted(by.items()):
        if mode != "shared" or q == 1:
            continue
        entry = dict(Q=q, shared_s=shared["wall_s"], shared_mem_mb=shared["step_mem_mb"])
        row = by.get((q, "row-by-row"))
        if row is not None:
            c = row["capture_s"] / row["wall_s"]
            bound = 1 / (c / q + 1 - c)
            entry.update(row_s=row["wall_s"], row_mem_mb=row["step_mem_mb"], c=c, bound=bound,
                         speedup=row["wall_s"] / shared["wall_s"])
            entry["of_bound"] = entry["speedup"] / bound
        if one is not None:
            c1 = one["capture_s"] / one["wall_s"]
            bound1 = 1 / (c1 / q + 1 - c1)
            entry.update(one_row_s=one["wall_s"], one_row_mem_mb=one["step_mem_mb"], c1=c1, bound1=bound1,
                         speedup1=q * one["wall_s"] / shared["wall_s"])
            entry["of_bound1"] = entry["speedup1"] / bound1
        out.append(entry)
    return out


def _table(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    lines = ["| Q | mode | prompt tokens | step s | capture s | step memory MiB | state MiB | shared fraction |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in ok:
        lines.append(f"| {r['Q']} | {r['mode']} | {r['prompt_tokens']:,} | {r['wall_s']:.1f} | {r['capture_s']:.1f} | "
                     f"{r['step_mem_mb']:.0f} | {r['durable_mb']:.1f} | {r['shared_frac']:.3f} |")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['Q']} | {r['mode']} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} |")
    lines += ["", "| Q | vs row-by-row: c | bound | speed-up | of bound | vs Q one-row steps: c | bound | speed-up | "
              "of bound |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in speedups(rows):
        lines.append(f"| {s['Q']} | {s.get('c', float('nan')):.3f} | {s.get('bound', float('nan')):.2f}x | "
                     f"{s.get('speedup', float('nan')):.2f}x | {s.get('of_bound', float('nan')):.0%} | "
                     f"{s.get('c1', float('nan')):.3f} | {s.get('bound1', float('nan')):.2f}x | "
                     f"{s.get('speedup1', float('nan')):.2f}x | {s.get('of_bound1', float('nan')):.0%} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("shared", "o-"), ("row-by-row", "s--")):
        pts = sorted((r["Q"], r["wall_s"], r["step_mem_mb"]) for r in ok if r["mode"] == mode or r["Q"] == 1)
        if pts:
            qs, ts, ms = zip(*pts)
            axes[0].plot(qs, ts, style, label=mode)
            axes[1].plot(qs, ms, style, label=mode)
    axes[0].set_ylabel("step wall time (s)")
    axes[1].set_ylabel("step memory (MiB, peak RSS − before)")
    for ax in axes:
        ax.set_xlabel("Q: questions of one document per step")
        ax.grid(True, alpha=0.3)
        ax.legend()
    first = ok[0] if ok else {"model": "?", "length": 0}
    fig.suptitle(f"{first['model']}, one document of ~{first['length']:,} tokens, G = {first.get('G', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
