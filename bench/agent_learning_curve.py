"""Does the real model learn to use tools on a long document? Held-out greedy success before and after GRPO.

    python bench/agent_learning_curve.py                  # → bench/results/agent_learning_curve.{json,md,png}
    python bench/agent_learning_curve.py --steps 2 --eval-rows 4 --out /tmp/quick
    python bench/agent_learning_curve.py --in-prompt --sections 11 --section-tokens 500 --distractors 3 \
        --tag in-prompt-8k        # the 11-section document (~6.7K tokens) in the prompt too: ~8K of context
    python bench/agent_learning_curve.py --in-prompt --sections 11 --section-tokens 500 --distractors 3 \
        --max-completion 1400 --max-tool-tokens 768 --warmup-steps 30 --steps 8 --threads 2 \
        --environment GuidedArchiveTools --learning-rate 2e-4 --score-short 32 --tag in-prompt-8k-guided \
        --before-from bench/results/agent_learning_curve-in-prompt-8k.json    # a curriculum: 2K first, then 8K
    python bench/agent_learning_curve.py --model gemma3 --in-prompt --sections 48 --section-tokens 500 \
        --distractors 3 --max-completion 1400 --max-tool-tokens 768 --warmup-steps 30 --steps 8 --threads 2 \
        --environment GuidedArchiveTools --learning-rate 2e-4 --score-short 32 --tag gemma3-32k-guided
        # Gemma 3 270M at its native context: prompts of ~29.4K tokens (30.7K at most), trajectories to 32K

SmolLM2-135M-Instruct (`longstraw real smollm2`) with a LoRA adapter (r 16) on `longstraw.tasks.archive_tools`: a
document of 8 sections (~400 tokens each, the standard library's docstrings) behind the tools `search <word>`,
`open <n>` and `answer <code>`; the code is in one section. Each trajectory is several turns whose tool replies
grow its own branch of the prompt state, replayed turn by turn (`segment_replay`). Held-out rows (another seed) are
played greedily (temperature 0) before the first step and after the last; success = the environment's reward (the
right code). Intervals: Wilson 95 %; the gain's is a paired bootstrap over the rows. Rows are written as measured,
and a rerun of the same command goes on where an interrupted one stopped (held-out rows and GRPO steps kept in
bench/out/NAME).
With `--in-prompt` the whole document is in the prompt as well (captured once per row, read by all G trajectories,
each grown by its own tool replies): the long-context agent; `--distractors k` plants k other archives' codes.

A curriculum (`--warmup-steps K`): K GRPO steps on the short task first (the default run's settings: 8 sections of
~400 tokens behind tools, nothing in the prompt, no distractors, its own training rows), the adapter merged into the
model (`merge_adapter`), then `--steps` on this task with a fresh adapter over the merged model. On the long task a
model that has never used the tools is rarely rewarded (every reward of a group 0: no advantage, no gradient); the
short task's rewards are denser. "before" is the base model either way, "after" the model after both stages;
`--score-warm` also plays the held-out rows after the short stage alone, to tell the stages apart, and
`--score-short N` plays N held-out rows of the short task (its own settings) after it: did the warm-up learn that?
The warm-up and `--score-short` run first, ahead of the base model's held-out pass (minutes against hours at 32K).
`--before-from FILE` takes the base model's held-out pass from an earlier results file of the same held-out rows
(checked: the same task settings and the same prompt lengths) instead of playing it again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402
from real_learning_curve import paired_bootstrap, wilson  # noqa: E402

if TYPE_CHECKING:
    from longstraw.train.trainer import Trainer

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
    ap.add_argument("--sections", type=int, default=8)
    ap.add_argument("--section-tokens", type=int, default=400)
    ap.add_argument("--in-prompt", action="store_true", help="the whole document in the prompt as well")
    ap.add_argument("--distractors", type=int, default=0, help="other archives' codes planted in the document")
    ap.add_argument("--max-tool-tokens", type=int, default=1024)
    ap.add_argument("--max-completion", type=int, default=3072, help="a trajectory's tokens after the prompt")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    ap.add_argument("--tag", default="", help="results go to bench/results/agent_learning_curve-<tag>.*")
    ap.add_argument("--environment", default="ArchiveTools", choices=("ArchiveTools", "GuidedArchiveTools"),
                    help="the task's environment (GuidedArchiveTools: 0.05 for a tool used to some effect)")
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0,
                    help="the training's seed (row order, sampling, the adapter's initialisation); held-out rows stay")
    ap.add_argument("--warmup-steps", type=int, default=0, help="GRPO steps on the short task first (a curriculum)")
    ap.add_argument("--score-warm", action="store_true", help="play the held-out rows after the warm-up as well")
    ap.add_argument("--score-short", type=int, default=0,
                    help="play this many held-out rows of the short task after the warm-up (did it learn that?)")
    ap.add_argument("--before-from", default=None, help="an earlier results JSON whose 'before' pass to reuse")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not args.warmup_steps and (args.score_warm or args.score_short):
        ap.error("--score-warm and --score-short score a curriculum's warm-up: give --warmup-steps as well")
    if args.out is None:
        args.out = str(RESULTS / ("agent_learning_curve" + (f"-{args.tag}" if args.tag else "")))

    from transformers import AutoTokenizer

    from longstraw.tasks.archive_tools import write_archive_task
    from longstraw.tasks.jsonl import load_jsonl
    from longstraw.tools.real_models import chat_format, model_path
    from longstraw.train.build import apply_chat_format
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    path = model_path(args.model)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path("bench/out") / out.name
    tok = AutoTokenizer.from_pretrained(path)
    fmt = chat_format(args.model)  # Gemma 3 270M is a base model: longstraw's Gemma turn template, as the trainer's
    apply_chat_format(tok, **fmt)
    files = write_archive_task(tok, work / "data", args.train_rows, args.eval_rows, num_sections=args.sections,
                               section_tokens=args.section_tokens, document_in_prompt=args.in_prompt,
                               distractors=args.distractors)
    def config(model: Path, data: Path, steps: int, run: Path, **task) -> TrainConfig:
        return TrainConfig(model=str(model), dataset=str(data), eval_fraction=0.0, **fmt,
                           environment=f"longstraw.tasks.archive_tools:{args.environment}",
                           tool_parser="longstraw.tasks.archive_tools:parse_commands",
                           reward_funcs=["environment_reward"], lora=True, lora_r=16, lora_alpha=32,
                           num_generations=args.G, prompts_per_step=args.prompts_per_step, num_steps=steps,
                           max_turns=args.max_turns, max_turn_tokens=24, threads=args.threads, output_dir=str(run),
                           learning_rate=args.learning_rate, seed=args.seed, eval_at_start=False,
                           num_completions_to_print=1, **task)

    cfg = config(path, files["train"], args.steps, work / "run", max_completion_length=args.max_completion,
                 max_tool_tokens=args.max_tool_tokens)
    trainer = None if args.warmup_steps else Trainer(cfg)  # the base model's, trained on when there is no warm-up
    held = load_jsonl(files["eval"], tok)
    rows: list[dict] = []

    def score(when: str, make: Callable[[], Trainer] | None = None, examples: list | None = None) -> list[float]:
        """Play the held-out rows (`examples`, by default this task's) greedily with the model and settings of the
        trainer `make` builds (by default the current trainer); each row's outcome is appended to WORK/score-WHEN.jsonl
        as it is measured, and a rerun goes on from the first row not there (a run of hours survives an
        interruption); with every row there, no trainer is built."""
        examples = held if examples is None else examples
        done_file = work / f"score-{when}.jsonl"
        done = [json.loads(line) for line in done_file.read_text().splitlines()] if done_file.exists() else []
        if len(done) < len(examples):
            stage = make() if make is not None else trainer
            assert stage is not None
            _play(stage, examples[len(done):], done, done_file, when, len(examples))
        got = [d["success"] for d in done]
        turns, calls = [d["turns"] for d in done], [d["tool_calls"] for d in done]
        record(rows, dict(when=when, rows=len(got), success=sum(got) / len(got), ci95=wilson(sum(got), len(got)),
                          mean_turns=sum(turns) / len(turns), mean_tool_calls=sum(calls) / len(calls),
                          max_context=max(d["length"] for d in done), seconds=sum(d["seconds"] for d in done),
                          per_row=got, turns=turns, tool_calls=calls), out)
        return got

    def train(stage: Trainer | None, when: str, run: Path) -> None:
        """Train `stage` (None: its run is finished) and record its steps from RUN/metrics.jsonl; `seconds` is the sum
        of the steps' own times, so a run resumed across processes counts every step once."""
        if stage is not None:
            stage.train()  # resumes from its run folder's last checkpoint (one per step) when there is one
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        metrics = [m for m in metrics if m.get("phase") == "grpo"]
        record(rows, dict(when=when, steps=len(metrics), seconds=sum(m["time_step"] for m in metrics),
                          reward=[m["reward"] for m in metrics], turns=[m.get("agent/turns") for m in metrics],
                          tool_calls=[m.get("agent/tool_calls") for m in metrics]), out)

    prompts = [len(tok(ex.prompt, add_special_tokens=False)["input_ids"]) for ex in held]  # as `Policy.encode`
    where = "in the prompt and behind tools" if args.in_prompt else "behind tools"
    setup = dict(when="setup", title=f"{args.model}, {args.sections} sections {where}"
                 + (f", after {args.warmup_steps} steps on 8 sections behind tools" if args.warmup_steps else ""),
                 args=vars(args), mean_prompt_tokens=sum(prompts) / len(prompts), max_prompt_tokens=max(prompts))
    record(rows, setup, out)
    if args.warmup_steps:  # first: its steps and --score-short take minutes, the long task's passes hours
        warm = work / "warmup"
        short = write_archive_task(tok, warm / "data", args.train_rows, args.score_short)
        final = warm / "run" / "model"
        short_task = dict(max_completion_length=3072, max_tool_tokens=1024)  # the default run's
        done = (final / "config.json").exists()
        first = None if done else Trainer(config(path, short["train"], args.warmup_steps, warm / "run",
                                                 merge_adapter=True, **short_task))
        train(first, "warm-up", warm / "run")
        del first
        if args.score_short:
            score("warm-short", lambda: Trainer(config(final, short["train"], 1, warm / "check", **short_task)),
                  load_jsonl(short["eval"], tok))
        trainer = Trainer(config(final, files["train"], args.steps, work / "run",
                                 max_completion_length=args.max_completion, max_tool_tokens=args.max_tool_tokens))
    if args.before_from:
        before = reuse_before(Path(args.before_from), setup)
        record(rows, before, out)
        before = before["per_row"]
    else:
        before = score("before", (lambda: Trainer(cfg)) if args.warmup_steps else None)  # the base model's
    if args.warmup_steps and args.score_warm:
        score("warm")
    train(trainer, "training", work / "run")
    after = score("after")
    lo, hi = paired_bootstrap(before, after)
    record(rows, dict(when="gain", gain=sum(after) / len(after) - sum(before) / len(before), ci95=(lo, hi)), out)
    finish(rows, out, _plot, _table)
    (work / "done.json").write_text(json.dumps(rows))


def _play(stage: Trainer, examples: list, done: list[dict], done_file: Path, when: str, total: int) -> None:
    """Play `examples` greedily with `stage`'s model and settings, appending each row's outcome to `done` and to
    `done_file` as it is measured."""
    import torch

    import longstraw
    from longstraw.train.rollout import SamplingSettings, TurnSampler

    play = stage.rollout_stage.rollout_func
    greedy = SamplingSettings(1, stage.cfg.max_completion_length, temperature=0.0)
    stage.model.eval()
    with torch.no_grad(), done_file.open("a") as sink:
        for ex in examples:
            t0 = time.perf_counter()
            ids = stage.encode(ex.prompt)
            with longstraw.capture(stage.model, ids) as state:
                r = play.trajectory(TurnSampler(state, stage.policy, greedy, torch.Generator()), ex)
            one = dict(success=float(r.extra["environment_reward"] == 1.0),  # the right code, not 0.25 for reading
                       turns=r.extra["turns"], tool_calls=r.extra["tool_calls"],
                       length=ids.shape[-1] + len(r.tokens), seconds=time.perf_counter() - t0)
            sink.write(json.dumps(one) + "\n")
            sink.flush()
            done.append(one)
            print(f"{when}: row {len(done)}/{total} {one}", flush=True)
    stage.model.train()


def reuse_before(path: Path, setup: dict) -> dict:
    """The 'before' record of an earlier results file, refused unless it played the same held-out rows: the same task
    settings and the same prompt lengths."""
    earlier = json.loads(path.read_text())
    then = next(r for r in earlier if r["when"] == "setup")
    same = ("model", "eval_rows", "sections", "section_tokens", "in_prompt", "distractors", "max_turns",
            "max_tool_tokens", "max_completion")
    differ = [k for k in same if then["args"].get(k) != setup["args"].get(k)]
    differ += [k for k in ("mean_prompt_tokens", "max_prompt_tokens") if then[k] != setup[k]]
    if differ:
        raise SystemExit(f"--before-from {path}: its held-out pass differs in {differ}")
    return dict(next(r for r in earlier if r["when"] == "before"), source=str(path))


def _table(rows: list[dict]) -> str:
    by = {r["when"]: r for r in rows}
    lines = ["| held-out rows | prompt tokens (mean) | before | after | gain (95 % CI) | mean turns before → after "
             "| tool calls before → after |", "|---:|---:|---:|---:|---:|---:|---:|"]
    if "gain" in by:
        b, a, g = by["before"], by["after"], by["gain"]
        prompt = f"{by['setup']['mean_prompt_tokens']:,.0f}" if "setup" in by else "—"
        calls = (f"{b['mean_tool_calls']:.2f} → {a['mean_tool_calls']:.2f}" if "mean_tool_calls" in b else "—")
        lines.append(f"| {b['rows']} | {prompt} | {b['success']:.3f} | {a['success']:.3f} | {g['gain']:+.3f} "
                     f"({g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}) | {b['mean_turns']:.2f} → {a['mean_turns']:.2f} "
                     f"| {calls} |")
    if "warm" in by:
        w = by["warm"]
        lines.append(f"\nAfter the warm-up alone: {w['success']:.3f} (Wilson {w['ci95'][0]:.3f}–{w['ci95'][1]:.3f}), "
                     f"{w['mean_turns']:.2f} turns, {w['mean_tool_calls']:.2f} tool calls per trajectory.")
    if "warm-short" in by:
        w = by["warm-short"]
        lines.append(f"\nThe short task's held-out rows after the warm-up: {w['success']:.3f} of {w['rows']} (Wilson "
                     f"{w['ci95'][0]:.3f}–{w['ci95'][1]:.3f}), {w['mean_turns']:.2f} turns.")
    if "source" in by.get("before", {}):
        lines.append(f"\n'before' is the base model's pass of the same held-out rows in {by['before']['source']}.")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    warm = next((r for r in rows if r["when"] == "warm-up"), None)
    train = next((r for r in rows if r["when"] == "training"), None)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    first = 1
    if warm:
        ax.plot(range(1, len(warm["reward"]) + 1), warm["reward"], "s-", color="0.6",
                label="sampled reward, warm-up (short task)")
        first = len(warm["reward"]) + 1
        ax.axvline(first - 0.5, color="0.6", linestyle=":")
    if train:
        ax.plot(range(first, first + len(train["reward"])), train["reward"], "o-",
                label="sampled reward (G trajectories)")
    for r, style in ((next((r for r in rows if r["when"] == "before"), None), "--"),
                     (next((r for r in rows if r["when"] == "after"), None), "-")):
        if r:
            ax.axhline(r["success"], linestyle=style, color="k", alpha=0.6, label=f"held-out greedy, {r['when']}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("sampled reward; held-out success (right code)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    title = rows[0].get("title", "SmolLM2-135M-Instruct, a document behind tools")
    ax.set_title(title.replace(", after", ",\nafter"), fontsize=9 if ", after" in title else None)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
