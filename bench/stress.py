"""The published 2.1M positions on this machine: one full GRPO step of the tiny hybrid at millions of tokens.

The model: the benchmarks' tiny hybrid (`longstraw.tools.compare`'s "hybrid": 3 gated-DeltaNet layers per
full-attention layer, hidden 128, LoRA r = 8 on the attention projections), with its full-attention layer
narrowed so that the state of a few million tokens stays small: 2 query heads / 1 KV head of 16, at
P = 2,097,152 (the fp8 run) and at P = 1,048,576 (the exact run).

One step = capture (chunks of 2,048 for the fp8 run, 65,536 for the exact run), G = 8 responses of 128 tokens sampled from the state (temperature
1, seeded), G replays with backward (random advantages), one AdamW step. Each run in its own fresh process
(`--child NAME`, glibc's default allocator settings unless --mmap-threshold; see main), 2 torch
threads unless --threads; time per stage (and the process's CPU time and the
machine's load average, since wall time on a shared machine includes what others ran), the durable state,
and step memory = peak RSS during the step − RSS before it, against the planner's figures
(`longstraw.tools.planner`) for the same configuration.

    python bench/stress.py                       # both runs, one after the other (tens of minutes each)
    python bench/stress.py --runs fp8_2m         # one of them
    python bench/stress.py --runs fp8_2m --P 65536   # a short rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

RUNS = {
    # chunk: capture's chunk size; its transient (the chunk's activations, ~28 KB per token for this model)
    # sits on top of the state, so the fp8 run keeps it near its 64 MB allowance.
    "fp8_2m": dict(P=2_097_152, prompt_grad="detached", state_dtype="fp8", heads=2, kv_heads=1, head_dim=16,
                   chunk=2048),
    # exact mode: the same narrow full-attention layer as the fp8 run (its reverse pass recomputes every chunk's
    # attention over the prefix with autograd: 4 query heads of 32 would take 4x the time of these 2 of 16)
    "exact_1m": dict(P=1_048_576, prompt_grad="exact", state_dtype=None, heads=2, kv_heads=1, head_dim=16,
                     chunk=65536),
}
G, R = 8, 128


def model_for(run: dict):
    from longstraw.tools.compare import bench_model
    from longstraw.testing.models import BENCH_HYBRID

    fields = dict(BENCH_HYBRID, num_attention_heads=run["heads"], num_key_value_heads=run["kv_heads"],
                  head_dim=run["head_dim"], max_position_embeddings=run["P"] + R + 16)
    return bench_model("hybrid", fields=fields)


def bound(run: dict, pl) -> float:
    """The issue's step-memory bound (bytes): 2 × the durable state + 64 MB (fp8 run); 2 × (state + its gradient) +
    one chunk's graph (exact run; the chunk's graph = the planner's largest transient, its reverse-pass graph)."""
    if run["prompt_grad"] == "exact":
        return 2 * (pl.durable_state + pl.state_grad) + (pl.step - pl.durable_state - pl.state_grad)
    return 2 * pl.durable_state + 64e6


def child(name: str, run: dict, threads: int, out: Path) -> None:
    import torch

    import longstraw
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb
    from longstraw.tools.planner import PlanConfig, plan

    torch.set_num_threads(threads)
    model = model_for(run)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (run["P"],), generator=g)
    with longstraw.capture(model, prompt[:256], chunk_size=64, prompt_grad=run["prompt_grad"],
                           state_dtype=run["state_dtype"]) as st:  # warm-up
        st.replay(st.sample(1, 4, generator=g).tokens[0]).logprobs.sum().backward()
        if run["prompt_grad"] == "exact":
            st.backward()
    opt.zero_grad(set_to_none=True)
    pl = plan(PlanConfig(model.config, run["P"], num_generations=G, completion_length=R, prompt_grad=run["prompt_grad"],
                         dtype="fp32", state_dtype=run["state_dtype"], lora_rank=8, chunk_size=run["chunk"]))
    row = dict(run=name, P=run["P"], G=G, R=R, threads=threads, prompt_grad=run["prompt_grad"],
               state_dtype=run["state_dtype"], chunk=run["chunk"], attention=f"{run['heads']}q/{run['kv_heads']}kv x {run['head_dim']}",
               planned_state_mib=round(pl.durable_state / 2**20, 2), planned_step_mib=round(pl.step / 2**20, 1),
               planned_state_grad_mib=round(pl.state_grad / 2**20, 2), bound_mib=round(bound(run, pl) / 2**20, 1))
    stages = {}
    before = rss_mb()
    reset_peak()
    t0 = time.perf_counter()

    def progress(stage):
        stages[stage] = round(time.perf_counter() - t_stage, 1)
        print(json.dumps(dict(run=name, stage=stage, seconds=stages[stage], rss_mb=round(rss_mb(), 1))), flush=True)

    t_stage = time.perf_counter()
    marks = iter(range(5, 101, 5))
    mark = [next(marks)]

    def captured(done, total):
        if done * 100 >= mark[0] * total:
            print(json.dumps(dict(run=name, captured=done, of=total, seconds=round(time.perf_counter() - t_stage, 1),
                                  rss_mb=round(rss_mb(), 1))), flush=True)
            mark[0] = next(marks, 101)

    state = longstraw.capture(model, prompt, chunk_size=run["chunk"], prompt_grad=run["prompt_grad"],
                              state_dtype=run["state_dtype"], progress=captured)
    progress("capture_s")
    capture_peak = peak_rss_mb() - before
    t_stage = time.perf_counter()
    with torch.no_grad():
        samples = state.sample(G, R, generator=g)
    progress("sample_s")
    t_stage = time.perf_counter()
    adv = torch.randn(G, generator=g)
    for a, resp in zip(adv, samples.tokens):
        (-(a * state.replay(resp).logprobs).sum()).backward()
    progress("replay_s")
    if run["prompt_grad"] == "exact":
        t_stage = time.perf_counter()
        state.backward()
        progress("reverse_s")
    t_stage = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    progress("optimizer_s")
    step_s = time.perf_counter() - t0
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    peak = peak_rss_mb() - before
    row.update(stages, step_s=round(step_s, 1), state_mib=round(state.nbytes / 2**20, 2),
               capture_mem_mib=round(capture_peak, 1), step_mem_mib=round(peak, 1),
               state_vs_plan=round(state.nbytes / pl.durable_state, 4), process_cpu_s=round(cpu.ru_utime + cpu.ru_stime, 1),
               load_avg_1m=round(os.getloadavg()[0], 2), torch=torch.__version__,
               mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default"))
    state.release()
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--P", type=int, default=None, help="override the prompt length (rehearsal)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=None, help="override the capture chunk size")
    ap.add_argument("--mmap-threshold", type=int, default=None,
                    help="fix glibc's mmap threshold (bytes) in the run's process, so RSS follows live tensors (see main)")
    ap.add_argument("--out", default=str(HERE / "results" / "stress.jsonl"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.child:
        run = dict(RUNS[args.child], **({"P": args.P} if args.P else {}), **({"chunk": args.chunk} if args.chunk else {}))
        child(args.child, run, args.threads, out)
        return
    for name in args.runs:
        cmd = [sys.executable, __file__, "--child", name, "--threads", str(args.threads), "--out", str(out)]
        if args.P:
            cmd += ["--P", str(args.P)]
        if args.chunk:
            cmd += ["--chunk", str(args.chunk)]
        # glibc's defaults, as a user's process has them: the mmap threshold rises to the largest block freed so far,
        # so freed chunk-sized temporaries stay in the heap and count in RSS (step memory measured at P = 262,144:
        # 73.1 MiB with the defaults, 59.1 MiB with a fixed threshold of 128 KiB); a fixed threshold returns them at
        # the price of page faults on every large temporary (capture 54.1 s there vs 45.8 s with the defaults)
        env = dict(os.environ)
        if args.mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        subprocess.run(cmd, check=False, env=env)


if __name__ == "__main__":
    main()
