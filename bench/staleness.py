"""What a kept prompt state costs (`recapture_every: k`): log-prob drift and gradient direction against a fresh capture.

    python bench/staleness.py                                  # SmolLM2 at 6K, ages 0, 1, 2, 4, 8
    python bench/staleness.py --model gemma3 --length 32000    # Gemma 3 270M at 32K
    → bench/results/staleness-MODEL-LENGTH.{json,md,png}

The many-questions documents task (`longstraw.tasks.documents.make_document_rows`: Q access-code questions about one
document of about LENGTH tokens, in the chat template, the question last) trains as a `recapture_every: 8` run does:
GRPO steps with LoRA (r 16, learning rate 1e-4, the real learning curve's settings; rewards `contains_answer` and
`code_digits`, the fraction of the code's digits written in order, so that the policy moves from the first step), all
Q rows of the document in each step, the document captured once at step 0 and read by every later step. Step 0's
rollout is the probe: its rows' questions and sampled responses, with their GRPO advantages (if a group's rewards are
all equal, its responses' weights are fixed draws of N(0, 1), as the table's `weights` column says).

After A optimizer updates (A = the state's age: 0, 1, 2, 4, 8) the probe is replayed by the current weights twice:
after the state captured at step 0 (what a run with `recapture_every > A` reads) and after a fresh capture of the
document by the current weights (`recapture_every: 1`). Per age:

- `|Δ log p|`: mean and max over the probe's tokens of the two replays' log-prob difference;
- NLL drift: |NLL(stale) − NLL(fresh)| / NLL(fresh), NLL the probe's mean token negative log-likelihood (LongStraw's
  "loss drift");
- ratio moved: mean |exp(Δ log p) − 1| — the importance ratio a kept state adds before any policy change, against
  PPO's clip range ε = 0.2 — and the fraction of tokens past it;
- gradient cosine: cosine between the two GRPO policy gradients (ratio 1, token mean over each response, advantages
  as above) over the LoRA parameters, and the norm ratio.

- K/V drift, probe: the drift probe a run could afford — the document's first 512 tokens captured again by the
  current weights (causal: they read nothing else; a 512-token capture), ‖K/V_kept − K/V_now‖ / ‖K/V_now‖ over the
  full-attention layers at those positions; K/V drift, whole: the same over every position (the fresh capture's),
  what the probe stands in for.

Age 0 is the control: the same weights capture twice, so every figure there is this machine's noise floor.
Every figure is a difference of two replays in one process: no timing is compared, the cores need not be quiet.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import document_rows, finish, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: tokens of the drift probe: the document's start, captured again by the current weights
FIRST = 512


def code_digits(prompts, completions, answer, **kwargs) -> list[float]:
    """A dense reward beside `contains_answer`: the fraction of the code's digits the completion writes, in their
    order (so that the run moves from its first step: Adam's step is about the learning rate whatever the gradient's
    size, once the advantages are not all zero)."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]
        digits = [ch for ch in text if ch.isdigit()]
        hit = sum(x == y for x, y in zip(digits, a))
        out.append(hit / len(a))
    return out


def _probe_gradient(state, probe, params, temperature: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The probe's GRPO policy gradient `[n params]` after `state` (flattened) and each response's log-probs."""
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    logprobs = []
    n = sum(len(resps) for _, resps in probe)
    for suffix, resps in probe:
        for tokens, adv in resps:
            out = state.replay(tokens, temperature=temperature, prefix_ids=suffix)
            loss = -adv * out.logprobs.mean() / n
            for t, g in zip(total, torch.autograd.grad(loss, params, allow_unused=True)):
                if g is not None:
                    t += g.float()
            logprobs.append(out.logprobs.detach().float())
    return torch.cat([t.reshape(-1) for t in total]), logprobs


def _full_kv(state, n: int) -> list[torch.Tensor]:
    """Keys and values of the state's full-attention layers at positions [0, n) (float32): the layers that keep every
    position (sliding-window layers keep only the prompt's last window)."""
    from longstraw.kinds import KVState

    out = []
    for layer in state.layers:
        if type(layer) is KVState and layer.keys is not None:
            k, v = layer.stored()
            out += [k[:, :, :n].float(), v[:, :, :n].float()]
    return out


def kv_drift(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all the tensors."""
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b))
    return math.sqrt(num / max(sum(float(y.pow(2).sum()) for y in b), 1e-30))


def compare(stale, fresh, probe, params, temperature: float) -> dict:
    """The figures of one age: `stale` and `fresh` states of the same document, the same probe and weights."""
    g_stale, lp_stale = _probe_gradient(stale, probe, params, temperature)
    g_fresh, lp_fresh = _probe_gradient(fresh, probe, params, temperature)
    s, f = torch.cat(lp_stale), torch.cat(lp_fresh)
    d = s - f
    ratio = d.exp() - 1
    nll_s, nll_f = -s.mean().item(), -f.mean().item()
    cos = torch.nn.functional.cosine_similarity(g_stale.double(), g_fresh.double(), dim=0).item()
    return dict(
        mean_abs_dlogp=d.abs().mean().item(),
        max_abs_dlogp=d.abs().max().item(),
        nll_stale=nll_s,
        nll_fresh=nll_f,
        nll_drift=abs(nll_s - nll_f) / nll_f,
        ratio_moved=ratio.abs().mean().item(),
        past_clip=(ratio.abs() > 0.2).float().mean().item(),
        grad_cosine=cos,
        grad_norm_ratio=(g_stale.norm() / g_fresh.norm()).item(),
        per_response_mean_abs_dlogp=[(a - b).abs().mean().item() for a, b in zip(lp_stale, lp_fresh)],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("--length", type=int, default=6144)
    ap.add_argument("--Q", type=int, default=2, help="questions of the document per step")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--R", type=int, default=16)
    ap.add_argument("--ages", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--redraw", action="store_true", help="rewrite the table and figure from the JSON")
    args = ap.parse_args()
    if args.redraw:
        out = RESULTS / f"staleness-{args.model}-{args.length}"
        finish(json.loads(out.with_suffix(".json").read_text()), out, _plot, _table)
        return

    from transformers import AutoTokenizer

    from longstraw import capture
    from longstraw.tools.real_models import model_path
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    path = model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    rows_in = document_rows(tok, args.length, args.Q, 0, "document 0")
    out = RESULTS / f"staleness-{args.model}-{args.length}"
    steps = max(args.ages)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "rows.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows_in))
        cfg = TrainConfig(
            model=str(path),
            dataset=str(data),
            eval_fraction=0.0,
            reward_funcs=["contains_answer"],
            lora=True,
            lora_r=16,
            lora_alpha=32,
            num_generations=args.G,
            prompts_per_step=args.Q,
            rows_per_context=args.Q,
            num_steps=steps,
            max_completion_length=args.R,
            learning_rate=args.learning_rate,
            recapture_every=steps + 1,
            threads=args.threads,
            output_dir=str(Path(d) / "run"),
            progress=False,
            eval_at_start=False,
            save_every=10**6,
            seed=0,
        )
        from longstraw.tasks.base import contains_answer

        trainer = Trainer(cfg, reward_funcs=[contains_answer, code_digits])
        stage = trainer.rollout_stage
        seen = {}
        collect = stage.collect

        def spy(examples, step, meter):
            r = collect(examples, step, meter)
            seen.setdefault(step, r)
            return r

        stage.collect = spy
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        m = trainer.train_step(0)  # step 0: the document captured (kept by the run's store) and the probe sampled
        updates = 1
        r = seen[0]
        (ctx,) = r.contexts
        gen = torch.Generator().manual_seed(0)
        probe, weights, i = [], [], 0
        adv = r.advantages.tolist()
        for b in ctx.rows:
            g = r.groups[b]
            a = adv[i : i + len(g.responses)]
            i += len(g.responses)
            weights.append("grpo" if max(a) > min(a) else "random")
            if max(a) == min(a):
                a = torch.randn(len(a), generator=gen).tolist()
            probe.append((g.suffix, [(resp.tokens, w) for resp, w in zip(g.responses, a)]))
        prefix = r.groups[ctx.rows[0]].prompt_ids[: ctx.length]

        def gone():
            raise RuntimeError("the run's store no longer holds the document's state")

        stale = trainer.store.get(prefix, gone)  # the state step 0 captured, which every later step reads
        for age in sorted(args.ages):
            while updates < age:
                m = trainer.train_step(updates)
                updates += 1
            print(
                f"age {age}: last step loss {m['loss']:.4f} reward {m['reward']:.3f}, "
                f"captures {m.get('state_captures')} reuses {m.get('state_reuses')}",
                flush=True,
            )
            now = [p.detach().clone() for p in params]
            if age == 0:  # the control: the capturing weights themselves, put back for the comparison
                with torch.no_grad():
                    for p, s in zip(params, start):
                        p.copy_(s)
            # the drift probe: the document's first FIRST tokens captured again by today's weights (causal: they read
            # nothing else), their full-attention K/V against the kept state's at the same positions
            t0 = time.perf_counter()
            first = min(FIRST, prefix.numel())
            with capture(trainer.model, prefix[:first], prompt_grad="detached") as head:
                probe_s = time.perf_counter() - t0
                kv_first = kv_drift(_full_kv(stale, first - 1), _full_kv(head, first - 1))
            t0 = time.perf_counter()
            with capture(
                trainer.model,
                prefix,
                chunk_size=stage.chunk_size,
                prompt_grad="detached",
                state_dtype=stage.state_dtype,
            ) as fresh:
                capture_s = time.perf_counter() - t0
                row = compare(stale, fresh, probe, params, cfg.temperature)
                n = prefix.numel() - 1
                row.update(kv_drift_first=kv_first, kv_drift_all=kv_drift(_full_kv(stale, n), _full_kv(fresh, n)),
                           probe_s=probe_s, probe_tokens=first)
            moved = math.sqrt(sum((p.detach() - s).float().pow(2).sum().item() for p, s in zip(params, start)))
            with torch.no_grad():
                for p, n in zip(params, now):
                    p.copy_(n)
            record(
                rows,
                dict(
                    model=args.model,
                    length=args.length,
                    prompt_tokens=prefix.numel(),
                    Q=args.Q,
                    G=args.G,
                    R=args.R,
                    learning_rate=args.learning_rate,
                    age=age,
                    weights=weights,
                    lora_moved=moved,
                    capture_s=capture_s,
                    **row,
                ),
                out,
            )
    finish(rows, out, _plot, _table)


def _table(rows: list[dict]) -> str:
    lines = [
        "| age (updates) | mean abs Δ log p | max abs Δ log p | NLL drift | ratio moved | past clip 0.2 | "
        "gradient cosine | gradient norm ratio | LoRA moved (L2) | K/V drift, probe | K/V drift, whole |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        probe = "—" if "kv_drift_first" not in r else f"{r['kv_drift_first']:.2e}"
        whole = "—" if "kv_drift_all" not in r else f"{r['kv_drift_all']:.2e}"
        lines.append(
            f"| {r['age']} | {r['mean_abs_dlogp']:.2e} | {r['max_abs_dlogp']:.2e} | {100 * r['nll_drift']:.3f} % | "
            f"{r['ratio_moved']:.2e} | {100 * r['past_clip']:.1f} % | {r['grad_cosine']:.5f} | "
            f"{r['grad_norm_ratio']:.4f} | {r['lora_moved']:.3f} | {probe} | {whole} |"
        )
    if rows:
        r = rows[0]
        lines.append(
            f"\n{r['model']}, document of {r['prompt_tokens']:,} tokens, Q = {r['Q']} questions, G = {r['G']}, "
            f"R = {r['R']}, LoRA r 16, learning rate {r['learning_rate']:g}; weights: {r['weights']}"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["age"] > 0]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ages = [r["age"] for r in rows]
    axes[0].plot(ages, [100 * r["nll_drift"] for r in rows], "o-", label="NLL drift %")
    axes[0].plot(ages, [r["mean_abs_dlogp"] for r in rows], "s-", label="mean |Δ log p|")
    axes[0].set_yscale("log")
    axes[1].plot(ages, [1 - r["grad_cosine"] for r in rows], "o-", label="1 − gradient cosine")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("state age (optimizer updates since its capture)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"kept prompt state vs fresh capture: {rows[0]['model']} at {rows[0]['prompt_tokens']:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
