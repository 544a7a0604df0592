"""Context parallelism: capture and step time on 1 rank vs N ranks (gloo, processes of one torch thread each).

The dense benchmark model (`longstraw.tools.compare.bench_model("dense")`: qwen3, hidden 128, 4 layers), a prompt of P
tokens, G responses of R tokens. 1 rank: `longstraw.capture(model, prompt)` in one process, then a step = G serial
replays with backward. N ranks: `capture(..., group=WORLD)` in N processes, a step = G/N replays per rank (each a
collective) with backward. Each configuration runs in fresh processes in the same invocation, one after the other;
times are the slowest rank's, the median of `--repeat` steps after a warm-up.

    python bench/context_parallel.py --P 65536 --G 8 --R 64 --ranks 2   # → bench/results/context_parallel.{json,md}

Step memory per rank against G (`--memory-G`): N ranks only, one fresh set of processes per G; each rank's step
memory is its peak RSS during the steps minus its RSS before them (the captured state and the weights are already
there), beside the durable state per rank.

    python bench/context_parallel.py --P 16384 --R 64 --ranks 2 --memory-G 2 4 8 16   # → ..._memory.{json,md}

The step's replays one at a time against k at a time per rank (`--replay-batch k`: one collective per batch,
`longstraw.replay.batched.replay_batch`), alternating in fresh processes:

    python bench/context_parallel.py --P 16384 --G 16 --R 32 --ranks 2 --replay-batch 8   # → ..._batched.{json,md}

Capture memory per rank against the planner, for other models and lengths (`--model`, `--P-list`):

    python bench/context_parallel.py --model hybrid --P-list 16384 32768 --R 64 --ranks 2 --memory-G 2 \
        --out bench/results/cp_capture_hybrid

The ranks run with glibc's mmap threshold fixed at 128 KiB (`--malloc-default` to keep glibc's adaptive one, under
which freed temporaries can stay in RSS).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _rank(rank: int, n: int, init: str, out: str, P: int, G: int, R: int, chunk: int, repeat: int,
          model_name: str = "dense", batch: int = 1):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import longstraw
    from longstraw.tools.compare import bench_model
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb, trim_heap

    group = None
    if n > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=1800))
        group = dist.group.WORLD
    model = bench_model(model_name)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (P,), generator=g)
    responses = [torch.randint(0, vocab, (R,), generator=g) for _ in range(G)]
    mine = responses[rank::n]

    def barrier():
        if n > 1:
            dist.barrier()

    # warm-up (first-call allocations, communication buffers): a short capture and one replay with backward
    warm = longstraw.capture(model, prompt[:256], chunk_size=chunk, group=group)
    (-warm.replay(mine[0][:8]).logprobs.sum()).backward()
    warm.release()
    model.zero_grad(set_to_none=True)
    barrier()
    trim_heap()
    rss0 = rss_mb()
    reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    state = longstraw.capture(model, prompt, chunk_size=chunk, group=group)
    t_capture, c_capture = time.perf_counter() - t0, time.process_time() - c0
    capture_mem = peak_rss_mb() - rss0
    steps, cpu = [], []
    trim_heap()
    before = rss_mb()
    reset_peak()
    for i in range(repeat + 1):
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if batch == 1:
            for resp in mine:
                replay = state.replay(resp)
                (-replay.logprobs.sum()).backward()
        else:  # `batch` of this rank's responses in one collective replay (`longstraw.replay.batched`)
            from longstraw.replay.batched import replay_batch
            from longstraw.replay.order import spans

            for a, b in spans(len(mine), batch):
                outs = replay_batch(state, mine[a:b])
                torch.stack([-out.logprobs.sum() for out in outs]).sum().backward()
        steps.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    row = dict(rank=rank, capture_s=t_capture, capture_cpu_s=c_capture, step_s=statistics.median(steps[1:]),
               step_cpu_s=statistics.median(cpu[1:]), nbytes=state.nbytes, step_mem_mib=peak_rss_mb() - before,
               capture_mem_mib=capture_mem)
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    if n > 1:
        dist.destroy_process_group()


def run(n: int, P: int, G: int, R: int, chunk: int, repeat: int, model_name: str = "dense", batch: int = 1) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(n, os.path.join(d, "init"), d, P, G, R, chunk, repeat, model_name, batch),
                           nprocs=n, join=True, start_method="spawn")
        rows = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(n)]
    return dict(model=model_name, ranks=n, P=P, G=G, R=R, chunk=chunk, threads_per_rank=1, replay_batch=batch,
                capture_s=max(r["capture_s"] for r in rows), step_s=max(r["step_s"] for r in rows),
                capture_cpu_s=[round(r["capture_cpu_s"], 3) for r in rows],
                step_cpu_s=[round(r["step_cpu_s"], 3) for r in rows],
                state_bytes_per_rank=[r["nbytes"] for r in rows],
                step_mem_mib_per_rank=[round(r["step_mem_mib"], 1) for r in rows],
                capture_mem_mib_per_rank=[round(r["capture_mem_mib"], 1) for r in rows])


def memory_grid(a) -> None:
    rows = []
    for P in a.P_list or [a.P]:
        for G in a.memory_G:
            rows.append(run(a.ranks, P, G, a.R, a.chunk, 1, a.model))
            print(json.dumps(rows[-1]), flush=True)
    write_memory(rows, Path(a.out + "_memory"))


def write_memory(rows: list[dict], out: Path) -> None:
    """The memory grid's JSON and markdown table, with the planner's capture figure for each row."""
    from longstraw.tools.compare import bench_model
    from longstraw.tools.planner import PlanConfig, plan

    lines = ["| model | ranks | P | G | R | replays per rank | step memory per rank (MiB) | state per rank (MiB) "
             "| capture memory per rank (MiB) | planner: capture transient + state per rank (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        config = bench_model(r.get("model", "dense")).config
        pl = plan(PlanConfig(config, r["P"], num_generations=r["G"], completion_length=r["R"], dtype="fp32",
                             chunk_size=r["chunk"], context_parallel=r["ranks"], lora_rank=0))
        r["planned_capture_mib"] = round((pl.capture_transient + pl.durable_state) / 2**20, 1)
        lines.append(f"| {r.get('model', 'dense')} | {r['ranks']} | {r['P']} | {r['G']} | {r['R']} | {r['G'] / r['ranks']:g} | "
                     f"{', '.join(f'{m:.1f}' for m in r['step_mem_mib_per_rank'])} | "
                     f"{', '.join(f'{b / 2**20:.1f}' for b in r['state_bytes_per_rank'])} | "
                     f"{', '.join(f'{m:.1f}' for m in r['capture_mem_mib_per_rank'])} | {r['planned_capture_mib']} |")
    out.with_suffix(".json").write_text(json.dumps(dict(rows=rows, load_average=os.getloadavg()), indent=1))
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--P", type=int, default=65536)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "context_parallel"))
    ap.add_argument("--memory-G", type=int, nargs="*", default=None, help="step memory per rank for these G")
    ap.add_argument("--P-list", type=int, nargs="*", default=None, help="--memory-G: these prompt lengths (else --P)")
    ap.add_argument("--model", default="dense", help="longstraw.tools.compare.bench_model's name (dense, hybrid, mla, ...)")
    ap.add_argument("--replay-batch", type=int, default=1,
                    help="k > 1: the N-rank step with replays one at a time against k at a time (→ OUT_batched)")
    ap.add_argument("--rounds", type=int, default=2, help="--replay-batch: alternating runs of each configuration")
    ap.add_argument("--malloc-default", action="store_true",
                    help="keep glibc's adaptive mmap threshold (by default the ranks run with it fixed at 128 KiB, so "
                         "that freed temporaries leave RSS, as in bench/stress.py and bench/plan_accuracy.py)")
    a = ap.parse_args()
    if not a.malloc_default:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by each spawned rank's allocator at its start
    if a.memory_G:
        return memory_grid(a)
    if a.replay_batch > 1:
        return batched(a)
    rows = []
    for n in (1, a.ranks):
        rows.append(run(n, a.P, a.G, a.R, a.chunk, a.repeat, a.model))
        print(json.dumps(rows[-1]), flush=True)
    one, many = rows
    summary = dict(capture_speedup=one["capture_s"] / many["capture_s"], step_speedup=one["step_s"] / many["step_s"],
                   load_average=os.getloadavg())
    print(json.dumps(summary))
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(dict(rows=rows, summary=summary), indent=1))
    text = table(rows, summary)
    out.with_suffix(".md").write_text(text)
    print(text)


def batched(a) -> None:
    """N ranks, the step's replays one at a time and `--replay-batch` at a time (one collective per batch), the two
    configurations alternating in fresh processes (`--rounds` each), then the step memory of each."""
    rows = []
    for i in range(a.rounds):
        for k in (1, a.replay_batch):
            rows.append(dict(run(a.ranks, a.P, a.G, a.R, a.chunk, a.repeat, a.model, k), round=i))
            print(json.dumps(rows[-1]), flush=True)
    best = {k: min(r["step_s"] for r in rows if r["replay_batch"] == k) for k in (1, a.replay_batch)}
    out = Path(a.out + "_batched")
    summary = dict(step_speedup=best[1] / best[a.replay_batch], load_average=os.getloadavg())
    out.with_suffix(".json").write_text(json.dumps(dict(rows=rows, summary=summary), indent=1))
    lines = [f"`python bench/context_parallel.py --model {a.model} --P {a.P} --G {a.G} --R {a.R} --ranks {a.ranks} "
             f"--replay-batch {a.replay_batch} --rounds {a.rounds}`", "",
             "| round | replay batch | ranks | P | G | R | replays per rank | step, wall (s) | step, CPU per rank (s) "
             "| step memory per rank (MiB) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['replay_batch']} | {r['ranks']} | {r['P']} | {r['G']} | {r['R']} | "
                     f"{-(-r['G'] // r['ranks'])} | {r['step_s']:.3f} | {', '.join(f'{c:.2f}' for c in r['step_cpu_s'])} "
                     f"| {', '.join(f'{m:.1f}' for m in r['step_mem_mib_per_rank'])} |")
    lines.append(f"\nbest step: one at a time {best[1]:.3f} s, {a.replay_batch} at a time {best[a.replay_batch]:.3f} s: "
                 f"{summary['step_speedup']:.2f}× (1 torch thread per rank; load average "
                 f"{summary['load_average'][0]:.1f} at the end)")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def table(rows, summary) -> str:
    lines = ["| ranks | P | G | R | capture, wall (s) | capture, CPU per rank (s) | step, wall (s) "
             "| step, CPU per rank (s) | state bytes per rank |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('model', 'dense')} | {r['ranks']} | {r['P']} | {r['G']} | {r['R']} | {r['capture_s']:.2f} | "
                     f"{', '.join(f'{c:.1f}' for c in r['capture_cpu_s'])} | {r['step_s']:.2f} | "
                     f"{', '.join(f'{c:.2f}' for c in r['step_cpu_s'])} | "
                     f"{', '.join(str(b) for b in r['state_bytes_per_rank'])} |")
    one, many = rows
    cpu = (sum(one["capture_cpu_s"]) / max(many["capture_cpu_s"]), sum(one["step_cpu_s"]) / max(many["step_cpu_s"]))
    lines.append(f"\nwall-clock speed-up: capture {summary['capture_speedup']:.2f}×, "
                 f"step {summary['step_speedup']:.2f}×; CPU time, 1 rank / busiest rank: capture {cpu[0]:.2f}×, "
                 f"step {cpu[1]:.2f}× (1 torch thread per rank; load average {summary['load_average'][0]:.1f} at "
                 "the end, the 2 cores shared with other work)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
