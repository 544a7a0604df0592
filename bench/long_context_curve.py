"""Does a real model learn past 100K tokens? Gemma 3 270M, many questions per document, at 32K / 64K / 128K.

    python bench/long_context_curve.py                    # the default phases, in order; a rerun goes on where it stopped
    python bench/long_context_curve.py --phases base:65536 --eval-docs 1 --tag probe      # a first look
    python bench/long_context_curve.py --redraw           # the table and the figure from the JSON
    → bench/results/long_context_curve[-TAG].{json,md,png}; work files (data, the run) in bench/out/long_context[-TAG]

The task: `longstraw.tasks.documents.make_document_rows` — one document of about LENGTH tokens of real English (the
standard library's docstrings), Q access-code sentences at random depths, Q rows that each ask for another archive's
code, the question last; reward `contains_answer`. Gemma 3 270M is a base model without a chat template: a row is the
document, the question and "Answer:" (`_bench.PLAIN_TEMPLATE`). Why this task rather than a tool agent: every held-out
question is scored by one greedy answer against a document captured once for all its questions, so 64 held-out
questions at 128K cost 4 captures, and the reward is dense enough for GRPO from the first step when the base model
finds some codes (an agent's tool calls would add turns of decode on top of the same captures).

Positions: Gemma 3 270M was trained to 32,768 positions; past that its full-attention layers (every sixth) get YaRN
(`rope_type: yarn`, factor LENGTH / 32,768 rounded up to a power of 2, `original_max_position_embeddings: 32768`), its
sliding-window layers (window 512) keep their RoPE: they never see a distance past 512.

Phases (`--phases`, in order; each records its rows as it measures them and is skipped or resumed on a rerun):
- `base:L` — the base model's greedy held-out accuracy at length L: EVAL_DOCS documents never trained on (other seeds),
  EVAL_Q questions each, each document captured once and its questions answered on branches of that state, decoded together;
- `train` — GRPO at TRAIN_LENGTH: Q questions of one document per step (`rows_per_context: Q`), the document kept for
  STEPS_PER_DOCUMENT steps (`recapture_every`), G responses each, those of advantage 0 not replayed
  (`skip_zero_advantage`: the same gradient; most groups early on); a checkpoint at each document's last step, so an
  interrupted run resumes there (the trainer's own resume);
- `after:L` — the trained adapter (the run's last checkpoint) on the same held-out questions as `base:L`;
- `anatomy:L` — the step's anatomy at length L: ANATOMY_STEPS GRPO steps of the base model on the first held-out
  document's questions (the document captured at the first step, kept for the others and probed for drift before each,
  `recapture_drift`), every response replayed, the adapter thrown away: each stage's seconds, peak RSS (the
  process's high-water mark reset at the phase's start) and state bytes; the table gives them per step and amortized
  over the document's steps (capture every STEPS_PER_DOCUMENT) and rows.

Each row keeps the process's CPU seconds beside its wall seconds (`cpu_s`, `capture_cpu_s`) and the 1-minute load
average: a stage that had its THREADS cores to itself used about THREADS CPU seconds per second; one that shared them
used fewer, and its time is not this machine's (`bench/plan_time.py` leaves such rows out).

The gain: paired bootstrap over the held-out questions (95 %, 2,000 resamples); accuracies with Wilson intervals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import PLAIN_TEMPLATE, finish, record  # noqa: E402
from real_learning_curve import paired_bootstrap, wilson  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NATIVE = 32_768  # Gemma 3 270M's max_position_embeddings
DEFAULT_PHASES = [
    "base:65536", "train", "after:65536", "base:131072", "after:131072", "base:32768",
    "anatomy:32768", "anatomy:65536", "anatomy:131072",
]
#: steps of an `anatomy:L` phase: one capture, then reuses of the kept state, each probed for drift first
ANATOMY_STEPS = 3
#: `recapture_drift` in the anatomy phases: the probe runs and is timed, and never asks for a new capture
NEVER_RECAPTURE = 1e9


def flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--phases", nargs="+", default=DEFAULT_PHASES, help="base:L, train, after:L, anatomy:L, in order")
    ap.add_argument("--train-length", type=int, default=65_536, help="training prompt positions (prompt + R)")
    ap.add_argument("--Q", type=int, default=16, help="questions per training document (rows per step)")
    ap.add_argument("--eval-Q", type=int, default=16, help="questions per held-out document")
    ap.add_argument("--eval-docs", type=int, default=4, help="held-out documents per length")
    ap.add_argument("--G", type=int, default=8, help="responses per question")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the GRPO responses")
    ap.add_argument(
        "--replay-all",
        action="store_true",
        help="replay every response (default: not those of advantage 0, `skip_zero_advantage`: the same gradient)",
    )
    ap.add_argument("--R", type=int, default=16, help="max_completion_length")
    ap.add_argument("--steps", type=int, default=48, help="GRPO steps")
    ap.add_argument("--steps-per-document", type=int, default=4, help="steps each training document stays")
    ap.add_argument("--learning-rate", type=float, default=2e-4)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags(ap)
    ap.add_argument("--redraw", action="store_true", help="rewrite the table and the figure from the JSON")
    args = ap.parse_args()
    name = "long_context_curve" + (f"-{args.tag}" if args.tag else "")
    out = RESULTS / name
    work = HERE / "out" / ("long_context" + (f"-{args.tag}" if args.tag else ""))
    rows = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else []
    if args.redraw:
        finish(rows, out, _plot, _table)
        return
    import torch

    torch.set_num_threads(args.threads)
    settings = {k: v for k, v in vars(args).items() if k not in ("phases", "redraw", "threads")}
    setup = next((r for r in rows if r.get("kind") == "setup"), None)
    if setup is not None and setup["settings"] != settings:
        # the held-out scores of the base model depend on the held-out settings alone: a changed training setting
        # keeps them (and drops the steps and scores of a run trained otherwise)
        held = ("eval_Q", "eval_docs", "R", "dtype", "seed")
        if any(setup["settings"].get(k) != settings[k] for k in held) or (work / "run" / "checkpoints").exists():
            raise SystemExit(f"{out}.json was measured with other settings ({setup['settings']}); give another --tag")
        rows[:] = [r for r in rows if r.get("kind") == "doc" and r["phase"] == "base"]
        rows.insert(0, {**setup, "settings": settings, "training_changed_from": setup["settings"]})
        shutil.rmtree(work / "run", ignore_errors=True)
        if any(setup["settings"].get(k) != settings[k] for k in ("Q", "steps", "steps_per_document", "train_length")):
            (work / "data" / f"train-{args.train_length}.jsonl").unlink(missing_ok=True)
    if setup is None:
        command = "python bench/long_context_curve.py" + "".join(
            f" {a}" if a.startswith("--") else f" {shlex.quote(a)}" for a in sys.argv[1:]
        )
        record(rows, dict(kind="setup", command=command, settings=settings, git=_git_head()), out)
    work.mkdir(parents=True, exist_ok=True)
    for phase in args.phases:
        if phase == "train":
            train(args, work, rows, out)
        else:
            which, length = phase.split(":")
            if which == "anatomy":
                anatomy(args, work, rows, out, int(length))
            else:
                evaluate(args, work, rows, out, which, int(length))
        finish(rows, out, _plot, _table)


def _git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()


def rope(positions: int) -> dict:
    """`model_overrides` for `positions` (prompt + response): YaRN on the full-attention layers past 32,768."""
    if positions <= NATIVE:
        return {}
    factor = 2 ** math.ceil(math.log2(positions / NATIVE))
    return {
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "factor": float(factor),
                "original_max_position_embeddings": NATIVE,
                "rope_theta": 1_000_000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "max_position_embeddings": factor * NATIVE,
    }


def rows_file(args, work: Path, what: str, length: int) -> Path:
    """JSONL rows of `what` ("train" or "eval") at `length` positions, written once (the same seeds on a rerun):
    training documents each repeated STEPS_PER_DOCUMENT times, held-out documents once."""
    path = work / "data" / f"{what}-{length}.jsonl"
    if path.exists():
        return path
    from transformers import AutoTokenizer

    from longstraw.tasks.documents import make_document_rows, paragraphs
    from longstraw.tools.real_models import model_path

    tok = AutoTokenizer.from_pretrained(model_path("gemma3"))
    tok.chat_template = PLAIN_TEMPLATE
    target = length - 2 * args.R  # the prompt; the response's R positions and a margin after it
    if what == "train":
        docs, q, rng = math.ceil(args.steps / args.steps_per_document), args.Q, random.Random(args.seed)
        repeat = args.steps_per_document
    else:
        docs, q, rng = args.eval_docs, args.eval_Q, random.Random(10_000 + args.seed + length)
        repeat = 1
    lines = []
    for d in range(docs):
        made = make_document_rows(tok, paragraphs(), target, q, rng, f"{what}-{length} document {d}")
        made = [
            {
                **{k: v for k, v in r.items() if k != "messages"},
                "prompt": tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
            }
            for r in made
        ]
        lines += [json.dumps(r) + "\n" for _ in range(repeat) for r in made]
        print(f"data: {path.name} document {d + 1}/{docs}", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text("".join(lines))
    tmp.replace(path)
    return path


def config(args, work: Path, length: int, output_dir: Path, eval_path: Path | None = None):
    from longstraw.tools.real_models import model_path
    from longstraw.train.config import TrainConfig

    return TrainConfig(
        model=str(model_path("gemma3")),
        model_overrides=rope(length),
        dataset=str(rows_file(args, work, "train", args.train_length)) if eval_path is None else str(eval_path),
        eval_dataset=str(eval_path) if eval_path is not None else None,
        reward_funcs=["contains_answer"],
        lora=True,
        lora_r=16,
        lora_alpha=32,
        num_generations=args.G,
        prompts_per_step=args.Q,
        rows_per_context=args.Q,
        num_steps=args.steps,
        max_completion_length=args.R,
        learning_rate=args.learning_rate,
        temperature=args.temperature,
        skip_zero_advantage=not args.replay_all,
        recapture_every=args.steps_per_document,
        dtype=args.dtype,
        threads=args.threads,
        output_dir=str(output_dir),
        progress=True,
        eval_at_start=False,
        save_every=args.steps_per_document,
        num_completions_to_print=0,
        seed=args.seed,
    )


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def train(args, work: Path, rows: list[dict], out: Path) -> None:
    """GRPO at TRAIN_LENGTH, resumed from the run's last checkpoint; each step's numbers recorded as it ends."""
    from longstraw.train.trainer import Trainer

    run = work / "run"
    done = {r["step"] for r in rows if r.get("kind") == "step"}
    trainer = Trainer(config(args, work, args.train_length, run))
    t0 = time.perf_counter()

    c0 = time.process_time()

    def on_step(m: dict) -> bool:
        nonlocal t0, c0
        row = dict(
            kind="step",
            step=m["step"],
            wall_s=time.perf_counter() - t0,
            reward=m["reward"],
            loss=m["loss"],
            prompt_tokens=m["prompt_length"],
            captured=m.get("state_captures", m.get("contexts")),
            reused=m.get("state_reuses", 0),
            peak_rss_gb=peak_rss_gb(),
            load=os.getloadavg()[0],
            cpu_s=time.process_time() - c0,
            **{k: v for k, v in m.items() if k.startswith("time_") or k.startswith("state_")},
        )
        if m["step"] in done:  # a step redone after a resume from an earlier checkpoint: the new numbers replace it
            rows[:] = [r for r in rows if not (r.get("kind") == "step" and r["step"] == m["step"])]
        record(rows, row, out)
        t0, c0 = time.perf_counter(), time.process_time()
        return False

    trainer.train(on_step=on_step)


def evaluate(args, work: Path, rows: list[dict], out: Path, which: str, length: int) -> None:
    """Greedy held-out accuracy at `length` of the base model (`which` = base) or of the run's last checkpoint
    (after); one row per document, so a rerun goes on with the next document."""
    import torch

    from longstraw import capture
    from longstraw.ragged import sample_branches
    from longstraw.losses import combine_rewards
    from longstraw.train.checkpoint import latest_name, load_checkpoint
    from longstraw.train.sharing import common_prefix_length
    from longstraw.train.trainer import Trainer

    held_path = rows_file(args, work, "eval", length)
    root = work / "run" / "checkpoints"
    name = latest_name(root) if which == "after" else None
    if which == "after" and name is None:
        raise SystemExit(f"after:{length}: no checkpoint in {root}; run the train phase first")
    # `after` scores the run's latest checkpoint: rows of an earlier one stay, beside the new ones
    step = 0 if name is None else int(name.split("-")[-1])
    have = {r["doc"] for r in rows if r.get("kind") == "doc" and r["phase"] == which and r["length"] == length
            and r["step"] == step}
    if len(have) >= args.eval_docs:
        return
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(config(args, work, length, Path(tmp), eval_path=held_path))
        if name is not None:
            step = int(load_checkpoint(root, trainer.model, trainer.opt, trainer.sched, name=name)["step"])
        held = trainer.data.eval_rows
        docs = [held[i : i + args.eval_Q] for i in range(0, len(held), args.eval_Q)]
        trainer.model.eval()
        for d, doc in enumerate(docs):
            if d in have:
                continue
            prompts = [trainer.encode(ex.prompt) for ex in doc]
            shared = min(common_prefix_length(prompts[0], p) for p in prompts)
            w0, c0 = time.perf_counter(), time.process_time()

            def show(done: int, total: int) -> None:
                print(f"\r{which}:{length} document {d + 1}/{len(docs)}: captured {done:,}/{total:,} tokens "
                      f"({time.perf_counter() - w0:.0f} s)", end="", file=sys.stderr, flush=True)

            per_row = []
            with torch.no_grad(), capture(trainer.model, prompts[0][:shared], chunk_size=trainer.cfg.chunk_size,
                                          progress=show) as state:
                capture_s, capture_cpu_s = time.perf_counter() - w0, time.process_time() - c0
                print(file=sys.stderr)
                with contextlib.ExitStack() as stack:
                    branches = [stack.enter_context(state.fork()) for _ in doc]
                    for branch, p in zip(branches, prompts):
                        branch.extend(p[shared:])
                    # the document's questions decoded in one batch (`sample_branches`), greedily
                    samples = sample_branches(branches, 1, args.R, temperature=0, stop_token_ids=[trainer.eos])
                for ex, s in zip(doc, samples):
                    ids = s.tokens[0].tolist()
                    text = trainer.tok.decode(ids, skip_special_tokens=False)
                    score = combine_rewards(trainer.rewards.score(ex, [text], [ids]), trainer.rewards.weights)[0]
                    per_row.append(dict(answer=ex.answer, depth=ex.columns.get("depth"), completion=text,
                                        correct=float(score)))
                state_bytes = state.nbytes
            record(rows, dict(kind="doc", phase=which, length=length, doc=d, step=step, prompt_tokens=int(prompts[0].numel()),
                              capture_s=capture_s, capture_cpu_s=capture_cpu_s, eval_s=time.perf_counter() - w0, state_bytes=state_bytes,
                              peak_rss_gb=peak_rss_gb(), load=os.getloadavg()[0], per_row=per_row), out)
        trainer.close()


def _reset_peak_rss() -> None:
    """Start the process's resident high-water mark (VmHWM) afresh (Linux: `clear_refs` 5)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _vm_hwm_gb() -> float:
    """The process's resident high-water mark since the last `_reset_peak_rss` (ru_maxrss where /proc is absent)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return peak_rss_gb()


def anatomy(args, work: Path, rows: list[dict], out: Path, length: int) -> None:
    """ANATOMY_STEPS GRPO steps at `length` on the first held-out document (see the module doc); one row per step. A
    phase that stopped part way is measured again from its first step (its capture is the step that matters)."""
    import dataclasses

    from longstraw.train.trainer import Trainer

    got = [r for r in rows if r.get("kind") == "anatomy" and r["length"] == length]
    if len(got) >= ANATOMY_STEPS:
        return
    rows[:] = [r for r in rows if not (r.get("kind") == "anatomy" and r["length"] == length)]
    held = rows_file(args, work, "eval", length).read_text().splitlines(keepends=True)[: args.eval_Q]
    path = work / "data" / f"anatomy-{length}.jsonl"
    path.write_text("".join(held) * ANATOMY_STEPS)
    _reset_peak_rss()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(
            config(args, work, length, Path(tmp), eval_path=path),
            num_steps=ANATOMY_STEPS,
            skip_zero_advantage=False,
            recapture_drift=NEVER_RECAPTURE,
            save_every=ANATOMY_STEPS,
        )
        trainer = Trainer(cfg)
        t0, c0 = time.perf_counter(), time.process_time()

        def on_step(m: dict) -> bool:
            nonlocal t0, c0
            record(rows, dict(
                kind="anatomy", length=length, step=m["step"], prompt_tokens=m["prompt_length"], Q=args.eval_Q,
                G=args.G, R=args.R, captured=m.get("state_captures"), reused=m.get("state_reuses"),
                state_bytes=m.get("durable_bytes"), drift=m.get("state_drift"), wall_s=time.perf_counter() - t0,
                cpu_s=time.process_time() - c0, peak_rss_gb=_vm_hwm_gb(), load=os.getloadavg()[0],
                **{k: v for k, v in m.items() if k.startswith("time_")},
            ), out)
            t0, c0 = time.perf_counter(), time.process_time()
            return False

        trainer.train(on_step=on_step)
        trainer.close()


def _anatomy_table(rows: list[dict], steps_per_document: int) -> list[str]:
    """Per length: the capture step and the mean of the reuse steps, then a step amortized over the document's steps
    (one capture per `steps_per_document`, a probe before each reuse) and per row."""
    got = sorted((r for r in rows if r.get("kind") == "anatomy"), key=lambda r: (r["length"], r["step"]))
    if not got:
        return []
    k = steps_per_document
    lines = [
        "",
        f"The step's anatomy (`anatomy:L`: the base model, one held-out document's questions, every response replayed; "
        f"seconds; amortized = capture / {k} + probe × {k - 1} / {k} + sample + replay + optimizer):",
        "",
        "| length | prompt tokens | Q × G | capture | drift probe | sample | replay | optimizer | step, amortized | per row "
        "| state MiB | peak RSS GB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in sorted({r["length"] for r in got}):
        part = [r for r in got if r["length"] == length]
        first = [r for r in part if r.get("captured")]
        reuse = [r for r in part if not r.get("captured")]
        if not first or not reuse:
            continue

        def mean(key: str, rs=reuse) -> float:
            return sum(r.get(key) or 0.0 for r in rs) / len(rs)

        cap, probe = first[0]["time_capture"], mean("time_capture")
        sample = mean("time_sample", part)
        replay = mean("time_replay", part)
        opt = mean("time_optimizer", part)
        step = cap / k + probe * (k - 1) / k + sample + replay + opt
        q = part[0]["Q"]
        lines.append(
            f"| {length:,} | {part[0]['prompt_tokens']:,} | {q} × {part[0]['G']} | {cap:.1f} | {probe:.2f} | "
            f"{sample:.1f} | {replay:.1f} | {opt:.2f} | {step:.1f} | {step / q:.2f} | "
            f"{(part[0]['state_bytes'] or 0) / 2**20:.1f} | {max(r['peak_rss_gb'] for r in part):.2f} |"
        )
    return lines


def points(rows: list[dict], latest: bool = True) -> dict[tuple, list[dict]]:
    """(phase, length) → its documents' rows, in document order: the latest checkpoint's for `after`; with
    `latest=False`, (phase, length, step) → those of every checkpoint scored."""
    got: dict[tuple, list[dict]] = {}
    for r in sorted((r for r in rows if r.get("kind") == "doc"), key=lambda r: r["doc"]):
        got.setdefault((r["phase"], r["length"], r["step"]), []).append(r)
    if not latest:
        return got
    last: dict[tuple, int] = {}
    for phase, length, step in got:
        last[phase, length] = max(step, last.get((phase, length), step))
    return {(p, n): docs for (p, n, step), docs in got.items() if step == last[p, n]}


def _table(rows: list[dict]) -> str:
    setup = next((r for r in rows if r.get("kind") == "setup"), {})
    s = setup.get("settings", {})
    lines = [
        f"`{setup.get('command', 'python bench/long_context_curve.py')}`",
        "",
        f"Gemma 3 270M ({s.get('dtype')}, LoRA r 16 / alpha 32, learning rate {s.get('learning_rate')}), YaRN on the "
        f"full-attention layers past 32,768 positions; GRPO at {s.get('train_length', 0):,} positions: {s.get('Q')} "
        f"questions of one document per step, G = {s.get('G')}, R = {s.get('R')}, each document kept "
        f"{s.get('steps_per_document')} steps. Held-out: {s.get('eval_docs')} documents × {s.get('eval_Q')} questions "
        f"per length, greedy. Commit {str(setup.get('git', '?'))[:12]}.",
        "",
        "| phase | length | after step | documents | held-out accuracy (95 % CI) | gain over base (paired 95 % CI) | "
        "mean capture s | peak RSS GB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pts = points(rows)
    every = points(rows, latest=False)
    for (phase, length, _), docs in sorted(every.items(), key=lambda kv: (kv[0][1], kv[0][0] != "base", kv[0][2])):
        correct = [x["correct"] for d in docs for x in d["per_row"]]
        k, n = sum(correct), len(correct)
        lo, hi = wilson(k, n)
        gain = "–"
        base = pts.get(("base", length))
        if phase == "after" and base is not None:
            before = [x["correct"] for d in base for x in d["per_row"]][: n]
            if len(before) == n:
                a, b = paired_bootstrap(before, correct)
                gain = f"{k / n - sum(before) / n:+.3f} ({a:+.3f}, {b:+.3f})"
        lines.append(
            f"| {phase} | {length:,} | {docs[0]['step']} | {len(docs)} | {k / n:.3f} ({lo:.3f}, {hi:.3f}) | {gain} | "
            f"{sum(d['capture_s'] for d in docs) / len(docs):.0f} | {max(d['peak_rss_gb'] for d in docs):.2f} |"
        )
    steps = sorted((r for r in rows if r.get("kind") == "step"), key=lambda r: r["step"])
    if steps:
        lines += [
            "",
            "| steps | mean sampled reward | mean step wall s | captures | reuses | peak RSS GB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for i in range(0, len(steps), 8):
            part = steps[i : i + 8]
            lines.append(
                f"| {part[0]['step']}–{part[-1]['step']} | {sum(r['reward'] for r in part) / len(part):.3f} | "
                f"{sum(r['wall_s'] for r in part) / len(part):.1f} | {sum(r['captured'] or 0 for r in part)} | "
                f"{sum(r['reused'] or 0 for r in part)} | {max(r['peak_rss_gb'] for r in part):.2f} |"
            )
    lines += _anatomy_table(rows, s.get("steps_per_document", 4))
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    steps = sorted((r for r in rows if r.get("kind") == "step"), key=lambda r: r["step"])
    if steps:
        xs = [r["step"] for r in steps]
        ys = [r["reward"] for r in steps]
        axes[0].plot(xs, ys, ".", alpha=0.4, label="step")
        k = 8
        axes[0].plot(xs[k - 1 :], [sum(ys[i - k + 1 : i + 1]) / k for i in range(k - 1, len(ys))], "-",
                     label=f"mean of {k}")
        axes[0].legend()
    axes[0].set_xlabel("GRPO step")
    axes[0].set_ylabel("sampled reward")
    pts = points(rows)
    for phase, style in (("base", "o--"), ("after", "s-")):
        got = sorted((length, docs) for (p, length), docs in pts.items() if p == phase)
        if got:
            xs, accs, errs = [], [], []
            for length, docs in got:
                correct = [x["correct"] for d in docs for x in d["per_row"]]
                k, n = sum(correct), len(correct)
                lo, hi = wilson(k, n)
                xs.append(length)
                accs.append(k / n)
                errs.append((k / n - lo, hi - k / n))
            axes[1].errorbar(xs, accs, yerr=list(zip(*errs)), fmt=style, capsize=3, label=phase)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("held-out prompt length (tokens)")
    axes[1].set_ylabel("greedy accuracy")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    os.sync()


if __name__ == "__main__":
    main()
