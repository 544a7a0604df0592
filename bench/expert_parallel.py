"""Expert parallelism: per-rank memory and step time with the experts spread over 1, 2 and 4 ranks, beside FSDP2 alone.

A tiny Mixtral with many experts (`--experts` 64, top-`--top-k` 4, hidden 256, expert width 256, `--layers` 4: 50 M
expert parameters, 0.9 M others), fully fine-tuned in float32 (so the experts' weights, gradients and AdamW moments
are 16 bytes per parameter), a prompt of P tokens captured over the ranks (context parallel, `chunk_size` 2048), G
responses of R tokens replayed with backward (G / N per rank), the gradients of what every rank holds whole summed
over the ranks, one AdamW step. Each configuration runs in a fresh process group (gloo, one torch thread per rank;
`--backend nccl` on GPUs, one per rank), one after the other:

    python bench/expert_parallel.py                # → bench/results/expert_parallel.{json,md,png}
    python bench/expert_parallel.py --P 2048 --configs 1:1 2:2 --out /tmp/ep_quick    # a minute

Per rank: the peak RSS over the step (CUDA: peak allocated), weights and optimizer state included, and the bytes of
the experts' weights it holds; times are the slowest rank's (capture, the replays with backward, the all-reduce and
the optimizer step). Configurations `RANKS:EP[:fsdp]`: 1:1 (one process), 2:1:fsdp and 4:1:fsdp (FSDP2 alone: every
decoder layer's weights sharded, the experts' included, gathered layer by layer), 2:2 and 4:4 (the experts spread,
the rest whole on every rank), 2:2:fsdp and 4:4:fsdp (the experts spread, the rest sharded).

The ranks run with glibc's mmap threshold fixed at 128 KiB, as bench/context_parallel.py's, so that freed temporaries
leave RSS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "expert_parallel"


def _model(args):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=args.layers,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=args.experts,
                        num_experts_per_tok=args.top_k, max_position_embeddings=max(4096, 2 * args.P),
                        router_aux_loss_coef=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    model.set_experts_implementation("eager")
    return model


def _rank(rank: int, n: int, ep: int, fsdp: bool, init: str, out: str, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import longstraw
    from longstraw.distributed.expert_parallel import shard_experts
    from longstraw.distributed.fsdp import is_sharded, shard
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb, trim_heap

    cuda = args.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = None
    if n > 1:
        dist.init_process_group(args.backend, init_method=f"file://{init}", rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=3600))
        group = dist.group.WORLD
    trim_heap()
    base = rss_mb()
    model = _model(args).to(device)
    shards = shard_experts(model, group) if ep > 1 else None
    spread = {p for p in model.parameters() if shards is not None and shards.is_spread(p)}
    if fsdp:
        shard(model, ignored=spread or None)
    from longstraw.distributed.expert_parallel import experts_modules

    expert_bytes = sum(
        (p.to_local() if is_sharded(p) else p).numel() * 4 for m in experts_modules(model) for p in m.parameters(recurse=False)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 512, (args.P,), generator=g).to(device)
    responses = [torch.randint(0, 512, (args.R,), generator=g).to(device) for _ in range(args.G)]
    mine = responses[rank::n]

    def sync():
        if cuda:
            torch.cuda.synchronize()
        if n > 1:
            dist.barrier()

    def step():
        times = {}
        sync()
        t0 = time.perf_counter()
        state = longstraw.capture(model, prompt, chunk_size=args.chunk, group=group)
        sync()
        times["capture_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for resp in mine:
            (-state.replay(resp).logprobs.sum()).backward()
        sync()
        times["replay_s"] = time.perf_counter() - t0
        state.release()
        t0 = time.perf_counter()
        if n > 1:  # what every rank holds whole: summed over the ranks (shards are reduced by FSDP, experts stay)
            for p in model.parameters():
                if p.grad is not None and p not in spread and not is_sharded(p):
                    dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times["optimizer_s"] = time.perf_counter() - t0
        return times

    # warm-up on a short prompt (first-call allocations, communication buffers, AdamW's moments)
    keep = prompt
    prompt = prompt[:256]
    step()
    prompt = keep
    trim_heap()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak()
    before = rss_mb()
    times = step()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else peak_rss_mb() - base
    loads = shards.take_load() if shards is not None else []
    row = dict(rank=rank, peak_mib=peak, held_before_step_mib=(before - base) if not cuda else None,
               expert_weights_mib=expert_bytes / 2**20, expert_rows=sum(loads), **times)
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    if n > 1:
        dist.destroy_process_group()


def run(n: int, ep: int, fsdp: bool, args) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(n, ep, fsdp, os.path.join(d, "init"), d, args), nprocs=n, join=True,
                           start_method="spawn")
        rows = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(n)]
    return dict(ranks=n, expert_parallel=ep, fsdp=fsdp, P=args.P, G=args.G, R=args.R, experts=args.experts,
                top_k=args.top_k, layers=args.layers, backend=args.backend,
                peak_mib_per_rank=[round(r["peak_mib"], 1) for r in rows],
                expert_weights_mib_per_rank=[round(r["expert_weights_mib"], 1) for r in rows],
                expert_rows_per_rank=[r["expert_rows"] for r in rows],
                capture_s=round(max(r["capture_s"] for r in rows), 2), replay_s=round(max(r["replay_s"] for r in rows), 2),
                optimizer_s=round(max(r["optimizer_s"] for r in rows), 2), load_average=os.getloadavg()[0])


def _name(r: dict) -> str:
    parts = [f"{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}"]
    if r["expert_parallel"] > 1:
        parts.append(f"EP {r['expert_parallel']}")
    if r["fsdp"]:
        parts.append("FSDP2")
    return ", ".join(parts)


def table(rows: list[dict]) -> str:
    lines = ["| configuration | peak memory per rank (MiB) | experts' weights per rank (MiB) | capture (s) | replays (s) "
             "| all-reduce + AdamW (s) | expert rows per rank |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {_name(r)} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {_name(r)} | {max(r['peak_mib_per_rank']):,.0f} | {max(r['expert_weights_mib_per_rank']):,.1f} "
                     f"| {r['capture_s']:.1f} | {r['replay_s']:.1f} | {r['optimizer_s']:.2f} "
                     f"| {', '.join(str(x) for x in r['expert_rows_per_rank'])} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    names = [_name(r) for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(names, [max(r["peak_mib_per_rank"]) for r in ok], color="tab:blue", label="peak per rank")
    axes[0].bar(names, [max(r["expert_weights_mib_per_rank"]) for r in ok], color="tab:orange",
                label="experts' weights per rank")
    axes[0].set_ylabel("MiB")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [r["capture_s"] + r["replay_s"] + r["optimizer_s"] for r in ok], color="tab:green")
    axes[1].set_ylabel("step time (s, slowest rank)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    p = ok[0] if ok else {}
    fig.suptitle(f"Expert parallelism: Mixtral, {p.get('experts')} experts top-{p.get('top_k')}, P = {p.get('P')}, "
                 "full fine-tuning fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--P", type=int, default=16384)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--configs", nargs="+", default=["1:1", "2:1:fsdp", "2:2", "2:2:fsdp", "4:1:fsdp", "4:4",
                                                      "4:4:fsdp"], help="RANKS:EP[:fsdp]")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # read by each spawned rank's allocator at its start
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for spec in args.configs:
        parts = spec.split(":")
        n, ep, fsdp = int(parts[0]), int(parts[1]), len(parts) > 2 and parts[2] == "fsdp"
        try:
            row = run(n, ep, fsdp, args)
        except Exception as err:  # a configuration that fails is a row saying so
            row = dict(ranks=n, expert_parallel=ep, fsdp=fsdp, P=args.P, error=f"{type(err).__name__}: {err}"[:300])
        record(rows, row, out)
    finish(rows, out, plot, table)


if __name__ == "__main__":
    main()
