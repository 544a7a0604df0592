"""The anatomy of a GRPO step once the capture is shared: capture, sample, replay, optimizer step, each beside its floor.

    python bench/step_anatomy.py --model smollm2 --length 6144 --Q 1 8 --R 16 256
    python bench/step_anatomy.py --model gemma3 --length 16384 32768 --Q 1 8 --R 16 256
    → bench/results/step_anatomy-<model>.{json,md,png}
    python bench/step_anatomy.py ... --library /path/to/an/older/checkout --replay serial --tag before
    (the same rows and seeds through another checkout of longstraw: how the step looked before)

One document of about LENGTH tokens (`longstraw.tasks.documents`, Q questions about it, each about another passage;
in SmolLM2's chat template, or as text for Gemma 3's base model), LoRA r 16 on every linear layer, float32, 2 torch
threads, one process. The stages, as `longstraw train` runs them with `rows_per_context: Q`:

- `capture`: the document's common prefix captured once (`longstraw.capture`), then each row's own question read into
  a branch of its own (`Branch.extend`);
- `sample`: G responses of exactly R tokens per row (no stop token), all Q · G in one ragged batch
  (`longstraw.ragged.sample_branches`), each row's G from a generator of its own seed;
- `replay`: every response's GRPO-shaped loss (Σ advantage · log-probs / tokens, advantages fixed per response)
  back-propagated into the LoRA weights: `serial` one response at a time (`Branch.replay`), `batched` as `longstraw
  train` replays with `replay_batch: auto` (`longstraw.replay.order`: k responses at a time, the rows of the document
  sharing the batches, `replay_rows_backward`; k in the results);
- `optimizer`: one AdamW step over the LoRA weights.

`replay peak / planned`: the replay stage's peak resident memory above what the process held before it (its graphs and
the adapters' gradients; the prompt state was there already), beside what the planner prices the largest batch's
graphs at (`replay_graph_bytes` × its responses, what `replay_batch: auto` fits within `replay_memory_mb`).

`step, capture every 4` = capture / 4 + sample + replay + optimizer: the cost of a step when a state is kept over 4
steps (`recapture_every: 4`). Each configuration runs 2 steps (the same seeds); the second is reported.

Beside each stage its floor, computed here and printed: the stage's matrix-product FLOPs (the decoder's linear layers
and LM head, 2 per weight and token; attention 4 × query width × the keys each query sees, the windows of Gemma 3's
sliding layers counted; a replay's backward with frozen base weights and a detached prompt: the linear layers' and
the head's input gradients, 2 per weight and token, and the attention's three products, 6 × query width × keys —
the scores recomputed, dP and dQ, as every kernel here computes them, keeping no R × T tensor) at the rate `torch.mm`
reaches in this process on the stage's largest product shape, plus one read of the prompt state and the weights at
the rate this machine copies memory (`Tensor.copy_` of 256 MiB). Reported as each stage's time / its floor.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("--length", type=int, nargs="+", default=[6144], help="document tokens")
    ap.add_argument("--Q", type=int, nargs="+", default=[8], help="questions (rows) per document")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--R", type=int, nargs="+", default=[16], help="tokens per response")
    ap.add_argument("--replay", nargs="+", default=["serial", "batched"], choices=["serial", "batched"])
    ap.add_argument("--steps", type=int, default=2, help="steps per configuration; the last is reported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--library", default=None, help="import longstraw from this checkout instead of this one")
    ap.add_argument("--tag", default="", help="added to the results' name and rows (e.g. before)")
    ap.add_argument("--redraw", action="store_true", help="only redraw the table and figure from the JSON")
    return ap.parse_args()


# ----------------------------------------------------------------------------------------------- the floors


def mm_rate(m: int, k: int, n: int) -> float:
    """FLOP/s of `torch.mm` `[m, k] × [k, n]` in float32 here (best of 5 after a warm-up)."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    best = float("inf")
    reps = max(1, int(2e8 // max(2 * m * k * n, 1)))
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * m * k * n / best


def copy_rate() -> float:
    """Bytes per second `Tensor.copy_` moves (256 MiB, best of 5)."""
    import torch

    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best


class Arithmetic:
    """The model's matrix-product FLOPs per token, from its modules and config."""

    def __init__(self, model):
        import torch

        cfg = model.config
        self.h = cfg.hidden_size
        self.vocab = cfg.vocab_size
        self.inter = getattr(cfg, "intermediate_size", 4 * self.h)
        heads = cfg.num_attention_heads
        self.q_width = heads * (getattr(cfg, "head_dim", None) or self.h // heads)
        decoder = model.get_decoder()
        base = [
            m.base_layer if hasattr(m, "base_layer") else m
            for name, m in decoder.layers.named_modules()
            if isinstance(m, torch.nn.Linear) and "lora_" not in name
        ]
        self.linear = sum(m.weight.numel() for m in base)  # each base weight once
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        window = getattr(cfg, "sliding_window", None)
        self.windows = [window if t == "sliding_attention" else None for t in types]
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.lora = [p for p in model.parameters() if p.requires_grad]

    def keys(self, first: int, last: int) -> int:
        """Σ over layers and queries at positions first..last − 1 of the keys each sees."""
        total = 0
        for w in self.windows:
            for_full = (last * (last + 1) - first * (first + 1)) // 2
            if w is None:
                total += for_full
            else:
                total += (
                    sum(min(p + 1, w) for p in range(first, last))
                    if last - first < 4096
                    else min(for_full, (last - first) * w)
                )
        return total

    def backward(self, first: int, last: int, head_tokens: int) -> float:
        """FLOPs of the backward of `forward(first, last, head_tokens)` with frozen weights and a detached prompt:
        the input gradients of the linear layers and the head, and the attention's scores recomputed, dP and dQ."""
        return (
            2 * self.linear * (last - first)
            + 6 * self.q_width * self.keys(first, last)
            + 2 * self.h * self.vocab * head_tokens
        )

    def forward(self, first: int, last: int, head_tokens: int) -> float:
        """FLOPs of a forward of positions first..last − 1 (per sequence), `head_tokens` of them through the LM head."""
        return (
            2 * self.linear * (last - first)
            + 4 * self.q_width * self.keys(first, last)
            + 2 * self.h * self.vocab * (head_tokens)
        )


# ----------------------------------------------------------------------------------------------- one configuration


def run(args, model, tok, length: int, q: int, r: int, mode: str, rates: dict, rows: list, out: Path) -> None:
    import torch

    import longstraw
    from longstraw.ragged import sample_branches
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb, trim_heap

    sys.path.insert(0, str(HERE))
    from _bench import document_rows, record

    data = document_rows(tok, length, q, seed=0, name="doc")
    ids = [
        tok.apply_chat_template(d["messages"], add_generation_prompt=True, return_dict=False)
        if "messages" in d
        else tok(d["prompt"])["input_ids"]
        for d in data
    ]
    ids = [torch.tensor(i["input_ids"] if isinstance(i, dict) else i) for i in ids]
    common = min(i.numel() for i in ids)
    for i in ids[1:]:
        diff = (i[:common] != ids[0][:common]).nonzero()
        if diff.numel():
            common = int(diff[0])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    ar = Arithmetic(model)
    g = args.G
    for step in range(args.steps):
        times = {}
        t0 = time.perf_counter()
        state = longstraw.capture(model, ids[0][:common])
        times["capture_prefix"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        branches = []
        for i in ids:
            b = state.fork()
            with torch.no_grad():
                b.extend(i[common:])
            branches.append(b)
        times["capture_suffixes"] = time.perf_counter() - t0
        gens = [torch.Generator().manual_seed(100 + k) for k in range(q)]
        t0 = time.perf_counter()
        with torch.no_grad():
            samples = sample_branches(branches, g, r, generator=gens)
        times["sample"] = time.perf_counter() - t0
        adv = torch.linspace(-1, 1, q * g)
        opt.zero_grad(set_to_none=True)
        trim_heap()
        rss0 = rss_mb()
        reset_peak()
        t0 = time.perf_counter()
        n = 0
        for b, s in zip(branches, samples) if mode == "serial" else ():
            for t in s.tokens:
                one = b.replay(t)
                (adv[n] * one.logprobs.sum() / (q * g * r)).backward()
                n += 1
        if mode != "serial":
            from longstraw.model.chunking import AUTO_REPLAY_BUDGET
            from longstraw.replay.order import choose_order, replay_backward, replay_rows_backward, rows_together

            order = choose_order(model, q * g, "auto", AUTO_REPLAY_BUDGET, completion_length=r)
            listed = [[(t, None) for t in s.tokens] for s in samples]

            def loss_of(k, j, sl, out, adv=adv):
                return adv[k * g + j] * out.logprobs.sum() / (q * g * r)

            losses = [functools.partial(loss_of, k) for k in range(q)]
            if rows_together(order, branches, listed):
                replay_rows_backward(branches, listed, losses, order)
            else:
                for b, rows_k, lo in zip(branches, listed, losses):
                    replay_backward(b, rows_k, lo, order)
        times["replay"] = time.perf_counter() - t0
        replay_peak_mib = peak_rss_mb() - rss0  # the replay's graphs and the adapters' gradients, above the state
        t0 = time.perf_counter()
        opt.step()
        times["optimizer"] = time.perf_counter() - t0
        state_bytes = state.nbytes
        for b in branches:
            b.release()
        state.release()
        if step < args.steps - 1:
            continue
        # the floors (see the module doc): the replay's products as tall as its batches (serial: a row's G, as before)
        batch = g if mode == "serial" else min(order.batch, q * g)
        # what the planner prices the largest batch's graphs at (`replay_graph_bytes` × the largest span)
        planned_mib = None
        if mode != "serial":
            from longstraw.model.capability import layer_plan
            from longstraw.model.chunking import replay_graph_bytes
            from longstraw.replay.order import spans

            widest = max(b - a for a, b in spans(q * g, batch))
            graph = replay_graph_bytes(model.config, layer_plan(model.config), 4, r, r, False)
            planned_mib = widest * graph / 2**20
        if batch * r not in rates["mm_replay"]:
            rates["mm_replay"][batch * r] = mm_rate(batch * r, rates["hidden"], rates["inter"])
        suffix = sum(int(i.numel()) - common for i in ids)
        p = common
        cap_flops = ar.forward(0, p - 1, 0) + sum(ar.forward(p - 1, int(i.numel()) - 1, 0) for i in ids)
        own = q * g * r  # the decode's own K/V read, small beside the state
        dec_flops = q * g * sum(ar.forward(p + 40 + t, p + 41 + t, 1) for t in range(r))
        rep_flops = q * g * (ar.forward(p + 40, p + 40 + r, r) + ar.backward(p + 40, p + 40 + r, r))
        read = state_bytes + ar.weight_bytes
        lora_bytes = sum(x.numel() * x.element_size() for x in ar.lora)
        floors = dict(
            capture=cap_flops / rates["mm_capture"] + read / rates["copy"],
            sample=dec_flops / rates["mm_decode"][q * g] + read / rates["copy"],
            replay=rep_flops / rates["mm_replay"][batch * r] + read / rates["copy"],
            optimizer=7 * lora_bytes / rates["copy"],
        )
        capture = times["capture_prefix"] + times["capture_suffixes"]
        shared = times["sample"] + times["replay"] + times["optimizer"]
        record(
            rows,
            dict(
                model=args.model,
                tag=args.tag,
                replay=mode,
                document_tokens=common,
                suffix_tokens=suffix,
                Q=q,
                G=g,
                R=r,
                replay_batch=batch,
                threads=args.threads,
                state_mib=state_bytes / 2**20,
                weight_mib=ar.weight_bytes / 2**20,
                **{f"{k}_s": v for k, v in times.items()},
                capture_s=capture,
                step_capture_every_4_s=capture / 4 + shared,
                step_capture_each_s=capture + shared,
                **{f"floor_{k}_s": v for k, v in floors.items()},
                flops=dict(capture=cap_flops, sample=dec_flops, replay=rep_flops),
                rates=dict(
                    copy_gbs=rates["copy"] / 1e9,
                    mm_capture_gflops=rates["mm_capture"] / 1e9,
                    mm_decode_gflops=rates["mm_decode"][q * g] / 1e9,
                    mm_replay_gflops=rates["mm_replay"][batch * r] / 1e9,
                ),
                own_tokens=own,
                replay_peak_mib=replay_peak_mib,
                replay_planned_mib=planned_mib,
            ),
            out,
        )


# ----------------------------------------------------------------------------------------------- results


def _peak(x: dict) -> str:
    """The replay's measured peak above the state and, with the batched replay, what the planner prices its largest
    batch's graphs at."""
    if x.get("replay_peak_mib") is None:
        return "–"
    planned = x.get("replay_planned_mib")
    return f"{x['replay_peak_mib']:.0f}" + ("" if planned is None else f" / {planned:.0f}")


def table(rows: list[dict]) -> str:
    lines = [
        "| model | P | Q | G | R | replay | capture (s) | sample (s) | replay (s) | optimizer (s) "
        "| step, capture every 4 (s) | sample / floor | replay / floor | state (MiB) | replay peak / planned (MiB) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in rows:
        name = x["replay"] + (f" ({x['tag']})" if x.get("tag") else "")
        lines.append(
            f"| {x['model']} | {x['document_tokens']:,} | {x['Q']} | {x['G']} | {x['R']} | {name} "
            f"| {x['capture_s']:.1f} | {x['sample_s']:.2f} | {x['replay_s']:.2f} | {x['optimizer_s']:.3f} "
            f"| {x['step_capture_every_4_s']:.1f} | {x['sample_s'] / x['floor_sample_s']:.1f}× "
            f"| {x['replay_s'] / x['floor_replay_s']:.1f}× | {x['state_mib']:.0f} | {_peak(x)} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    labels = [
        f"{x['model']} P={x['document_tokens'] // 1024}K\nQ={x['Q']} R={x['R']}\n{x['replay']}"
        + (f" {x['tag']}" if x.get("tag") else "")
        for x in rows
    ]
    bottom = [0.0] * len(rows)
    for stage, color in (("capture", "#999"), ("sample", "#4c72b0"), ("replay", "#dd8452"), ("optimizer", "#55a868")):
        vals = [x[f"{stage}_s"] / (4 if stage == "capture" else 1) for x in rows]
        ax.bar(range(len(rows)), vals, bottom=bottom, color=color, label=stage + (" / 4" if stage == "capture" else ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    floor = [
        x["floor_capture_s"] / 4 + x["floor_sample_s"] + x["floor_replay_s"] + x["floor_optimizer_s"] for x in rows
    ]
    ax.scatter(range(len(rows)), floor, marker="_", s=400, color="k", label="floor", zorder=3)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("seconds per step (capture every 4 steps)")
    ax.set_title("A GRPO step's stages, float32, 2 threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = _args()
    name = f"step_anatomy-{args.model}" + (f"-{args.tag}" if args.tag else "")
    out = RESULTS / name
    sys.path.insert(0, str(HERE))
    from _bench import finish

    if args.redraw:
        finish(json.loads(out.with_suffix(".json").read_text()), out, plot, table)
        return 0
    if args.library:
        sys.path.insert(0, str(Path(args.library).resolve()))
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import longstraw
    from longstraw.tools.real_models import model_path

    print(f"longstraw from {Path(longstraw.__file__).parent}", flush=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = model_path(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    cfg = model.config
    h, inter, vocab = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size), cfg.vocab_size
    rates = dict(
        copy=copy_rate(), mm_capture=mm_rate(2048, h, inter), mm_decode={}, mm_replay={}, hidden=h, inter=inter
    )
    for q in args.Q:
        rates["mm_decode"][q * args.G] = mm_rate(q * args.G, h, vocab)  # the LM head: the decode's largest product
        for r in args.R:
            rates["mm_replay"][args.G * r] = mm_rate(args.G * r, h, inter)
    rows: list[dict] = []
    for length in args.length:
        for q in args.Q:
            for r in args.R:
                for mode in args.replay:
                    run(args, model, tok, length, q, r, mode, rates, rows, out)
    finish(rows, out, plot, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
