"""Backward memory and time of one agent trajectory against its number of turns: turn by turn vs whole vs naive.

A trajectory after a P-token prompt: `turns` policy turns of `--turn-tokens` tokens, each followed by a tool reply of
`--tool-tokens` tokens (the last turn is the answer). Three ways to get the gradient of its masked log-prob sum
(LoRA on the dense benchmark model, `longstraw.tools.compare.bench_model("dense")`), each in a fresh process:

- `segments`: `longstraw.replay.segments.replay_segments` against the captured prompt: one segment's graph at a time, the
  whole trajectory's gradient (its own K/V as leaf buffers, then a reverse pass over the segments), the prompt a
  constant;
- `exact`: the same with `prompt_grad="exact"` (the gradient also through the prompt: its reverse pass too);
- `whole`: `PromptState.replay` of the whole trajectory as one branch (tool tokens masked out of the loss);
- `whole_exact`: the same with `prompt_grad="exact"` (what `exact` is timed against: both pay the prompt's share);
- `naive`: one forward + backward of [prompt + trajectory] on the unmodified model (what TRL does per sequence);
- `layer_major`: `replay_segments(..., layer_major=LayerMajor.parse(store, chunk=layer_chunk))`
  (`longstraw.replay.layer_major`: one decoder layer at a time over the whole trajectory, `--layer-chunk` positions per
  layer call, the hidden states entering `--store` k of every n layers kept, one layer's own K/V at a time), the
  prompt a constant; `layer_major_exact`: the same with `prompt_grad="exact"` (timed against `whole_exact`).

Memory: peak RSS during the replay and backward − RSS before it (`longstraw.train.memory.MemoryMeter`; the prompt
state is captured before, so it is not counted for the longstraw methods, and the naive way has none). G does not
enter: trajectories are replayed one at a time, so a step's memory is one trajectory's. The workers fix glibc's mmap
threshold at 64 KiB so that RSS follows the live tensors; that costs the methods with many allocations (segmented
replay's per-segment tensors) fresh pages each time, so their time is taken under glibc's own threshold, as a
training run has it, with `--malloc-default` (its memory column then lags the tensors).

    python bench/agent_turns.py                   # → bench/results/agent_turns.{json,md,png}
    python bench/agent_turns.py --turns 2 4 --out /tmp/quick
    python bench/agent_turns.py --model smollm2 --turns 2 4 8   # SmolLM2-135M-Instruct (8,192 positions)
    python bench/agent_turns.py --model smollm2 --turns 16 32 --tool-tokens 96 --methods segments whole --malloc-default
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("segments", "exact", "whole", "whole_exact", "naive", "layer_major", "layer_major_exact")
#: the methods that take `--store` and `--layer-chunk`
LAYER_MAJOR = ("layer_major", "layer_major_exact")


def _model(name: str):
    """The dense benchmark model (`bench_model("dense")`; `deep`: with 16 layers), or SmolLM2-135M-Instruct
    (`longstraw real smollm2`) with LoRA r 16 on the attention projections, float32."""
    import torch

    if name in ("dense", "deep"):
        from longstraw.testing.models import BENCH_DENSE
        from longstraw.tools.compare import bench_model

        # deep: 16 of the dense model's layers (hidden size = one layer's K/V, 128 floats a position each)
        return bench_model("dense", fields=None if name == "dense" else {**BENCH_DENSE, "num_hidden_layers": 16})
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from longstraw.tools.real_models import model_path

    model = AutoModelForCausalLM.from_pretrained(model_path(name), dtype=torch.float32)
    return get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )


def worker(
    method: str,
    turns: int,
    P: int,
    turn_tokens: int,
    tool_tokens: int,
    threads: int,
    model_name: str = "dense",
    store: str = "1/2",
    layer_chunk: int = 128,
) -> dict:
    import time

    import torch

    import longstraw
    from longstraw.train.memory import MemoryMeter
    from longstraw.replay.segments import replay_segments

    torch.set_num_threads(threads)
    model = _model(model_name)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    pieces, mask = [], []
    for t in range(turns):
        pieces.append(torch.randint(0, vocab, (turn_tokens,), generator=g))
        mask += [1.0] * turn_tokens
        if t < turns - 1:
            pieces.append(torch.randint(0, vocab, (tool_tokens,), generator=g))
            mask += [0.0] * tool_tokens
    tokens, mask = torch.cat(pieces), torch.tensor(mask)
    meter = MemoryMeter("cpu")
    state = None
    if method != "naive":
        state = longstraw.capture(
            model, prompt, chunk_size=1024, prompt_grad="exact" if method.endswith("exact") else "detached"
        )
    meter.start_step()
    t0 = time.perf_counter()
    with meter.stage("backward"):
        if method in ("segments", "exact"):
            replay_segments(state, tokens, mask, lambda sl, out: out.logprobs.sum())
            state.backward()  # exact: the prompt's share (nothing to do when detached)
        elif method in ("whole", "whole_exact"):
            (state.replay(tokens).logprobs * mask).sum().backward()
            state.backward()  # whole_exact: the prompt's share (nothing to do when detached)
        elif method in LAYER_MAJOR:
            from longstraw.replay.layer_major import LayerMajor

            replay_segments(
                state,
                tokens,
                mask,
                lambda sl, out: out.logprobs.sum(),
                layer_major=LayerMajor.parse(store, chunk=layer_chunk),
            )
            state.backward()  # layer_major_exact: the prompt's share (nothing to do when detached)
        else:
            logits = model(input_ids=torch.cat([prompt, tokens])[None]).logits[0, P - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
            (lp * mask).sum().backward()
    seconds = time.perf_counter() - t0
    res = meter.results()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # the trajectory's own K/V (float32 keys and values of every layer): the floor a replay of it holds once
    own_kv = tokens.numel() * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    return dict(
        method=method,
        model=model_name,
        turns=turns,
        P=P,
        trajectory_tokens=tokens.numel(),
        policy_tokens=int(mask.sum()),
        backward_mem_mb=res["step_mem_mb"],
        own_kv_mb=round(own_kv / 2**20, 2),
        seconds=round(seconds, 3),
        prompt_state_mb=None if state is None else round(state.nbytes / 2**20, 2),
        threads=threads,
        **({"store": store, "layer_chunk": layer_chunk} if method in LAYER_MAJOR else {}),
    )


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = list(dict.fromkeys(_label(r) for r in rows if "backward_mem_mb" in r))
    for label, style in zip(labels, ("o-", "d-.", "s--", "v-.", "^:", "P-", "x--", "*-", "h:") * 2):
        got = sorted((r["turns"], r) for r in rows if _label(r) == label and "backward_mem_mb" in r)
        x = [t for t, _ in got]
        axes[0].plot(x, [r["backward_mem_mb"] for _, r in got], style, label=label)
        axes[1].plot(x, [r["seconds"] for _, r in got], style, label=label)
    for ax, label in zip(axes, ("backward memory (MiB)", "backward time (s)")):
        ax.set_xlabel("policy turns (a tool reply after each but the last)")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("One agent trajectory's gradient: turn by turn vs whole vs naive full sequence")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _label(row: dict) -> str:
    """A row's method, with `layer_major`'s store."""
    return row["method"] + (f" {row['store']}" if row.get("store") else "")


def _table(rows) -> str:
    lines = [
        "| turns | trajectory tokens | method | backward memory (MiB) | backward time (s) |",
        "|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "backward_mem_mb" in r:
            lines.append(
                f"| {r['turns']} | {r['trajectory_tokens']:,} | {_label(r)} | {r['backward_mem_mb']:,.1f} | "
                f"{r['seconds']:.1f} |"
            )
        else:
            lines.append(f"| {r['turns']} | – | {_label(r)} | error: {r.get('error', '')[:60]} | – |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "TURNS"), help=argparse.SUPPRESS)
    ap.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--P", type=int, default=2048)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--tool-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--store", nargs="+", default=["1/2"], help="layer_major: keep the hidden states entering k/n of the layers"
    )
    ap.add_argument(
        "--layer-chunk", type=int, default=128, help="layer_major: positions per layer call (its graph's length)"
    )
    ap.add_argument("--model", default="dense", choices=["dense", "deep", "smollm2"])
    ap.add_argument(
        "--malloc-default",
        action="store_true",
        help="leave glibc's mmap threshold as it is, as a training run does: for time (memory then lags the tensors)",
    )
    ap.add_argument("--out", default=None, help="default: bench/results/agent_turns (-smollm2)")
    args = ap.parse_args()
    if args.worker:
        row = worker(
            args.worker[0],
            int(args.worker[1]),
            args.P,
            args.turn_tokens,
            args.tool_tokens,
            args.threads,
            args.model,
            args.store[0],
            args.layer_chunk,
        )
        print(json.dumps(row))
        return
    rows: list[dict] = []
    out = Path(args.out or RESULTS / ("agent_turns" if args.model == "dense" else f"agent_turns-{args.model}"))
    for turns in args.turns:
        for method, store in [(m, s) for m in args.methods for s in (args.store if m in LAYER_MAJOR else [""])]:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                method,
                str(turns),
                "--P",
                str(args.P),
                "--turn-tokens",
                str(args.turn_tokens),
                "--tool-tokens",
                str(args.tool_tokens),
                "--threads",
                str(args.threads),
                "--model",
                args.model,
                "--store",
                store or "1/2",
                "--layer-chunk",
                str(args.layer_chunk),
            ]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # RSS follows the live tensors (see compare.py)
            if args.malloc_default:  # time as a training run has it (glibc's own threshold; RSS then lags)
                env.pop("MALLOC_MMAP_THRESHOLD_")
            done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env)
            if done.returncode != 0:
                record(rows, dict(method=method, store=store, turns=turns, error=done.stderr.strip()[-300:]), out)
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["malloc"] = "glibc default" if args.malloc_default else "mmap threshold 64 KiB"
                record(rows, row, out)
    finish(rows, out, _plot, _table)


if __name__ == "__main__":
    main()
