"""The pieces of a step on one CUDA GPU, each against its candidates (bench/gpu.sh):

1. `kernels`: one attention part of a replay (R = 256 queries of 32 heads / 8 KV heads of 128, or 16 / 4 of 256,
   over T prompt keys), forward and the dq-only backward of detached mode, for every kernel of
   `longstraw.ops.kernels` that computes it; last, `flex_attention(return_lse=True)` (forward, compiled) as a candidate.
2. `lm_head`: log-probs of 8 × 256 response tokens through a 151,936 × 4,096 head, forward + backward, with
   longstraw's chunked head, the plain `log_softmax` of all logits, and Liger-Kernel's fused linear
   cross-entropy where installed.
3. `sampler`: G = 8 responses of 128 tokens from one P = 32,768 prompt on the Qwen3-8B-shaped model of
   `gpu_step.py`, with longstraw's shared-prefix sampler and with `model.generate` (static cache).
4. `offload`: the detached step (capture, 8 replays with backward) at P = 131,072 with the state on the GPU and
   in pinned host memory (`state_device="cpu"`): time and allocator peak.

Each section is timed (CUDA events / synchronised wall clock, median of a few runs) and written to
`gpu_kernels.json` as it finishes; a section that fails is recorded with its error and the next one runs.

    python bench/gpu_kernels.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def timed(fn, repeat=5, device=None):
    """Median seconds of `fn()` (after one warm-up) and the allocator peak of one run, in MiB above the start."""
    cuda = torch.cuda.is_available()
    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    times.sort()
    return round(times[len(times) // 2], 5), peak


def kernels_section(smoke, device, emit):
    from longstraw.ops import kernels
    from longstraw.ops.kernels import Part

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(32, 8, 128), (16, 4, 256)]
    lengths = [1024] if smoke else [32768, 131072]
    r = 32 if smoke else 256
    for h, hkv, d in shapes:
        for t in lengths:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, h, r, d, generator=g).to(device, dtype)
            k = torch.randn(1, hkv, t, d, generator=g).to(device, dtype)
            v = torch.randn(1, hkv, t, d, generator=g).to(device, dtype)
            part = Part(t, 0, None, None, d ** -0.5, 1024)
            g_out = torch.randn_like(q)
            for name, kernel in kernels.KERNELS.items():
                if name == "reference" or kernel.why_not(q, k, v, part) is not None:
                    continue
                out, lse = kernel.forward(q, k, v, part)
                if name == "blockwise":
                    bwd = lambda: kernel.backward(g_out, q, k, v, out, lse, part, False, None)  # noqa: E731
                else:
                    bwd = lambda: kernel.backward(g_out, q, k, v, out, lse, part, False)  # noqa: E731
                f_s, f_peak = timed(lambda: kernel.forward(q, k, v, part))
                b_s, b_peak = timed(bwd)
                flops = 4 * h * r * t * d
                emit(dict(section="kernels", kernel=name, heads=h, kv_heads=hkv, head_dim=d, R=r, T=t,
                          forward_s=f_s, forward_tflops=round(flops / f_s / 1e12, 1), forward_peak_mib=f_peak,
                          dq_backward_s=b_s, dq_backward_peak_mib=b_peak))


def lm_head_section(smoke, device, emit):
    from longstraw.ops.logprobs import chunked_logprobs, reference_logprobs

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    v, hdim, n = (4096, 256, 64) if smoke else (151936, 4096, 8 * 256)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hdim, v, bias=False).to(device, dtype)
    hidden = (torch.randn(n, hdim, generator=g) * 0.5).to(device, dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g).to(device)

    def ours():
        lp, _ = chunked_logprobs(hidden, head, y)
        (-lp.sum()).backward()

    def plain():
        lp, _ = reference_logprobs(hidden, head, y)
        (-lp.sum()).backward()

    def frozen(fn):  # LoRA: the head does not train, only the hidden states get a gradient
        def run():
            head.weight.requires_grad_(False)
            try:
                fn()
            finally:
                head.weight.requires_grad_(True)
        return run

    candidates = [("longstraw chunked", ours), ("plain log_softmax", plain),
                  ("longstraw chunked, frozen head", frozen(ours)), ("plain log_softmax, frozen head", frozen(plain))]
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")
        candidates.append(("liger fused linear CE", lambda: liger(head.weight, hidden, y).backward()))
    except Exception as e:
        emit(dict(section="lm_head", method="liger fused linear CE", error=f"not available: {str(e)[:120]}"))
    for name, fn in candidates:
        try:
            s, peak = timed(fn, repeat=3)
            emit(dict(section="lm_head", method=name, tokens=n, vocab=v, hidden=hdim, time_s=s, peak_mib=peak))
        except torch.OutOfMemoryError as e:
            emit(dict(section="lm_head", method=name, error=str(e)[:120]))
        head.weight.grad = hidden.grad = None


def _model(smoke, device):
    import gpu_step

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return gpu_step.build("dense", device, dtype, smoke, 1 << 20)


def sampler_section(smoke, device, emit):
    import longstraw

    model = _model(smoke, device).eval()
    p, g_count, new = (512, 4, 16) if smoke else (32768, 8, 128)
    prompt = torch.randint(0, model.config.vocab_size, (p,), generator=torch.Generator().manual_seed(1)).to(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def ours():
        with torch.no_grad(), longstraw.capture(model, prompt, chunk_size=16384) as st:
            t0 = time.perf_counter()
            st.sample(g_count, new, generator=gen)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

    def theirs():
        with torch.no_grad():
            model.generate(prompt[None], do_sample=True, top_k=0, num_return_sequences=g_count, max_new_tokens=new,
                           min_new_tokens=new, eos_token_id=None, pad_token_id=0, cache_implementation="static")

    for name, fn in (("longstraw capture + sample", ours), ("generate, static cache", theirs)):
        try:
            s, peak = timed(fn, repeat=2)
            row = dict(section="sampler", method=name, P=p, G=g_count, new_tokens=new, time_s=s, peak_mib=peak,
                       tokens_per_s=round(g_count * new / s, 1))
            if name.startswith("longstraw"):
                row["decode_only_s"] = round(fn(), 4)
            emit(row)
        except Exception as e:
            emit(dict(section="sampler", method=name, error=str(e)[:200]))


def offload_section(smoke, device, emit):
    import longstraw

    if device.type != "cuda" and not smoke:
        return
    model = _model(smoke, device)
    params = [p for p in model.parameters() if p.requires_grad]
    p, g_count, r = (1024, 4, 16) if smoke else (131072, 8, 256)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (p,), generator=gen).to(device)
    responses = [torch.randint(0, model.config.vocab_size, (r,), generator=gen).to(device) for _ in range(g_count)]
    for where in (None, "cpu"):
        def step():
            with longstraw.capture(model, prompt, chunk_size=16384, state_device=where) as st:
                for resp in responses:
                    st.replay(resp).logprobs.sum().backward()
            for q in params:
                q.grad = None
        try:
            s, peak = timed(step, repeat=1)
            emit(dict(section="offload", state_device=where or "gpu", P=p, G=g_count, R=r, step_s=s,
                      step_peak_mib=peak))
        except Exception as e:
            emit(dict(section="offload", state_device=where or "gpu", error=str(e)[:200]))


def flex_section(smoke, device, emit):
    """`flex_attention(return_lse=True)`, compiled, on the prompt part of `kernels` (forward only): a candidate."""
    if device.type != "cuda":
        return
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    r = 256
    for h, hkv, d in [(32, 8, 128)]:
        for t in [32768, 131072]:
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, hkv, (h // hkv) * r, d, generator=g).to(device, torch.bfloat16)
            k = torch.randn(1, hkv, t, d, generator=g).to(device, torch.bfloat16)
            v = torch.randn(1, hkv, t, d, generator=g).to(device, torch.bfloat16)
            f_s, f_peak = timed(lambda: flex(q, k, v, scale=d ** -0.5, return_lse=True))
            emit(dict(section="kernels", kernel="flex_attention (forward only)", heads=h, kv_heads=hkv, head_dim=d,
                      R=r, T=t, forward_s=f_s, forward_tflops=round(4 * h * r * t * d / f_s / 1e12, 1),
                      forward_peak_mib=f_peak))


SECTIONS = {"kernels": kernels_section, "lm_head": lm_head_section, "sampler": sampler_section,
            "offload": offload_section, "flex": flex_section}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results" / "gpu"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "gpu_kernels.json").write_text(json.dumps(rows, indent=1))

    for name in args.sections:
        t0 = time.perf_counter()
        try:
            SECTIONS[name](args.smoke, device, emit)
        except Exception as e:
            emit(dict(section=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
