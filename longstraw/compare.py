"""One GRPO training step three ways, measured in a fresh process: naive batched, naive serial, longstraw.

One step = forward and backward of Σ_g Σ_t advantage_g · logprob(response_g[t]) over G responses
of R tokens that share a prompt of P tokens, with a LoRA adapter trainable:
- `naive_batched`: G full sequences `[prompt + response_g]` in one batch (memory ∝ G·(P+R));
- `naive_serial`: one full sequence at a time, gradients accumulated (memory ∝ P+R, time ∝ G·(P+R));
- `longstraw`: capture the prompt once, replay the G responses serially (memory ≈ durable state + one
  response graph, time ≈ one prompt pass + G·R).

Step memory = peak RSS during the step − RSS just before it, with the peak reset after a warm-up
step on a short prompt (`longstraw.memory`). Used by `longstraw demo` and `bench/memory_step.py`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

METHODS = ("naive_batched", "naive_serial", "longstraw")
#: benchmark model name → (architecture, config fields)
MODELS = ("dense", "hybrid")


def bench_model(name: str, seed: int = 0):
    """The benchmark's tiny model (`dense`: qwen3, `hybrid`: qwen3_next-like) with a LoRA adapter, train mode."""
    from peft import LoraConfig, get_peft_model

    from .models import BENCH_DENSE, BENCH_HYBRID, tiny_model

    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}; got {name!r}")
    arch, fields = {"dense": ("qwen3", BENCH_DENSE), "hybrid": ("qwen3_next", BENCH_HYBRID)}[name]
    model = tiny_model(arch, seed=seed, **fields)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False)
    return get_peft_model(model, lora).train()


def grpo_step(method: str, model, prompt, responses, advantages, chunk_size: int = 4096) -> dict:
    """Run one step's forward and backward (gradients accumulate in `.grad`); returns details."""
    import longstraw
    from longstraw.reference import full_sequence_logprobs

    info: dict = {}
    if method == "naive_batched":
        r = responses[0].numel()
        seqs = torch.stack([torch.cat([prompt, resp]) for resp in responses])
        logits = model(input_ids=seqs, logits_to_keep=r + 1).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.stack(responses)[..., None]).squeeze(-1)
        (-(advantages[:, None] * lp).sum()).backward()
    elif method == "naive_serial":
        for a, resp in zip(advantages, responses):
            lp = full_sequence_logprobs(model, prompt, resp, logits_to_keep=True)
            (-(a * lp).sum()).backward()
    elif method == "longstraw":
        with longstraw.capture(model, prompt, chunk_size=chunk_size) as state:
            info["durable_mb"] = state.nbytes / 2**20
            for a, resp in zip(advantages, responses):
                lp = state.replay(resp).logprobs
                (-(a * lp).sum()).backward()
    else:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    return info


def measure(model_name: str, method: str, P: int, G: int, R: int, threads: int = 1, chunk_size: int = 4096) -> dict:
    """Measure one step in this process (call it in a fresh one: see `measure_in_fresh_process`)."""
    from .memory import peak_rss_mb, reset_peak, rss_mb

    torch.set_num_threads(threads)
    model = bench_model(model_name)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    responses = [torch.randint(0, vocab, (R,), generator=g) for _ in range(G)]
    advantages = torch.randn(G, generator=g)
    grpo_step(method, model, prompt[:64], responses[:2], advantages[:2], chunk_size)  # warm-up
    model.zero_grad(set_to_none=False)
    before = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    info = grpo_step(method, model, prompt, responses, advantages, chunk_size)
    wall = time.perf_counter() - t0
    peak = peak_rss_mb()
    return dict(
        model=model_name, method=method, P=P, G=G, R=R, threads=torch.get_num_threads(), chunk_size=chunk_size,
        baseline_rss_mb=round(before, 1), peak_rss_mb=round(peak, 1), step_mem_mb=round(peak - before, 1),
        wall_s=round(wall, 3), durable_mb=round(info["durable_mb"], 2) if "durable_mb" in info else None,
        torch=torch.__version__,
    )


def measure_in_fresh_process(model_name: str, method: str, P: int, G: int, R: int, threads: int = 1,
                             chunk_size: int = 4096) -> dict:
    cmd = [sys.executable, "-m", "longstraw.compare", model_name, method, str(P), str(G), str(R),
           "--threads", str(threads), "--chunk-size", str(chunk_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        return dict(model=model_name, method=method, P=P, G=G, R=R, error=out.stderr.strip()[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    """A Markdown table of measured (or skipped) rows."""
    lines = ["| model | P | G | method | step memory (MiB) | durable state (MiB) | step time (s) |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            mem, t = f"skipped: {r['skipped']}", "–"
        elif "error" in r:
            mem, t = "error: " + r["error"].splitlines()[-1][:60], "–"
        else:
            mem, t = f"{r['step_mem_mb']:.1f}", f"{r['wall_s']:.2f}"
        dur = r.get("durable_mb")
        dur = f"{dur:.2f}" if isinstance(dur, (int, float)) and dur == dur else "–"
        lines.append(f"| {r['model']} | {r['P']} | {r['G']} | {r['method']} | {mem} | {dur} | {t} |")
    return "\n".join(lines)


def _main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Measure one GRPO step in this process; prints one JSON line.")
    ap.add_argument("model", choices=MODELS)
    ap.add_argument("method", choices=METHODS)
    ap.add_argument("P", type=int)
    ap.add_argument("G", type=int)
    ap.add_argument("R", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=4096)
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.model, a.method, a.P, a.G, a.R, a.threads, a.chunk_size)))


if __name__ == "__main__":
    _main()
