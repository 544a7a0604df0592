"""Capture speed on the real models: longstraw's chunked capture against transformers' own no-grad forward.

    python bench/real_capture_speed.py            # → bench/results/real_capture_speed.{json,md,png}

For SmolLM2-135M-Instruct (dense) and Gemma 3 270M (five of six layers in a 512-token sliding window), fp32,
2 threads, a prompt of P tokens of real text: the time of `longstraw.capture` at several chunk sizes (and the
automatic choice, `longstraw.model.chunking.auto_chunk_size`) divided by the time of transformers' decoder forward of the same
prompt without the LM head (`model.model(ids)` under `no_grad`, sdpa), both in this process, alternated, the fastest
of `--repeats`. `untiled` is the capture with the blockwise kernel's query tiles switched off (a windowed part walks
every key for every query, as before they existed): the cost a sliding-window capture chunk had.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "real_capture_speed"
CASES = {"smollm2": [4096], "gemma3": [4096, 16384]}


def _prompt(tokenizer, n: int):
    import random

    import torch

    from longstraw.tasks.documents import paragraphs

    paras = paragraphs()
    random.Random(0).shuffle(paras)
    ids = tokenizer("\n\n".join(paras * 4), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:n])


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(CASES))
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=2, help="repeats at P ≤ 4,096 (one above: minutes each)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import longstraw
    from longstraw.ops.kernels import blockwise
    from longstraw.tools.real_models import model_path
    from longstraw.model.capability import model_parts
    from longstraw.prompt_state import default_chunk_size

    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    for name in args.models:
        path = model_path(name)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for P in CASES[name]:
            ids = _prompt(tok, P)
            auto = default_chunk_size(model_parts(model), P)
            variants = [(f"chunk {c}", c, True) for c in args.chunks]
            variants.append((f"auto ({auto})", auto, True))
            if "gemma" in name:
                variants.append(("untiled, chunk 4096", 4096, False))
            with torch.no_grad():  # warm-up of both paths
                model.model(ids[None, :512])
                longstraw.capture(model, ids[:513], chunk_size=512, verify=False)
            best: dict[str, float] = {}
            for _ in range(args.repeats if P <= 4096 else 1):
                with torch.no_grad():
                    t = _timed(lambda: model.model(ids[None, :-1]))
                best["transformers"] = min(best.get("transformers", t), t)
                for label, chunk, tiled in variants:
                    saved = blockwise.QUERY_TILE
                    if not tiled:
                        blockwise.QUERY_TILE = (1 << 40, 1 << 40)
                    try:
                        t = _timed(lambda: longstraw.capture(model, ids, chunk_size=chunk, verify=False))
                    finally:
                        blockwise.QUERY_TILE = saved
                    best[label] = min(best.get(label, t), t)
            for label, seconds in best.items():
                record(rows, dict(model=name, P=P, variant=label, seconds=round(seconds, 2),
                                  vs_transformers=round(seconds / best["transformers"], 3), threads=args.threads),
                       RESULTS)
    finish(rows, RESULTS, _plot, _table)


def _table(rows: list[dict]) -> str:
    lines = ["| model | P | variant | seconds | × transformers' forward |", "|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['P']:,} | {r['variant']} | {r['seconds']:.1f} | {r['vs_transformers']:.2f} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["model"], r["P"]) for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.8), squeeze=False)
    for ax, (name, P) in zip(axes[0], cases):
        got = [r for r in rows if r["model"] == name and r["P"] == P]
        ax.barh([r["variant"] for r in got], [r["vs_transformers"] for r in got], color="tab:blue")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"{name}, P = {P:,}")
        ax.set_xlabel("time / transformers' no-grad forward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
