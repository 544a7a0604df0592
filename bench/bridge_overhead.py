"""Per-decode-step overhead of the transformers bridge: longstraw sampling vs the model's own cached decode.

A 48-layer tiny llama (hidden 64) makes each decode step almost all overhead: one new token through 48
layers. longstraw: `capture` a 64-token prompt, then `state.sample(num=1, max_new_tokens=N)`, timed per
step. Plain: the unmodified model decoding greedily with its own `DynamicCache` (no longstraw). The
difference per step is what the bridge costs. `--before REF` measures a second tree (a git revision,
checked out in a temporary worktree) in the same run, so the two are compared side by side; each
measurement runs in a fresh process, one torch thread, best of `--repeats`.

    python bench/bridge_overhead.py --before 8f908ae   # → bench/results/bridge_overhead.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import record

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(layers: int, steps: int, repeats: int) -> dict:
    import torch
    from transformers import DynamicCache

    import longstraw
    from longstraw.testing.models import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("llama", num_hidden_layers=layers)
    prompt = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(0))
    best_ls, best_plain = float("inf"), float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            state = longstraw.capture(model, prompt, chunk_size=64)
            state.sample(num=1, max_new_tokens=2, temperature=0.0)  # warm-up
            t = time.perf_counter()
            state.sample(num=1, max_new_tokens=steps, temperature=0.0)
            best_ls = min(best_ls, (time.perf_counter() - t) / steps)
            cache = DynamicCache(config=model.config)
            out = model(input_ids=prompt[None], past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            best_plain = min(best_plain, (time.perf_counter() - t) / steps)
    return dict(layers=layers, steps=steps, longstraw_ms=best_ls * 1e3, plain_ms=best_plain * 1e3,
                overhead_ms=(best_ls - best_plain) * 1e3)


def measure(tree: Path, label: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(HERE / "bridge_overhead.py"), "--worker", "--layers", str(args.layers),
           "--steps", str(args.steps), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]), tree=label)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="git revision to measure beside the working tree")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "bridge_overhead"))
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.layers, args.steps, args.repeats)))
        return
    rows: list[dict] = []
    out = Path(args.out)
    if args.before:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tmp, args.before], check=True,
                           capture_output=True)
            try:
                record(rows, measure(Path(tmp), f"before ({args.before})", args), out)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tmp], capture_output=True)
    record(rows, measure(ROOT, "this tree", args), out)
    lines = ["| tree | layers | longstraw ms/step | plain transformers ms/step | bridge overhead ms/step |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['tree']} | {r['layers']} | {r['longstraw_ms']:.2f} | {r['plain_ms']:.2f} | {r['overhead_ms']:.2f} |"
              for r in rows]
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
