"""Many questions per document at equal CPU time: a fresh capture every step against a state kept 8 steps.

    python bench/many_questions_curve.py                  # SmolLM2, ~2K-token documents, arms recapture_every 1 and 8
    → bench/results/many_questions_curve[-TAG].{json,md,png}

SmolLM2-135M-Instruct (`longstraw real smollm2`, fp32, LoRA r 16 / alpha 32, learning rate 1e-4: the real learning
curve's settings) learns the many-questions documents task (`longstraw.tasks.documents.make_document_rows`: Q
access-code sentences at random depths in one document of about LENGTH tokens of real English, Q rows that each ask
about another archive, the question last; reward `contains_answer`). Every GRPO step trains on the Q questions of one
document (`prompts_per_step: Q`, `rows_per_context: Q`: the document captured once for the step's Q rows), G
responses each.

A document stays for STEPS_PER_DOCUMENT consecutive steps (its Q rows written that many times under one `context`:
the trainer's `rows_by_context` keeps them together), so that a state kept across steps can be read again. Both arms
train on exactly that data stream, in the same order, with the same sampling seeds; they differ in one field:

- `recapture_every: 1`: the document captured afresh at every step;
- `recapture_every: 8`: the document's detached state captured at its first step and kept for up to 8 optimizer
  steps (`longstraw.train.staleness`), its K/V from weights up to 7 updates old.

Each arm runs in a fresh process on THREADS torch threads until its training has used the CPU seconds of the last
`--eval-at` point (process CPU time, `time.process_time`, of the training steps only: evaluation is not counted).
After the first step that passes each `--eval-at` point the adapter is scored greedily on the held-out set: EVAL_DOCS
documents drawn with other seeds than the training ones, Q questions each. The starting point (CPU 0) is scored once, in
a process of its own, for both arms (LoRA's B starts at 0: both arms' starting models are the base model).

Held-out evaluation captures each held-out document once and reads each of its questions on a branch of that state
(`PromptState.fork`, `Branch.extend`, `Branch.sample`, greedy), as the trainer's rollout does, instead of a capture per
question (`Trainer.score_examples`): a quarter of the cost at Q = 4. The first CHECK_DOCS held-out documents are also
scored by `Trainer.score_examples` and the two compared (the `eval_check` row).

Cost on one thread at the defaults (measured with the machine shared): a step ~40 CPU s (P ≈ 2,000: capture ~8 s,
sampling ~13 s, replay ~23 s), a held-out evaluation of 64 questions ~260 s; base evaluation, then per arm 900 training
CPU s and 2 evaluations: about 55 minutes in all.

Accuracy intervals: Wilson 95 %. The difference of the arms at each `--eval-at` point: paired bootstrap over the
held-out questions (2,000 resamples). Rows are written as they are measured to the JSON (an interrupted run keeps
them); `--redraw` rewrites the table and the figure from it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, record  # noqa: E402
from real_learning_curve import paired_bootstrap, wilson  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--length", type=int, default=2048, help="document prompt length target in tokens")
    ap.add_argument("--Q", type=int, default=4, help="questions per document (rows per step)")
    ap.add_argument("--G", type=int, default=8, help="responses per question")
    ap.add_argument("--R", type=int, default=16, help="max_completion_length")
    ap.add_argument("--arms", type=int, nargs="+", default=[1, 8], help="recapture_every of each arm")
    ap.add_argument("--steps-per-document", type=int, default=8, help="consecutive steps each training document stays")
    ap.add_argument("--train-docs", type=int, default=24, help="training documents written (more than a run reaches)")
    ap.add_argument("--eval-docs", type=int, default=16, help="held-out documents (Q questions each)")
    ap.add_argument(
        "--check-docs", type=int, default=1, help="held-out documents also scored by Trainer.score_examples"
    )
    ap.add_argument(
        "--eval-at",
        type=float,
        nargs="+",
        default=[450, 900],
        help="training CPU seconds after which each arm is scored; the last is each arm's budget",
    )
    ap.add_argument("--max-steps", type=int, default=1000, help="a guard: no arm runs more steps")
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags(ap)
    ap.add_argument("--redraw", action="store_true", help="rewrite the table and the figure from the JSON")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "base" or an arm's recapture_every (a child process)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = RESULTS / ("many_questions_curve" + (f"-{args.tag}" if args.tag else ""))
    if args.redraw:
        finish(json.loads(out.with_suffix(".json").read_text()), out, _plot, _table)
        return
    if args.one:
        run_child(args)
        return

    command = "python bench/many_questions_curve.py" + "".join(
        f" {a}" if a.startswith("--") else f" {shlex.quote(a)}" for a in sys.argv[1:]
    )
    rows: list[dict] = []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as d:
        info = write_data(args, Path(d))
        import longstraw

        record(
            rows,
            dict(
                kind="setup",
                command=command,
                **vars(args),
                **info,
                library=str(Path(longstraw.__file__).parent),
                git=_git_head(),
            ),
            out,
        )
        passthrough = [a for a in sys.argv[1:]]
        for one in ["base", *map(str, args.arms)]:
            cmd = [sys.executable, __file__, *passthrough, "--one", one, "--data", d]
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL
            )
            assert proc.stdout is not None and proc.stderr is not None
            for line in proc.stdout:
                if line.startswith("ROW "):
                    record(rows, json.loads(line[4:]), out)
            err = proc.stderr.read()
            if proc.wait() != 0:
                record(rows, dict(kind="error", arm=one, error=err[-4000:]), out)
    for a in args.arms:
        for e in args.eval_at:
            gap = arm_difference(rows, a, args.arms[0], e)
            if gap is not None and a != args.arms[0]:
                record(rows, gap, out)
    finish(rows, out, _plot, _table)


def _git_head() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent
        ).stdout.strip()
    except OSError:
        return "?"


def write_data(args, folder: Path) -> dict:
    """train.jsonl (each training document's Q rows, `steps_per_document` times) and eval.jsonl (the held-out
    documents' Q rows, once) into `folder`; returns what the setup row says of them."""
    from transformers import AutoTokenizer

    from longstraw.tasks.documents import make_document_rows, paragraphs, prompt_tokens
    from longstraw.tools.real_models import model_path

    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    paras = paragraphs()
    rng = random.Random(args.seed)
    train = [
        make_document_rows(tok, paras, args.length, args.Q, rng, f"train document {d}") for d in range(args.train_docs)
    ]
    rng = random.Random(10_000 + args.seed)
    held = [
        make_document_rows(tok, paras, args.length, args.Q, rng, f"eval document {d}") for d in range(args.eval_docs)
    ]
    (folder / "train.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for doc in train for _ in range(args.steps_per_document) for r in doc)
    )
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for doc in held for r in doc))

    def text(r):
        return r["messages"][0]["content"].rsplit("\n\nQuestion:", 1)[0]

    def fact(r):  # (archive, code) of the row's question
        return r["messages"][0]["content"].rsplit(" archive?", 1)[0].rsplit(" ", 1)[-1], r["answer"]

    texts = {text(r) for doc in train for r in doc}
    facts = {fact(r) for doc in train for r in doc}
    return dict(
        train_prompt_tokens=[prompt_tokens(tok, doc[0]["messages"][0]["content"]) for doc in train[:4]],
        eval_docs_in_train=sum(text(doc[0]) in texts for doc in held),
        eval_facts_in_train=sum(fact(r) in facts for doc in held for r in doc),
        eval_archives=sorted({fact(r)[0] for doc in held for r in doc}),
    )


def emit(row: dict) -> None:
    print("ROW " + json.dumps(row), flush=True)


def run_child(args) -> None:
    """One process: the base model's held-out score (`--one base`), or one arm's training and its scores."""
    import torch

    from longstraw.tools.real_models import model_path
    from longstraw.train.config import TrainConfig
    from longstraw.train.trainer import Trainer

    arm = None if args.one == "base" else int(args.one)
    d = Path(args.data)
    with tempfile.TemporaryDirectory() as run:
        cfg = TrainConfig(
            model=str(model_path("smollm2")),
            dataset=str(d / "train.jsonl"),
            eval_dataset=str(d / "eval.jsonl"),
            reward_funcs=["contains_answer"],
            lora=True,
            lora_r=16,
            lora_alpha=32,
            num_generations=args.G,
            prompts_per_step=args.Q,
            rows_per_context=args.Q,
            num_steps=args.max_steps,
            max_completion_length=args.R,
            learning_rate=args.learning_rate,
            recapture_every=arm or 1,
            dtype="fp32",
            threads=args.threads,
            output_dir=run,
            progress=False,
            eval_at_start=False,
            save_every=10**6,
            num_completions_to_print=0,
            log_completions=False,
            seed=args.seed,
        )
        trainer = Trainer(cfg)
        assert torch.get_num_threads() == args.threads
        held = trainer.data.eval_rows
        docs = [held[i : i + args.Q] for i in range(0, len(held), args.Q)]
        if arm is None:
            emit(
                dict(
                    kind="point",
                    arm="base",
                    step=0,
                    cpu_s=0.0,
                    wall_s=0.0,
                    captures=0,
                    reuses=0,
                    **evaluate(trainer, docs),
                )
            )
            emit(check_eval(trainer, docs[: args.check_docs]))
            return
        todo = sorted(args.eval_at)
        cpu = wall = 0.0
        captures = reuses = 0
        step = 0
        while todo and step < args.max_steps:
            c0, w0 = time.process_time(), time.perf_counter()
            m = trainer.train_step(step)
            dc, dw = time.process_time() - c0, time.perf_counter() - w0
            cpu += dc
            wall += dw
            fresh = m.get("state_captures", m["contexts"])
            captures += fresh
            reuses += m.get("state_reuses", 0)
            emit(
                dict(
                    kind="step",
                    arm=arm,
                    step=step + 1,
                    step_cpu_s=dc,
                    step_wall_s=dw,
                    cpu_s=cpu,
                    wall_s=wall,
                    captured=fresh,
                    reused=m.get("state_reuses", 0),
                    reward=m["reward"],
                    loss=m["loss"],
                    prompt_tokens=m["prompt_length"],
                    contexts=m["contexts"],
                    **{k: v for k, v in m.items() if k.startswith("time_")},
                )
            )
            step += 1
            if cpu >= todo[0]:
                target = todo[0]
                while todo and cpu >= todo[0]:
                    todo.pop(0)
                emit(
                    dict(
                        kind="point",
                        arm=arm,
                        target_cpu_s=target,
                        step=step,
                        cpu_s=cpu,
                        wall_s=wall,
                        captures=captures,
                        reuses=reuses,
                        **evaluate(trainer, docs),
                    )
                )
        if trainer.store is not None:
            trainer.store.clear()


def evaluate(trainer, docs) -> dict:
    """Greedy held-out accuracy, each document captured once and its questions read on branches of the state."""
    import torch

    from longstraw import capture
    from longstraw.losses import combine_rewards
    from longstraw.train.sharing import common_prefix_length

    c0, w0 = time.process_time(), time.perf_counter()
    trainer.model.eval()
    per_row = []
    with torch.no_grad():
        for rows in docs:
            prompts = [trainer.encode(ex.prompt) for ex in rows]
            shared = min(common_prefix_length(prompts[0], p) for p in prompts)
            with capture(trainer.model, prompts[0][:shared], chunk_size=trainer.cfg.chunk_size) as state:
                for ex, p in zip(rows, prompts):
                    with state.fork() as branch:
                        branch.extend(p[shared:])
                        s = branch.sample(
                            trainer.cfg.max_completion_length, temperature=0, stop_token_ids=[trainer.eos]
                        )
                    ids = s.tokens[0].tolist()
                    text = trainer.tok.decode(ids, skip_special_tokens=False)
                    reward = float(
                        combine_rewards(trainer.rewards.score(ex, [text], [ids]), trainer.rewards.weights)[0]
                    )
                    per_row.append(
                        dict(
                            context=ex.columns.get("context"),
                            answer=ex.answer,
                            depth=ex.columns.get("depth"),
                            completion=text,
                            correct=reward,
                        )
                    )
    trainer.model.train()
    k = sum(r["correct"] for r in per_row)
    return dict(
        rows=len(per_row),
        accuracy=k / len(per_row),
        ci95=wilson(k, len(per_row)),
        eval_cpu_s=time.process_time() - c0,
        eval_wall_s=time.perf_counter() - w0,
        per_row=per_row,
    )


def check_eval(trainer, docs) -> dict:
    """The shared-prefix evaluation against `Trainer.score_examples` (a capture per question) on `docs`."""
    rows = [ex for doc in docs for ex in doc]
    w0 = time.perf_counter()
    shared = evaluate(trainer, docs)["per_row"]
    shared_s = time.perf_counter() - w0
    trainer.model.eval()
    w0 = time.perf_counter()
    lib = trainer.score_examples(rows)
    lib_s = time.perf_counter() - w0
    trainer.model.train()
    same = [a["completion"] == b["completion"] for a, b in zip(shared, lib)]
    return dict(
        kind="eval_check",
        rows=len(rows),
        same_completion=sum(same),
        same_reward=sum(a["correct"] == b["reward"] for a, b in zip(shared, lib)),
        shared_wall_s=shared_s,
        per_question_wall_s=lib_s,
        pairs=[dict(shared=a["completion"], library=b["completion"]) for a, b in zip(shared, lib)],
    )


def points(rows: list[dict], arm) -> list[dict]:
    """An arm's scored points, its CPU-0 point (the base model's) first."""
    base = [r for r in rows if r.get("kind") == "point" and r["arm"] == "base"]
    return base + [r for r in rows if r.get("kind") == "point" and r["arm"] == arm]


def arm_difference(rows: list[dict], arm: int, ref: int, target: float) -> dict | None:
    a = [r for r in points(rows, arm) if r.get("target_cpu_s") == target]
    b = [r for r in points(rows, ref) if r.get("target_cpu_s") == target]
    if not a or not b:
        return None
    x, y = [r["correct"] for r in a[0]["per_row"]], [r["correct"] for r in b[0]["per_row"]]
    lo, hi = paired_bootstrap(y, x)
    return dict(
        kind="difference", arm=arm, ref=ref, target_cpu_s=target, diff=sum(x) / len(x) - sum(y) / len(y), ci95=(lo, hi)
    )


def _arms(rows: list[dict]) -> list[int]:
    setup = next((r for r in rows if r.get("kind") == "setup"), {})
    return setup.get("arms") or sorted({r["arm"] for r in rows if r.get("kind") == "step"})


def _setup_text(rows: list[dict]) -> str:
    """What ran, on which library, and what one step and one evaluation cost (what the budget was sized from)."""
    setup = next((r for r in rows if r.get("kind") == "setup"), {})
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "point"]
    text = (
        f"SmolLM2-135M-Instruct, fp32, LoRA r 16 / alpha 32, learning rate {setup.get('learning_rate', '?'):g}, "
        f"{setup.get('threads', '?')} torch thread; {setup.get('Q', '?')} questions of one document per step "
        f"(prompts of {', '.join(f'{n:,}' for n in setup.get('train_prompt_tokens', []))}, ... tokens), "
        f"G = {setup.get('G', '?')}, R = {setup.get('R', '?')}; each training document stays "
        f"{setup.get('steps_per_document', '?')} consecutive steps (its questions repeated), the same data stream in "
        f"both arms; held-out: {setup.get('eval_docs', '?')} other documents × {setup.get('Q', '?')} questions "
        f"({setup.get('eval_docs_in_train', '?')} of them and {setup.get('eval_facts_in_train', '?')} of their "
        f"(archive, code) facts in the training documents), scored greedily. Library: {setup.get('library', '?')} "
        f"at commit {setup.get('git', '?')[:12]}."
    )
    if steps and evals:
        step_s = sum(r["step_cpu_s"] for r in steps) / len(steps)
        eval_s = sum(r["eval_wall_s"] for r in evals) / len(evals)
        text += (
            f" Sizing: a step costs ~{step_s:.0f} CPU s (capture ~{steps[0].get('time_capture', 0):.0f} s of it), a "
            f"held-out evaluation ~{eval_s:.0f} s, so the base evaluation, {len(setup.get('eval_at', []))} evaluations "
            f"per arm and {setup.get('eval_at', ['?'])[-1]} training CPU s per arm fill about an hour of one core."
        )
    return text


def _table(rows: list[dict]) -> str:
    setup = next((r for r in rows if r.get("kind") == "setup"), {})
    lines = [
        f"`{setup.get('command', '?')}`",
        "",
        _setup_text(rows),
        "",
        "| arm (recapture_every) | eval after step | training CPU s | training wall s | held-out accuracy (95 % CI) "
        "| gain over the base model (paired bootstrap 95 % CI) | captures | reuses | eval wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in _arms(rows):
        pts = points(rows, arm)
        for p in pts:
            lo, hi = p["ci95"]
            gain = "–"
            if p is not pts[0] and pts[0]["arm"] == "base":
                before = [r["correct"] for r in pts[0]["per_row"]]
                after = [r["correct"] for r in p["per_row"]]
                g_lo, g_hi = paired_bootstrap(before, after)
                gain = f"{p['accuracy'] - pts[0]['accuracy']:+.3f} ({g_lo:+.3f}, {g_hi:+.3f})"
            lines.append(
                f"| {arm} | {p['step']} | {p['cpu_s']:,.0f} | {p['wall_s']:,.0f} | {p['accuracy']:.3f} "
                f"({lo:.3f}, {hi:.3f}) | {gain} | {p['captures']} | {p['reuses']} | {p['eval_wall_s']:.0f} |"
            )
    lines += [
        "",
        "| arm | steps | mean step CPU s | step CPU s, capturing steps | step CPU s, reusing steps | "
        "mean capture s (capturing steps) | mean sampled reward, first 8 / last 8 steps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm in _arms(rows):
        steps = [r for r in rows if r.get("kind") == "step" and r["arm"] == arm]
        if not steps:
            continue
        cap = [r for r in steps if r["captured"]]
        reuse = [r for r in steps if not r["captured"]]

        def mean(xs):
            return sum(xs) / len(xs) if xs else float("nan")

        def cost(xs):
            return f"{mean(xs):.1f} ({len(xs)})" if xs else "–"

        lines.append(
            f"| {arm} | {len(steps)} | {mean([r['step_cpu_s'] for r in steps]):.1f} | "
            f"{cost([r['step_cpu_s'] for r in cap])} | {cost([r['step_cpu_s'] for r in reuse])} | "
            f"{mean([r.get('time_capture', 0.0) for r in cap]):.1f} | "
            f"{mean([r['reward'] for r in steps[:8]]):.3f} / {mean([r['reward'] for r in steps[-8:]]):.3f} |"
        )
    diffs = [r for r in rows if r.get("kind") == "difference"]
    if diffs:
        lines += [
            "",
            "| at training CPU s | arm − arm | accuracy difference (paired bootstrap 95 % CI) |",
            "|---:|---|---:|",
        ]
        for r in diffs:
            lines.append(
                f"| {r['target_cpu_s']:,.0f} | {r['arm']} − {r['ref']} | {r['diff']:+.3f} "
                f"({r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}) |"
            )
    check = next((r for r in rows if r.get("kind") == "eval_check"), None)
    if check:
        lines += [
            "",
            f"Shared-prefix evaluation against `Trainer.score_examples` on {check['rows']} held-out questions: "
            f"{check['same_completion']} identical completions, {check['same_reward']} identical scores "
            f"({check['shared_wall_s']:.0f} s against {check['per_question_wall_s']:.0f} s).",
        ]
    for r in rows:
        if r.get("kind") == "error":
            lines.append(f"\narm {r['arm']} failed: {r['error'].strip().splitlines()[-1] if r['error'] else '?'}")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = next((r for r in rows if r.get("kind") == "setup"), {})
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.5))
    styles = ["o-", "s--", "^-.", "d:"]
    for i, arm in enumerate(_arms(rows)):
        pts = points(rows, arm)
        if pts:
            xs = [p["cpu_s"] for p in pts]
            ys = [p["accuracy"] for p in pts]
            err = [[y - p["ci95"][0] for y, p in zip(ys, pts)], [p["ci95"][1] - y for y, p in zip(ys, pts)]]
            axes[0].errorbar(
                [x + 6 * i for x in xs], ys, yerr=err, fmt=styles[i % 4], capsize=4, label=f"recapture_every {arm}"
            )
        steps = [r for r in rows if r.get("kind") == "step" and r["arm"] == arm]
        if steps:
            k = 8
            smooth = [
                sum(r["reward"] for r in steps[max(0, j - k + 1) : j + 1]) / len(steps[max(0, j - k + 1) : j + 1])
                for j in range(len(steps))
            ]
            axes[1].plot([r["cpu_s"] for r in steps], smooth, styles[i % 4][1:] or "-", label=f"recapture_every {arm}")
    n = setup.get("eval_docs", 0) * setup.get("Q", 0)
    axes[0].set_ylabel(f"held-out greedy accuracy ({n} questions, Wilson 95 %)")
    axes[0].set_ylim(0, 1)
    axes[1].set_ylabel("sampled reward, mean of the last 8 steps")
    for ax in axes:
        ax.set_xlabel(f"training CPU seconds ({setup.get('threads', '?')} thread)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"SmolLM2-135M-Instruct, {setup.get('Q', '?')} questions per ~{setup.get('length', 0):,}-token document "
        f"per step, G = {setup.get('G', '?')}: equal CPU time"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
