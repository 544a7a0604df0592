"""One GRPO step on the real model, side by side: TRL 1.16's GRPOTrainer and longstraw's trainer.

    python bench/real_trl_compare.py          # → bench/results/real_trl_compare.{json,md,png}

SmolLM2-135M-Instruct (`longstraw real smollm2`), fp32, 2 threads, the same data (one long-document row of
`longstraw.tasks.documents`, ~P tokens in the chat template), the same reward (`contains_answer`) and the same
LoRA (r 16, alpha 32, every linear layer), G responses of exactly R tokens (TRL: `min_new_tokens=R`; longstraw:
`ignore_eos`). Each (method, P, G) runs in a fresh process for two optimizer steps and the second is measured (the
first pays one-time initialisation): step memory = peak RSS during that step − RSS before it, wall time of the
step. A TRL process is capped at `--limit-gb` of address space (this machine has 24 GB and no swap): a step that
needs more is reported as out of memory, with how long it ran. TRL is a benchmark dependency only
(`pip install trl==1.16.0`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import finish, memory_time_figure, record  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "real_trl_compare"


def _data(tok, P: int, d: str) -> Path:
    from longstraw.tasks.documents import write_document_task

    return write_document_task(tok, Path(d) / "data", [P], 4, 1)["train"]


def _measure(marks: dict, begin: bool) -> None:
    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb

    if begin:
        marks["before"] = rss_mb()
        reset_peak()
        marks["t0"] = time.perf_counter()
    else:
        marks["wall"] = time.perf_counter() - marks["t0"]
        marks["peak"] = peak_rss_mb()


def run_longstraw(P: int, G: int, R: int, threads: int) -> dict:
    from transformers import AutoTokenizer

    from longstraw.train.config import TrainConfig
    from longstraw.tools.real_models import model_path
    from longstraw.train.trainer import Trainer

    path = model_path("smollm2")
    with tempfile.TemporaryDirectory() as d:
        data = _data(AutoTokenizer.from_pretrained(path), P, d)
        cfg = TrainConfig(model=str(path), dataset=str(data), eval_fraction=0.0, reward_funcs=["contains_answer"],
                          lora=True, lora_r=16, lora_alpha=32, lora_target_modules="all-linear", num_generations=G,
                          prompts_per_step=1, num_steps=2, max_completion_length=R, ignore_eos=True,
                          loss_type="dapo", beta=0.0, learning_rate=1e-4, dtype="fp32", threads=threads,
                          output_dir=str(Path(d) / "run"), progress=False, eval_examples=1, save_every=100,
                          log_completions=False)
        rows = Trainer(cfg).train()
    m = rows[-1]
    return dict(step_mem_mb=m["step_mem_mb"], wall_s=round(m["time_step"], 2), prompt_tokens=m["prompt_length"])


def run_trl(P: int, G: int, R: int, threads: int) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from longstraw.tools.real_models import model_path
    from longstraw.tasks.base import contains_answer

    path = model_path("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    marks: dict = {}
    with tempfile.TemporaryDirectory() as d:
        rows = [json.loads(line) for line in _data(tok, P, d).read_text().splitlines()]
        data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])

        class Measure(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                _measure(marks, True)

            def on_step_end(self, args, state, control, **kw):
                _measure(marks, False)
                if state.global_step == 1:  # printed at once: a run cut off in its second step keeps its first
                    first = dict(step_mem_mb=round(marks["peak"] - marks["before"], 1), wall_s=round(marks["wall"], 2))
                    print("FIRST " + json.dumps(first), flush=True)

        args = GRPOConfig(output_dir=d, max_steps=2, per_device_train_batch_size=G, num_generations=G,
                          max_completion_length=R, generation_kwargs={"min_new_tokens": R}, learning_rate=1e-4,
                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                          loss_type="dapo", beta=0.0, temperature=1.0, disable_tqdm=True, seed=0)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
        GRPOTrainer(model=model, reward_funcs=contains_answer, args=args, train_dataset=data, processing_class=tok,
                    peft_config=lora, callbacks=[Measure()]).train()
    return dict(step_mem_mb=round(marks["peak"] - marks["before"], 1), wall_s=round(marks["wall"], 2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=4, metavar=("METHOD", "P", "G", "R"), help=argparse.SUPPRESS)
    ap.add_argument("--P", nargs="+", type=int, default=[2048, 6144])
    ap.add_argument("--G", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--R", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-gb", type=float, default=20.0)
    ap.add_argument("--out", default=str(RESULTS), help="results path without suffix")
    ap.add_argument("--methods", nargs="+", default=["longstraw", "trl"], choices=["longstraw", "trl"])
    ap.add_argument("--keep", action="store_true", help="keep OUT.json's rows of other (method, P, G) and add these")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="a run still going after this is reported so")
    args = ap.parse_args(argv)
    if args.worker:
        method, P, G, R = args.worker
        import torch

        torch.set_num_threads(args.threads)
        fn = run_trl if method == "trl" else run_longstraw
        row = dict(method=method, P=int(P), G=int(G), R=int(R), threads=args.threads)
        row.update(fn(int(P), int(G), int(R), args.threads))
        print(json.dumps(row))
        return
    rows: list[dict] = []
    out = Path(args.out)
    if args.keep and out.with_suffix(".json").exists():
        ran = {(m, P, G) for m in args.methods for P in args.P for G in args.G}
        rows = [r for r in json.loads(out.with_suffix(".json").read_text()) if (r["method"], r["P"], r["G"]) not in ran]
    limit = int(args.limit_gb * 2**30)

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    for P in args.P:
        for G in args.G:
            for method in args.methods:
                cmd = [sys.executable, __file__, "--threads", str(args.threads), "--worker", method, str(P), str(G),
                       str(args.R)]
                t0 = time.perf_counter()
                try:
                    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                         preexec_fn=cap if method == "trl" else None, timeout=args.timeout_s)
                except subprocess.TimeoutExpired as cut:
                    row = dict(method=method, P=P, G=G, R=args.R, threads=args.threads,
                               error=f"two steps not done in {args.timeout_s:.0f} s", ran_s=args.timeout_s)
                    text = cut.stdout.decode() if isinstance(cut.stdout, bytes) else cut.stdout or ""
                    first = [line[6:] for line in text.splitlines() if line.startswith("FIRST ")]
                    if first:  # the first step's figures (it includes one-time allocations: an upper bound)
                        row["first_step"] = json.loads(first[0])
                    record(rows, row, out)
                    continue
                if res.returncode == 0:
                    row = json.loads(res.stdout.strip().splitlines()[-1])
                else:
                    oom = "out of memory" in res.stderr or "Cannot allocate" in res.stderr or res.returncode < 0
                    row = dict(method=method, P=P, G=G, R=args.R, threads=args.threads,
                               error=("out of memory (> %.0f GB address space)" % args.limit_gb) if oom
                               else res.stderr.strip()[-800:], ran_s=round(time.perf_counter() - t0, 1))
                record(rows, row, out)
    finish(rows, out, _plot, _table)


def _table(rows: list[dict]) -> str:
    """One line per run; the prompt's token count is the longstraw run's (both read the same row)."""
    tokens = {r["P"]: r["prompt_tokens"] for r in rows if r["method"] == "longstraw" and "prompt_tokens" in r}
    lines = ["| P | prompt tokens | G | method | step memory (MiB) | step time (s) |", "|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        n = f"{tokens[r['P']]:,}" if r["P"] in tokens else ""
        if "error" in r and "first_step" in r:
            f = r["first_step"]
            lines.append(f"| {r['P']:,} | {n} | {r['G']} | {r['method']} | {f['step_mem_mb']:,.0f} (first step; "
                         f"{r['error']}) | {f['wall_s']:.1f} (first step) |")
        elif "error" in r:
            lines.append(f"| {r['P']:,} | {n} | {r['G']} | {r['method']} | {r['error']} (after {r['ran_s']} s) | |")
        else:
            lines.append(f"| {r['P']:,} | {n} | {r['G']} | {r['method']} | {r['step_mem_mb']:,.0f} | {r['wall_s']:.1f} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> None:
    series = [(f"{method} G={G}", style + marker, [(r["P"], r["step_mem_mb"], r["wall_s"]) for r in rows
                                                   if r["method"] == method and r["G"] == G and "error" not in r])
              for method, style in (("trl", "-"), ("longstraw", "--"))
              for G, marker in zip(sorted({r["G"] for r in rows}), "so^v")]
    memory_time_figure(series, "prompt length P (tokens)", ("step memory (MiB)", "step time (s)"),
                       "one GRPO step, SmolLM2-135M-Instruct, LoRA r16 (fp32, 2 threads)", path)


if __name__ == "__main__":
    main()
