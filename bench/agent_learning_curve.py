"""Does the real model learn to use tools on a long document? Held-out greedy success before and after GRPO.

    python bench/agent_learning_curve.py                  # → bench/results/agent_learning_curve.{json,md,png}
    python bench/agent_learning_curve.py --steps 2 --eval-rows 4 --out /tmp/quick

SmolLM2-135M-Instruct (`longstraw real smollm2`) with a LoRA adapter (r 16) on `longstraw.tasks.archive_tools`: a
document of 8 sections (~400 tokens each, the standard library's docstrings) behind the tools `search <word>`,
`open <n>` and `answer <code>`; the code is in one section. Each trajectory is several turns whose tool replies
grow its own branch of the prompt state, replayed turn by turn (`segment_replay`). Held-out rows (another seed) are
played greedily (temperature 0) before the first step and after the last; success = the environment's reward (the
right code). Intervals: Wilson 95 %; the gain's is a paired bootstrap over the rows. Rows are written as measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402
from real_learning_curve import paired_bootstrap, wilson  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-rows", type=int, default=64)
    ap.add_argument("--train-rows", type=int, default=128)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "agent_learning_curve"))
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    import longstraw
    from longstraw.train.config import TrainConfig
    from longstraw.tools.real_models import model_path
    from longstraw.train.rollout import SamplingSettings, TurnSampler
    from longstraw.tasks.archive_tools import write_archive_task
    from longstraw.tasks.jsonl import load_jsonl
    from longstraw.train.trainer import Trainer

    path = model_path("smollm2")
    out = Path(args.out)
    work = Path("bench/out") / out.name
    tok = AutoTokenizer.from_pretrained(path)
    files = write_archive_task(tok, work / "data", args.train_rows, args.eval_rows)
    cfg = TrainConfig(model=str(path), dataset=str(files["train"]), eval_fraction=0.0,
                      environment="longstraw.tasks.archive_tools:ArchiveTools",
                      tool_parser="longstraw.tasks.archive_tools:parse_commands", reward_funcs=["environment_reward"],
                      lora=True, lora_r=16, lora_alpha=32, num_generations=args.G,
                      prompts_per_step=args.prompts_per_step, num_steps=args.steps, max_completion_length=3072,
                      max_turns=args.max_turns, max_turn_tokens=24, max_tool_tokens=1024, threads=args.threads,
                      output_dir=str(work / "run"), learning_rate=1e-4, eval_at_start=False,
                      num_completions_to_print=1)
    trainer = Trainer(cfg)
    held = load_jsonl(files["eval"], tok)
    agent = trainer.rollout_stage.rollout_func
    greedy = SamplingSettings(1, cfg.max_completion_length, temperature=0.0)
    rows: list[dict] = []

    def score(when: str) -> list[float]:
        trainer.model.eval()
        t0 = time.perf_counter()
        got, turns = [], []
        with torch.no_grad():
            for ex in held:
                with longstraw.capture(trainer.model, trainer.encode(ex.prompt)) as state:
                    r = agent.trajectory(TurnSampler(state, trainer.policy, greedy, torch.Generator()), ex)
                got.append(float(r.extra["environment_reward"] == 1.0))  # the right code (not the 0.25 for reading it)
                turns.append(r.extra["turns"])
        trainer.model.train()
        record(rows, dict(when=when, rows=len(got), success=sum(got) / len(got), ci95=wilson(sum(got), len(got)),
                          mean_turns=sum(turns) / len(turns), seconds=time.perf_counter() - t0, per_row=got), out)
        return got

    before = score("before")
    t0 = time.perf_counter()
    metrics = trainer.train()
    record(rows, dict(when="training", steps=len(metrics), seconds=time.perf_counter() - t0,
                      reward=[m["reward"] for m in metrics], turns=[m.get("agent/turns") for m in metrics],
                      tool_calls=[m.get("agent/tool_calls") for m in metrics]), out)
    after = score("after")
    lo, hi = paired_bootstrap(before, after)
    record(rows, dict(when="gain", gain=sum(after) / len(after) - sum(before) / len(before), ci95=(lo, hi)), out)
    finish(rows, out, _plot, _table)
    (work / "done.json").write_text(json.dumps(rows))


def _table(rows: list[dict]) -> str:
    by = {r["when"]: r for r in rows}
    lines = ["| held-out rows | before | after | gain (95 % CI) | mean turns before → after |",
             "|---:|---:|---:|---:|---:|"]
    if "gain" in by:
        b, a, g = by["before"], by["after"], by["gain"]
        lines.append(f"| {b['rows']} | {b['success']:.3f} | {a['success']:.3f} | {g['gain']:+.3f} "
                     f"({g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}) | {b['mean_turns']:.2f} → {a['mean_turns']:.2f} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = next((r for r in rows if r["when"] == "training"), None)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if train:
        ax.plot(range(1, len(train["reward"]) + 1), train["reward"], "o-", label="sampled reward (G trajectories)")
    for r, style in ((next((r for r in rows if r["when"] == "before"), None), "--"),
                     (next((r for r in rows if r["when"] == "after"), None), "-")):
        if r:
            ax.axhline(r["success"], linestyle=style, color="k", alpha=0.6, label=f"held-out greedy, {r['when']}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("success (right code)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("SmolLM2-135M-Instruct, a document behind tools")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
