"""One full GRPO training step (generation included): TRL's GRPOTrainer vs longstraw's trainer.

Same tiny models as bench/memory_step.py (dense qwen3 and hybrid qwen3_next-like, the task
tokenizer's vocabulary), LoRA r=8 on all linear layers, one prompt of P tokens per step,
G responses of exactly R tokens (TRL: `min_new_tokens=R`; longstraw: `ignore_eos`), one torch
thread. Each configuration runs in a fresh process for two optimizer steps; the second is measured
(the first pays one-time initialisation): step memory = peak RSS during that step − RSS before it,
reset through /proc/self/clear_refs. TRL is a benchmark dependency only (`pip install trl==1.16.0`).

    python bench/trl_compare.py        # → bench/results/trl_compare.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import finish, memory_time_figure, record

ARCH = {"dense": "qwen3", "hybrid": "qwen3_next"}


def _model_overrides(name: str) -> dict:
    from longstraw.testing.models import BENCH_DENSE, BENCH_HYBRID

    fields = dict(BENCH_DENSE if name == "dense" else BENCH_HYBRID)
    fields.pop("vocab_size")
    return fields


def _config(name: str, P: int, G: int, R: int, out: str):
    from longstraw.train.config import TrainConfig

    return TrainConfig(model=ARCH[name], model_overrides=_model_overrides(name), lora=True, lora_r=8, lora_alpha=16,
                       train_embeddings=False, task="kv_retrieval", task_options={"num_pairs": 16, "num_values": 16},
                       prompt_length=P, num_steps=2, prompts_per_step=1, num_generations=G, max_completion_length=R,
                       ignore_eos=True, loss_type="dapo", beta=0.0, chunk_size=4096, output_dir=out, progress=False,
                       threads=1, eval_examples=1, save_every=100)


def run_longstraw(name, P, G, R) -> dict:
    from longstraw.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(_config(name, P, G, R, d))
        rows = trainer.train()
    m = rows[-1]
    return dict(step_mem_mb=m["step_mem_mb"], wall_s=round(m["time_step"], 3), durable_mb=round(m["durable_bytes"] / 2**20, 2))


def run_trl(name, P, G, R) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from longstraw.train.memory import peak_rss_mb, reset_peak, rss_mb
    from longstraw.train.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        cfg = _config(name, P, G, R, d)
        ls = Trainer(cfg)  # the same model and tokenizer as longstraw's run (adapter added by TRL instead)
        base = ls.model.get_base_model() if hasattr(ls.model, "get_base_model") else ls.model
        base = ls.model.unload() if hasattr(ls.model, "unload") else base
        tok = ls.tok
        tok.padding_side = "left"
        prompt = ls.data.example(0, P).prompt
        data = Dataset.from_list([{"prompt": prompt}] * 4)

        def reward(prompts, completions, **kw):
            return [float(len(c)) for c in completions]

        marks = {}

        class Measure(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == 1:
                    marks["before"] = rss_mb()
                    reset_peak()
                    marks["t0"] = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                if state.global_step == 2:
                    marks["wall"] = time.perf_counter() - marks["t0"]
                    marks["peak"] = peak_rss_mb()

        args = GRPOConfig(output_dir=d, max_steps=2, per_device_train_batch_size=G, num_generations=G,
                          max_completion_length=R, generation_kwargs={"min_new_tokens": R}, learning_rate=1e-4,
                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                          loss_type="dapo", beta=0.0, temperature=1.0, disable_tqdm=True, seed=0)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
        trainer = GRPOTrainer(model=base, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                              peft_config=lora, callbacks=[Measure()])
        trainer.train()
    return dict(step_mem_mb=round(marks["peak"] - marks["before"], 1), wall_s=round(marks["wall"], 3))


def worker(method, name, P, G, R) -> dict:
    import torch

    torch.set_num_threads(1)
    fn = run_trl if method == "trl" else run_longstraw
    row = dict(model=name, method=method, P=P, G=G, R=R, threads=1)
    row.update(fn(name, P, G, R))
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=5, metavar=("METHOD", "MODEL", "P", "G", "R"), help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["dense", "hybrid"])
    ap.add_argument("--P", nargs="+", type=int, default=[2048, 8192, 16384])
    ap.add_argument("--G", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--R", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trl_compare"))
    args = ap.parse_args(argv)
    if args.worker:
        m, name, P, G, R = args.worker
        print(json.dumps(worker(m, name, int(P), int(G), int(R))))
        return
    from longstraw.tools.compare import format_table

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        for P in args.P:
            for G in args.G:
                for method in ("trl", "longstraw"):
                    cmd = [sys.executable, __file__, "--worker", method, name, str(P), str(G), str(args.R)]
                    res = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                    if res.returncode != 0:
                        row = dict(model=name, method=method, P=P, G=G, R=args.R, error=res.stderr.strip()[-1500:])
                    else:
                        row = json.loads(res.stdout.strip().splitlines()[-1])
                    record(rows, row, out)
    finish(rows, out, _plot, format_table)


def _plot(rows, path: Path) -> None:
    series = [(f"{name} {method} G={G}", style + marker,
               [(r["P"], r["step_mem_mb"], r["wall_s"]) for r in rows if r["model"] == name
                and r["method"] == method and r["G"] == G and "step_mem_mb" in r])
              for name, style in (("dense", "-"), ("hybrid", "--"))
              for method, marker in (("trl", "s"), ("longstraw", "^"))
              for G in sorted({r["G"] for r in rows})]
    memory_time_figure(series, "prompt length P (tokens)", ("step memory (MiB)", "step time (s)"),
                       "one GRPO step with generation: TRL GRPOTrainer vs longstraw (R=32, LoRA, 1 thread)", path,
                       legend_size=7)


if __name__ == "__main__":
    main()
