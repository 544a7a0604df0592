"""Rollouts side by side: longstraw's own sampler vs a vLLM server, one GRPO group's sampling (G samples of R tokens).

For each prompt length P and response length R (exactly R tokens: no stop token), on one real model:
- own: `longstraw.capture` of the prompt + `state.sample(G, R)`, in a fresh process per configuration (peak RSS of that
  process during the work minus before it);
- vLLM: one request (`n` = G, token ids) to a server started once for the model, for a prompt it has not seen (its
  prefill included) and for the same prompt again (its prefix cache hit), and the seconds of one LoRA adapter sync
  (rank 16, all linear layers); the server's peak memory is its processes' high-water RSS (`VmHWM`) after the run.
Both in float32 on the same cores, one after the other. Writes `bench/results/rollout_backends.{json,md,png}` (per-row
outcomes kept).

    python bench/rollout_backends.py                         # SmolLM2, P 2048 6144, R 32 256, G 8
    python bench/rollout_backends.py --P 2048 --R 32         # one cell
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out += _tree(int(k))
    return out


def prompt_ids(vocab: int, p: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (p,), generator=g)


def own_one(model_name: str, p: int, r: int, g: int, threads: int) -> dict:
    """One configuration of the own sampler, in this (fresh) process."""
    import torch
    from transformers import AutoModelForCausalLM

    import longstraw
    from longstraw.tools.real_models import model_path

    torch.set_num_threads(threads)
    folder = model_path(model_name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt_ids(model.config.vocab_size, p, seed=p + r)
    with torch.no_grad():  # warm-up (first-call costs), not timed
        with longstraw.capture(model, ids[:64], verify=False) as st:
            st.sample(2, 2, generator=torch.Generator().manual_seed(0))
    before = _rss_kib()
    t0 = time.perf_counter()
    with torch.no_grad(), longstraw.capture(model, ids, verify=False) as state:
        t1 = time.perf_counter()
        state.sample(g, r, temperature=1.0, generator=torch.Generator().manual_seed(1))
        t2 = time.perf_counter()
    peak = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0])
    return dict(backend="own", P=p, R=r, G=g, capture_s=t1 - t0, sample_s=t2 - t1, rollout_s=t2 - t0,
                peak_mib=(peak - before) / 1024)


def vllm_rows(model_name: str, ps: list[int], rs: list[int], g: int, out_dir: Path) -> tuple[list[dict], dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from longstraw.tools.real_models import model_path
    from longstraw.train import vllm_server
    from longstraw.train.vllm_client import VLLMClient

    folder = model_path(model_name)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    server = vllm_server.start(folder, dtype="float32", lora_rank=16, max_model_len=max(ps) + max(rs) + 8,
                               log_path=out_dir / f"vllm-{model_name}.log")
    info = dict(started_s=server.started_s)
    rows = []
    try:
        client = VLLMClient(server.url, timeout_s=3600)
        client.generate(prompt_ids(vocab, 64, 0), 2, 2)  # warm-up: the first request compiles
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        torch.manual_seed(0)
        peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        syncs = [client.sync_adapter(peft, out_dir / "adapter", step) for step in range(3)]
        info["sync_s"] = syncs
        client.adapter = None  # the base model, as the own side samples it
        for p in ps:
            for r in rs:
                ids = prompt_ids(vocab, p, seed=p + r)
                t0 = time.perf_counter()
                client.generate(ids, g, r, temperature=1.0, stop_token_ids=[], seed=1)
                t1 = time.perf_counter()
                client.generate(ids, g, r, temperature=1.0, stop_token_ids=[], seed=2)
                t2 = time.perf_counter()
                rows.append(dict(backend="vllm", P=p, R=r, G=g, rollout_s=t1 - t0, cached_s=t2 - t1))
                print(json.dumps(rows[-1]), flush=True)
        info["server_peak_mib"] = sum(_hwm_kib(pid) for pid in _tree(server.process.pid)) / 1024
    finally:
        server.stop()
    return rows, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("--P", type=int, nargs="+", default=[2048, 6144])
    ap.add_argument("--R", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="")
    ap.add_argument("--one", nargs=2, type=int, default=None, help=argparse.SUPPRESS)  # P R: one own-sampler cell
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(own_one(args.model, args.one[0], args.one[1], args.G, args.threads)))
        return 0
    name = f"rollout_backends{'-' + args.tag if args.tag else ''}"
    out_dir = ROOT / "bench" / "out" / name
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for p in args.P:
        for r in args.R:
            cmd = [sys.executable, __file__, "--model", args.model, "--G", str(args.G), "--threads", str(args.threads),
                   "--one", str(p), str(r)]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            line = [x for x in res.stdout.splitlines() if x.startswith("{")]
            rows.append(json.loads(line[-1]) if line else dict(backend="own", P=p, R=r, G=args.G,
                                                             error=res.stderr[-400:]))
            print(json.dumps(rows[-1]), flush=True)
    vrows, info = vllm_rows(args.model, args.P, args.R, args.G, out_dir)
    rows += vrows
    result = dict(model=args.model, G=args.G, threads=args.threads, dtype="float32", vllm=info, rows=rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Rollouts: own sampler vs vLLM ({args.model}, float32, G = {args.G}, {args.threads} threads)", "",
             f"vLLM server start {info['started_s']:.1f} s; peak RSS of its processes {info.get('server_peak_mib', 0):,.0f} MiB; "
             f"LoRA r16 sync {', '.join(f'{s:.2f}' for s in info['sync_s'])} s", "",
             "| P | R | own: capture + sample = rollout | own peak | vLLM, prompt new | vLLM, prompt cached | own / vLLM (new) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in args.P:
        for r in args.R:
            o = next((x for x in rows if x["backend"] == "own" and x["P"] == p and x["R"] == r), {})
            v = next((x for x in rows if x["backend"] == "vllm" and x["P"] == p and x["R"] == r), {})
            if "rollout_s" not in o or "rollout_s" not in v:
                continue
            lines.append(f"| {p:,} | {r} | {o['capture_s']:.2f} + {o['sample_s']:.2f} = {o['rollout_s']:.2f} s | "
                         f"{o['peak_mib']:,.0f} MiB | {v['rollout_s']:.2f} s | {v['cached_s']:.2f} s | "
                         f"{o['rollout_s'] / v['rollout_s']:.2f} |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in args.R:
            for backend, key, style in (("own", "rollout_s", "o-"), ("vllm", "rollout_s", "s--"), ("vllm", "cached_s", "^:")):
                pts = [(x["P"], x[key]) for x in rows if x["backend"] == backend and x["R"] == r and key in x]
                if pts:
                    label = f"{backend}{' cached' if key == 'cached_s' else ''}, R={r}"
                    ax.plot(*zip(*pts), style, label=label)
        ax.set_xlabel("prompt tokens P")
        ax.set_ylabel(f"seconds for G={args.G} samples")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
