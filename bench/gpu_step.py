"""One GRPO step on one CUDA GPU for models of real width, longstraw against naive serial GRPO (bench/gpu.sh).

Models (random weights, bf16, LoRA r=16 on the attention projections), with fewer layers than the real ones so
that the whole grid fits the time box:
- `dense`: Qwen3-8B-shaped (hidden 4096, 32 query heads / 8 KV heads of 128, MLP 12288, vocab 151,936).
- `hybrid`: Qwen3.5-shaped (transformers' `qwen3_5_text` defaults: hidden 4096, 3 gated-DeltaNet layers per
  full-attention layer of 16 query heads / 4 KV heads of 256, vocab 248,320).

Methods, each in its own fresh process (its own CUDA allocator), cells in increasing P:
- `detached`: capture once per P (no grad), then for each G: G replays with backward, one optimizer step.
- `exact`: per (P, G): capture with prompt_grad="exact", G replays with backward, `state.backward()`, one step.
- `naive`: per (P, G): G full-sequence forwards/backwards of [prompt + response] (SDPA flash attention,
  logits of the response only), one step; the first out-of-memory ends the series and is reported.
Memory: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, per stage, minus what was
allocated before the step (weights, adapters, optimizer state). Time: wall clock around each stage with the
device synchronised. Each cell is skipped, and says so, when its predicted time exceeds the series' time box.

Also, once per model: the plain no-grad forward of the prompt with SDPA flash (capture's yardstick), and the
host synchronisations of one replay with backward (`torch.cuda.set_sync_debug_mode`).

    python bench/gpu_step.py --out DIR --budget-s 300            # the grid (bench/gpu.sh calls this)
    python bench/gpu_step.py --out DIR --smoke                   # tiny sizes, any device: rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

PS = [32768, 131072, 524288, 1048576]
GS = [2, 8]
R = 256
#: decoder layers of each model (the real ones have 36 and 64): the dense model's every layer is full attention
LAYERS = {"dense": 2, "hybrid": 4}
METHODS = ["detached", "exact", "naive"]
#: each method's share of its model's time box (what one leaves unused passes to the next)
SHARE = {"detached": 0.45, "exact": 0.3, "naive": 0.25}
#: the plain forward (capture's yardstick) is measured up to this P
PLAIN_MAX = 131072
MODELS = ["dense", "hybrid"]


def build(name: str, device, dtype, smoke: bool, max_len: int):
    import transformers
    from peft import LoraConfig, get_peft_model

    if name == "dense":
        fields = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6)
        cfg = transformers.CONFIG_MAPPING["qwen3"](num_hidden_layers=LAYERS[name], max_position_embeddings=max_len,
                                                   **fields)
    else:
        cfg = transformers.CONFIG_MAPPING["qwen3_5_text"](num_hidden_layers=LAYERS[name],
                                                           max_position_embeddings=max_len)
    if smoke:  # same family, tiny widths
        for k, v in dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16).items():
            if hasattr(cfg, k):
                setattr(cfg, k, v)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      init_lora_weights=False)
    model = get_peft_model(model, lora)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters in float32 (longstraw.train.devices)
    return model.train()


class Clock:
    """Wall time and allocator peak of one stage on the device."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = 0
        self.s = time.perf_counter() - self.t0


def mib(x: int) -> float:
    return round(x / 2**20, 1)


def worker(args) -> None:
    """The series of one model in this process, a method after the other (the allocator's peak is reset per
    stage, so a method's numbers do not depend on what ran before); rows appended to args.rows as JSON lines."""
    import longstraw

    warnings.filterwarnings("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ps, gs, r = (args.P, args.G, args.R)
    end = time.time() + args.budget_s
    model = build(args.model, device, dtype, args.smoke, max(ps) + r + 16)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt_all = torch.randint(0, vocab, (max(ps),), generator=g).to(device)
    responses = [torch.randint(0, vocab, (r,), generator=g).to(device) for _ in range(max(gs))]
    adv = torch.randn(max(gs), generator=g).tolist()
    out = Path(args.rows)

    method = None

    def emit(row):
        row = dict(model=args.model, method=method, R=r, layers=LAYERS[args.model], **row)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    # warm-up (kernels, allocator), then the baseline: weights, adapters, optimizer state
    with longstraw.capture(model, prompt_all[:300], chunk_size=128) as st:
        (st.replay(responses[0][:8]).logprobs.sum()).backward()
    opt_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    method = "-"
    emit(dict(kind="baseline", weights_mib=mib(base), device=torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu"))

    def plain_forward(p):
        with Clock(device) as c, torch.no_grad():
            model(input_ids=prompt_all[None, :p], logits_to_keep=1)
        return c

    chunk = args.chunk
    for i, method in enumerate(args.methods):
        weights = [SHARE[m] for m in args.methods[i:]]
        deadline = time.time() + (end - time.time()) * weights[0] / sum(weights)
        last = None  # (P, seconds of the last cell) for the time prediction
        for p in ps:
            prompt = prompt_all[:p]
            predicted = 0.0 if last is None else last[1] * (p / last[0]) ** 2
            if time.time() + predicted > deadline:
                emit(dict(kind="skipped", P=p, why=f"predicted {predicted:.0f} s > {deadline - time.time():.0f} s left"))
                break
            t_cell = time.perf_counter()
            try:
                if method == "detached":
                    if args.plain and p <= max(PLAIN_MAX, min(ps)):
                        try:
                            c = plain_forward(p)
                            emit(dict(kind="plain_forward", P=p, time_s=round(c.s, 3), peak_mib=mib(c.peak - base)))
                        except torch.OutOfMemoryError:
                            emit(dict(kind="plain_forward", P=p, oom=True))
                            torch.cuda.empty_cache()
                    with Clock(device) as cap:
                        state = longstraw.capture(model, prompt, chunk_size=chunk)
                    state_b = state.nbytes
                    for gcount in gs:
                        with Clock(device) as rep:
                            for a, resp in zip(adv[:gcount], responses[:gcount]):
                                (-a * state.replay(resp).logprobs.sum()).backward()
                        with Clock(device) as st_:
                            opt_step()
                        emit(dict(kind="step", P=p, G=gcount, capture_s=round(cap.s, 3), replay_s=round(rep.s, 3),
                                  opt_s=round(st_.s, 4), step_s=round(cap.s + rep.s + st_.s, 3),
                                  state_mib=mib(state_b), capture_peak_mib=mib(cap.peak - base),
                                  replay_peak_mib=mib(rep.peak - base), step_peak_mib=mib(max(cap.peak, rep.peak) - base)))
                    state.release()
                elif method == "exact":
                    for gcount in gs:
                        with Clock(device) as cap:
                            state = longstraw.capture(model, prompt, chunk_size=chunk, prompt_grad="exact")
                        with Clock(device) as rep:
                            for a, resp in zip(adv[:gcount], responses[:gcount]):
                                (-a * state.replay(resp).logprobs.sum()).backward()
                        with Clock(device) as rev:
                            state.backward()
                        with Clock(device) as st_:
                            opt_step()
                        state_b = state.nbytes
                        state.release()
                        emit(dict(kind="step", P=p, G=gcount, capture_s=round(cap.s, 3), replay_s=round(rep.s, 3),
                                  reverse_s=round(rev.s, 3), opt_s=round(st_.s, 4),
                                  step_s=round(cap.s + rep.s + rev.s + st_.s, 3), state_mib=mib(state_b),
                                  capture_peak_mib=mib(cap.peak - base), replay_peak_mib=mib(rep.peak - base),
                                  reverse_peak_mib=mib(rev.peak - base),
                                  step_peak_mib=mib(max(cap.peak, rep.peak, rev.peak) - base)))
                else:
                    from longstraw.model.oracles import full_sequence_logprobs

                    for gcount in gs:
                        with Clock(device) as fb:
                            for a, resp in zip(adv[:gcount], responses[:gcount]):
                                (-a * full_sequence_logprobs(model, prompt, resp, logits_to_keep=True).sum()).backward()
                        with Clock(device) as st_:
                            opt_step()
                        emit(dict(kind="step", P=p, G=gcount, forward_backward_s=round(fb.s, 3), opt_s=round(st_.s, 4),
                                  step_s=round(fb.s + st_.s, 3), step_peak_mib=mib(fb.peak - base)))
            except torch.OutOfMemoryError as e:
                opt.zero_grad(set_to_none=True)
                emit(dict(kind="oom", P=p, error=str(e).split("\n")[0][:200]))
                break
            last = (p, time.perf_counter() - t_cell)
            if device.type == "cuda":
                torch.cuda.empty_cache()


    if "detached" in args.methods and device.type == "cuda":  # host synchronisations of one replay + backward
        with longstraw.capture(model, prompt_all[:4096], chunk_size=chunk) as st:
            resp = responses[0]
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    st.replay(resp).logprobs.sum().backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            sync_lines = sorted({str(w.message).split("\n")[0][:120] for w in caught})
        opt.zero_grad(set_to_none=True)
        method = "detached"
        emit(dict(kind="syncs", P=4096, count=len(caught), distinct=sync_lines[:10]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results" / "gpu"))
    ap.add_argument("--budget-s", type=float, default=300.0, help="time box of the whole grid")
    ap.add_argument("--smoke", action="store_true", help="tiny models and prompts (rehearsal on any device)")
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--P", nargs="+", type=int, default=None)
    ap.add_argument("--G", nargs="+", type=int, default=GS)
    ap.add_argument("--R", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None, help="capture chunk (default 16,384; smoke 64)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.P = args.P or ([256, 1024] if args.smoke else PS)
    args.R = args.R or (16 if args.smoke else R)
    args.chunk = args.chunk or (64 if args.smoke else 16384)
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "gpu_step.jsonl"
    rows_path.unlink(missing_ok=True)
    start = time.time()
    for i, m in enumerate(args.models):
        left = args.budget_s - (time.time() - start)
        share = left / (len(args.models) - i)
        if share < 20:
            with rows_path.open("a") as f:
                f.write(json.dumps(dict(model=m, kind="skipped", why="time box spent")) + "\n")
            continue
        cmd = [sys.executable, __file__, "--worker", "--model", m, "--methods", *args.methods, "--rows", str(rows_path),
               "--budget-s", str(max(share - 20, 5)), "--R", str(args.R), "--chunk", str(args.chunk),
               "--P", *map(str, args.P), "--G", *map(str, args.G)] + (["--smoke"] if args.smoke else []) + ["--plain"]
        try:
            proc = subprocess.run(cmd, timeout=share + 30, capture_output=True, text=True)
            if proc.returncode:
                tail = (proc.stderr or "").strip().splitlines()[-3:]
                with rows_path.open("a") as f:
                    f.write(json.dumps(dict(model=m, kind="error", rc=proc.returncode, tail=tail)) + "\n")
                print("\n".join(tail), file=sys.stderr)
        except subprocess.TimeoutExpired:
            with rows_path.open("a") as f:
                f.write(json.dumps(dict(model=m, kind="timeout", after_s=round(share + 30))) + "\n")
    report(rows_path, out)
    rows_path.unlink()  # its rows are in gpu_step.json now


def report(rows_path: Path, out: Path) -> None:
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    (out / "gpu_step.json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | method | P | G | step s | capture s | replay / fwd+bwd s | state MiB | step peak MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("kind") == "step":
            lines.append(f"| {r['model']} | {r['method']} | {r['P']:,} | {r['G']} | {r['step_s']} | "
                         f"{r.get('capture_s', '')} | {r.get('replay_s', r.get('forward_backward_s', ''))} | "
                         f"{r.get('state_mib', '')} | {r['step_peak_mib']:,} |")
        elif r.get("kind") in ("oom", "skipped", "error", "timeout"):
            lines.append(f"| {r['model']} | {r.get('method', '')} | {r.get('P', '')} | | {r['kind']}: "
                         f"{r.get('why', r.get('error', r.get('tail', '')))} | | | | |")
    plain = {(r["model"], r["P"]): r for r in rows if r.get("kind") == "plain_forward" and not r.get("oom")}
    ratios = []
    for r in rows:
        if r.get("kind") == "step" and r["method"] == "detached" and r["G"] == min(GS) and (r["model"], r["P"]) in plain:
            ratios.append(f"| {r['model']} | {r['P']:,} | {r['capture_s']} | {plain[(r['model'], r['P'])]['time_s']} | "
                          f"{r['capture_s'] / plain[(r['model'], r['P'])]['time_s']:.2f} |")
    if ratios:
        lines += ["", "| model | P | capture s | plain SDPA forward s | ratio |", "|---|---:|---:|---:|---:|"] + ratios
    text = "\n".join(lines)
    (out / "gpu_step.md").write_text(text + "\n")
    print(text)
    try:
        plot(rows, out / "gpu_step.png")
    except Exception as e:  # the numbers matter more than the figure
        print("plot failed:", e)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"detached": "o-", "exact": "s--", "naive": "x:"}
    for model in MODELS:
        for method in METHODS:
            for gcount in GS:
                pts = sorted((r["P"], r["step_peak_mib"] / 1024, r["step_s"]) for r in rows if r.get("kind") == "step"
                             and r["model"] == model and r["method"] == method and r["G"] == gcount)
                if pts:
                    xs, mem, t = zip(*pts)
                    label = f"{model} {method} G={gcount}"
                    axes[0].plot(xs, mem, styles[method], label=label)
                    axes[1].plot(xs, t, styles[method], label=label)
    for ax, yl in zip(axes, ("step peak above weights (GiB)", "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens P")
        ax.set_ylabel(yl)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("One GRPO step on one GPU, bf16, LoRA, R = 256")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
