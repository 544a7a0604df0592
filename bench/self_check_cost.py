"""What the self-check costs: `longstraw.check(model)` against one forward + backward of its own prompt.

    python bench/self_check_cost.py          # → bench/results/self_check_cost.{json,md,png}

For each model (tiny random ones of three layer mixes, and the project's real models, `longstraw real NAME`), as
loaded (every parameter trainable) and with a LoRA adapter (r 8 on q/k/v/o), fp32, `--threads` threads, each model
in a fresh process: the unit is one forward + backward of the check's own tokens (`[prompt + response]` of the
check's P and R, the response log-probs' weighted sum as the loss, gradients of every trainable parameter, as a
training step would take them); the check is `longstraw.check(model)`. Unit and check are alternated and each is the
median of `--repeats`; `first` is the check's first call in the process (it includes preparing the model and the
attention probe, which `capture` pays in any case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "self_check_cost"
MODELS = ["tiny-llama", "tiny-gemma3_text", "tiny-qwen3_next", "smollm2", "gemma3"]


def _build(name: str):
    import torch
    from transformers import AutoModelForCausalLM

    if name.startswith("tiny-"):
        from longstraw.testing.models import tiny_model

        return tiny_model(name[5:], num_hidden_layers=6 if name != "tiny-qwen3_next" else 4)
    from longstraw.tools.real_models import model_path

    return AutoModelForCausalLM.from_pretrained(model_path(name), dtype=torch.float32)


def measure(name: str, adapter: bool, repeats: int, threads: int) -> dict:
    import torch

    from longstraw import self_check
    from longstraw.model.oracles import full_sequence_logprobs
    from longstraw.model.capability import model_parts

    torch.set_num_threads(threads)
    model = _build(name)
    if adapter:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.eval()
    parts = model_parts(model)
    p, _ = self_check.check_shape(parts.config, plan=list(parts.plan))
    r = 5
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, parts.config.vocab_size, (p,), generator=gen)
    response = torch.randint(0, parts.config.vocab_size, (r,), generator=gen)
    weights = torch.linspace(-1.0, 1.0, r)

    def unit():
        (weights * full_sequence_logprobs(model, prompt, response)).sum().backward()
        model.zero_grad(set_to_none=True)

    def timed(fn) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds): the CPU time holds on a machine shared with other work."""
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    timed(unit)  # the first forward + backward allocates what later ones reuse
    first = timed(lambda: self_check.check(model))[0]
    units, checks = [], []
    for _ in range(repeats):
        units.append(timed(unit))
        checks.append(timed(lambda: self_check.check(model)))
    report = self_check.check(model)
    trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
    u, c = statistics.median(w for w, _ in units), statistics.median(w for w, _ in checks)
    uc, cc = statistics.median(t for _, t in units), statistics.median(t for _, t in checks)
    return dict(model=name, adapter="lora" if adapter else "none", P=p, R=r, trainable=trainable, threads=threads,
                unit_s=u, check_s=c, ratio=c / u, unit_cpu_s=uc, check_cpu_s=cc, cpu_ratio=cc / uc, first_s=first,
                first_ratio=first / u, ok=report.ok, logprob_error=report.logprob_error, grad_error=report.grad_error)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "ADAPTER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("ROW " + json.dumps(measure(args.one[0], args.one[1] == "lora", args.repeats, args.threads)))
        return
    rows: list[dict] = []
    for name in args.models:
        for adapter in ("none", "lora"):
            out = subprocess.run([sys.executable, __file__, "--one", name, adapter, "--repeats", str(args.repeats),
                                  "--threads", str(args.threads)], capture_output=True, text=True)
            got = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
            if out.returncode or not got:
                raise SystemExit(f"{name} {adapter} failed:\n{out.stderr[-3000:]}")
            record(rows, json.loads(got[0]), RESULTS)
    finish(rows, RESULTS, _plot, _table)


def _table(rows: list[dict]) -> str:
    lines = ["| model | adapter | P + R | trainable | fwd + bwd | check | check / (fwd + bwd) | CPU time ratio | "
             "ok | first call |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['adapter']} | {r['P']} + {r['R']} | {r['trainable']:,} | "
                     f"{r['unit_s'] * 1e3:.1f} ms | {r['check_s'] * 1e3:.1f} ms | {r['ratio']:.2f} × | "
                     f"{r['cpu_ratio']:.2f} × | {r['ok']} | {r['first_s'] * 1e3:.1f} ms ({r['first_ratio']:.1f} ×) |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['model']}\n{r['adapter']}" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color=["C0" if r["adapter"] == "none" else "C1" for r in rows])
    ax.axhline(2.0, color="k", ls="--", lw=1, label="2 × one forward + backward")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("self-check time / (forward + backward)")
    ax.legend()
    ax.set_title("Self-check cost (fp32, median of repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
