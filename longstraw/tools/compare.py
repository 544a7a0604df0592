"""One GRPO training step three ways, measured in a fresh process: naive batched, naive serial, longstraw.

One step = forward and backward of Σ_g Σ_t advantage_g · logprob(response_g[t]) over G responses
of R tokens that share a prompt of P tokens, with a LoRA adapter trainable:
- `naive_batched`: G full sequences `[prompt + response_g]` in one batch (memory ∝ G·(P+R));
- `naive_serial`: one full sequence at a time, gradients accumulated (memory ∝ P+R, time ∝ G·(P+R));
- `longstraw`: capture the prompt once, replay the G responses serially (memory ≈ durable state + one
  response graph, time ≈ one prompt pass + G·R), detached prompt gradients;
- `longstraw_exact`: the same with `prompt_grad="exact"` and the reverse chunked prompt backward
  (memory ≈ durable state + its gradient + one chunk's graph);
- `longstraw_ckpt`: `longstraw` with `replay(checkpoint_layers=True)` (each decoder layer recomputed in
  backward: the replay graph keeps one layer's activations).

Step memory = peak RSS during the step − RSS just before it, with the peak reset after a warm-up
step on a short prompt (`longstraw.train.memory`). Used by `longstraw demo` and `bench/memory_step.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from peft import LoraConfig, get_peft_model

import longstraw
from longstraw.model.oracles import full_sequence_logprobs

from ..testing.models import (
    BENCH_DENSE,
    BENCH_DSA,
    BENCH_DSV4,
    BENCH_HYBRID,
    BENCH_MLA,
    BENCH_SLIDING,
    BENCH_SSM,
    tiny_model,
)
from ..train.memory import peak_rss_mb, reset_peak, rss_mb

METHODS = ("naive_batched", "naive_serial", "longstraw", "longstraw_exact", "longstraw_ckpt")
#: the benchmark's tiny models (see `bench_model`)
MODELS = ("dense", "hybrid", "dsa", "sliding", "mla", "ssm", "dsv4")


def bench_model(name: str, seed: int = 0, fields: dict | None = None, lora: bool = True):
    """The benchmark's tiny model (`dense`: qwen3, `hybrid`: qwen3_next-like, `dsa`: glm_moe_dsa, `sliding`:
    gemma3_text with 3 sliding layers of 1,024 : 1 global, `mla`: deepseek_v3, `ssm`: granitemoehybrid,
    Mamba-2 + attention, `dsv4`: deepseek_v4) with a LoRA adapter on the attention projections, train mode.
    `fields`: config fields that replace the family's benchmark fields (e.g. narrower attention). `lora` False: every
    parameter trainable (full fine-tuning), no adapter."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}; got {name!r}")
    extra = fields
    arch, fields = {
        "dense": ("qwen3", BENCH_DENSE),
        "hybrid": ("qwen3_next", BENCH_HYBRID),
        "dsa": ("glm_moe_dsa", BENCH_DSA),
        "sliding": ("gemma3_text", BENCH_SLIDING),
        "mla": ("deepseek_v3", BENCH_MLA),
        "ssm": ("granitemoehybrid", BENCH_SSM),
        "dsv4": ("deepseek_v4", BENCH_DSV4),
    }[name]
    model = tiny_model(arch, seed=seed, **(fields if extra is None else extra))
    if not lora:
        return model.train()
    mla = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    targets = {"dsa": mla, "mla": mla, "dsv4": ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"]}.get(
        name, ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    adapter = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
    return get_peft_model(model, adapter).train()


def grpo_step(method: str, model, prompt, responses, advantages, chunk_size: int = 4096) -> dict:
    """Run one step's forward and backward (gradients accumulate in `.grad`); returns details."""
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
    elif method in ("longstraw", "longstraw_exact", "longstraw_ckpt"):
        mode = "exact" if method == "longstraw_exact" else "detached"
        with longstraw.capture(model, prompt, chunk_size=chunk_size, prompt_grad=mode) as state:
            info["durable_mb"] = state.nbytes / 2**20
            info["durable_bytes"] = state.nbytes
            info["capture_peak_rss_mb"] = round(peak_rss_mb(), 1)
            for a, resp in zip(advantages, responses):
                lp = state.replay(resp, checkpoint_layers=method == "longstraw_ckpt").logprobs
                (-(a * lp).sum()).backward()
            state.backward()
    else:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    return info


def measure(
    model_name: str, method: str, P: int, G: int, R: int, threads: int = 1, chunk_size: int = 4096, full: bool = False
) -> dict:
    """Measure one step in this process (call it in a fresh one: see `measure_in_fresh_process`). `full`: full
    fine-tuning instead of the LoRA adapter. The warm-up step leaves the gradients allocated (zeroed), so the step
    memory is what the step adds beyond them, with LoRA and full alike."""
    torch.set_num_threads(threads)
    model = bench_model(model_name, lora=not full)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    responses = [torch.randint(0, vocab, (R,), generator=g) for _ in range(G)]
    advantages = torch.randn(G, generator=g)
    grpo_step(method, model, prompt[:64], responses[:2], advantages[:2], chunk_size)  # warm-up
    model.zero_grad(set_to_none=False)
    row = dict(
        model=model_name,
        method=method,
        P=P,
        G=G,
        R=R,
        threads=torch.get_num_threads(),
        chunk_size=chunk_size,
        trainable="full" if full else "lora",
    )
    return _measured(row, lambda: grpo_step(method, model, prompt, responses, advantages, chunk_size))


def _measured(row: dict, fn) -> dict:
    """`row` plus the step memory (peak RSS − RSS before, peak reset first) and wall time of `fn()`,
    and what `fn` reports (durable state in MiB, ...)."""
    before = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    info = fn()
    wall = time.perf_counter() - t0
    peak = peak_rss_mb()
    durable = info.pop("durable_mb", None)
    capture_peak = info.pop("capture_peak_rss_mb", None)
    if capture_peak is not None:  # peak RSS during capture alone, relative to the same baseline
        info["capture_mem_mb"] = round(capture_peak - before, 1)
    return dict(
        row,
        baseline_rss_mb=round(before, 1),
        peak_rss_mb=round(peak, 1),
        step_mem_mb=round(peak - before, 1),
        wall_s=round(wall, 3),
        durable_mb=None if durable is None else round(durable, 2),
        **info,
        torch=torch.__version__,
    )


SAMPLERS = ("hf_generate", "longstraw")


def sampling_step(method: str, model, prompt, num: int, new_tokens: int, chunk_size: int = 4096) -> dict:
    """Sample `num` responses of exactly `new_tokens` tokens (no stop token) at temperature 1."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if method == "hf_generate":
            torch.manual_seed(0)
            out = model.generate(
                prompt[None],
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=num,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
            return {"generated": int(out.shape[0] * (out.shape[1] - prompt.numel()))}
        if method == "longstraw":
            with longstraw.capture(model, prompt, chunk_size=chunk_size) as state:
                out = state.sample(num, new_tokens, generator=g)
                return {"generated": sum(t.numel() for t in out.tokens), "durable_mb": state.nbytes / 2**20}
    raise ValueError(f"method must be one of {SAMPLERS}; got {method!r}")


def measure_sampling(
    model_name: str, method: str, P: int, G: int, R: int, threads: int = 1, chunk_size: int = 4096
) -> dict:
    """Memory and time of sampling G responses of R tokens from a P-token prompt, in this process."""
    torch.set_num_threads(threads)
    model = bench_model(model_name).eval()
    prompt = torch.randint(0, model.config.vocab_size, (P,), generator=torch.Generator().manual_seed(1))
    sampling_step(method, model, prompt[:64], 2, 4, chunk_size)  # warm-up
    row = dict(model=model_name, method=method, P=P, G=G, R=R, threads=torch.get_num_threads())
    return _measured(row, lambda: sampling_step(method, model, prompt, G, R, chunk_size))


def _limit_address_space(gb: float):
    """preexec_fn: cap the child's address space so that a run too big fails with an allocation
    error instead of waking the kernel's OOM killer on a shared machine."""

    def apply():
        import resource

        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def measure_in_fresh_process(
    model_name: str,
    method: str,
    P: int,
    G: int,
    R: int,
    threads: int = 1,
    chunk_size: int = 4096,
    task: str = "step",
    limit_gb: float | None = None,
    mmap_threshold: int | None = None,
    full: bool = False,
) -> dict:
    """`measure` (task "step") or `measure_sampling` (task "sample") in a fresh Python process.

    `limit_gb`: address-space cap of the child (torch reserves a few GB of address space beyond what
    it touches: leave room). A run that hits it is reported with `exceeded_gb`.
    `mmap_threshold`: fix glibc's mmap threshold in the child (`MALLOC_MMAP_THRESHOLD_`, bytes). Larger
    blocks are then mapped and unmapped with their tensors, so RSS follows the live tensors; glibc's
    adaptive default keeps freed blocks resident, which adds run-to-run noise of tens of MiB to small
    step memories (and costs time: page faults on every large allocation, on both sides of a comparison)."""
    cmd = [
        sys.executable,
        "-m",
        "longstraw.tools.compare",
        model_name,
        method,
        str(P),
        str(G),
        str(R),
        "--threads",
        str(threads),
        "--chunk-size",
        str(chunk_size),
        "--task",
        task,
    ] + (["--full"] if full else [])
    env = dict(os.environ)
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(int(mmap_threshold))
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        preexec_fn=None if limit_gb is None else _limit_address_space(limit_gb),
    )
    if out.returncode != 0:
        err = out.stderr.strip()[-2000:]
        row = dict(model=model_name, method=method, P=P, G=G, R=R, error=err)
        if limit_gb is not None and any(s in err for s in ("DefaultCPUAllocator", "MemoryError", "out of memory")):
            row = dict(model=model_name, method=method, P=P, G=G, R=R, exceeded_gb=limit_gb)
        return row
    row = json.loads(out.stdout.strip().splitlines()[-1])
    if mmap_threshold is not None:
        row["mmap_threshold"] = int(mmap_threshold)
    return row


def format_table(rows: list[dict]) -> str:
    """A Markdown table of measured (or skipped) rows."""
    capture = any("capture_mem_mb" in r for r in rows)
    lines = [
        "| model | P | G | method | step memory (MiB) | durable state (MiB) | step time (s) |"
        + (" capture memory (MiB) |" if capture else ""),
        "|---|---:|---:|---|---:|---:|---:|" + ("---:|" if capture else ""),
    ]
    for r in rows:
        if "skipped" in r:
            mem, t = f"skipped: {r['skipped']}", "–"
        elif "exceeded_gb" in r:
            mem, t = f"> {r['exceeded_gb']:.0f} GB address space (allocation failed)", "–"
        elif "error" in r:
            mem, t = "error: " + r["error"].splitlines()[-1][:60], "–"
        else:
            mem, t = f"{r['step_mem_mb']:.1f}", f"{r['wall_s']:.2f}"
        dur = r.get("durable_mb")
        dur = f"{dur:.2f}" if isinstance(dur, (int, float)) and dur == dur else "–"
        line = f"| {r['model']} | {r['P']} | {r['G']} | {r['method']} | {mem} | {dur} | {t} |"
        if capture:
            line += f" {r['capture_mem_mb']:.1f} |" if "capture_mem_mb" in r else " – |"
        lines.append(line)
    return "\n".join(lines)


def _main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description="Measure one GRPO step or one sampling call in this process; prints one JSON line."
    )
    ap.add_argument("model", choices=MODELS)
    ap.add_argument("method", choices=METHODS + SAMPLERS)
    ap.add_argument("P", type=int)
    ap.add_argument("G", type=int)
    ap.add_argument("R", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--task", choices=["step", "sample"], default="step")
    ap.add_argument("--full", action="store_true", help="step: full fine-tuning instead of the LoRA adapter")
    a = ap.parse_args(argv)
    if a.task == "step":
        print(json.dumps(measure(a.model, a.method, a.P, a.G, a.R, a.threads, a.chunk_size, full=a.full)))
    else:
        print(json.dumps(measure_sampling(a.model, a.method, a.P, a.G, a.R, a.threads, a.chunk_size)))


if __name__ == "__main__":
    _main()
