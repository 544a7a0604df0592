"""TRL's GRPO quick start, with longstraw's import: the same script shape, a long document per prompt.

    python examples/trl_quickstart.py                  # SmolLM2-135M-Instruct (`longstraw real smollm2` first)
    python examples/trl_quickstart.py --model llama    # a built-in tiny model, seconds

TRL's quick start is

    from datasets import load_dataset
    from trl import GRPOTrainer
    from trl.rewards import accuracy_reward

    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
    trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=accuracy_reward, train_dataset=dataset)
    trainer.train()

Here the import is longstraw's, the model a local folder, and the rows questions about one long document each (TRL's
conversational `prompt` column); `longstraw={...}` holds what TRL has no name for.
"""

from __future__ import annotations

import argparse
import random


def rows_for(model: str, length: int, documents: int, questions: int) -> list[dict]:
    """`documents` × `questions` rows: a long document, then a question about it (the documents task's rows)."""
    if model == "llama":  # the tiny model's word-level task: key-value pairs to look up
        rng = random.Random(0)
        out = []
        for d in range(documents):
            pairs = {f"k{rng.randrange(64)}": f"v{rng.randrange(16)}" for _ in range(length // 2)}
            text = " ".join(f"{k} {v}" for k, v in pairs.items())
            for k in list(pairs)[:questions]:
                out.append({"prompt": f"{text} ? {k}", "answer": pairs[k], "context": f"doc {d}"})
        return out
    from transformers import AutoTokenizer

    from longstraw.tasks.documents import make_document_rows, paragraphs
    from longstraw.tools.real_models import model_path

    tok = AutoTokenizer.from_pretrained(model_path(model))
    out = []
    for d in range(documents):
        for row in make_document_rows(tok, paragraphs(), length, questions, random.Random(d), f"document {d}"):
            out.append({"prompt": row.pop("messages"), **row})  # TRL's conversational rows
    return out


def main(model: str = "smollm2", length: int = 2048, steps: int = 4, output_dir: str = "runs/trl_quickstart") -> list:
    from datasets import Dataset

    from longstraw import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer
    from longstraw.tasks.base import contains_answer, exact_match

    rows = rows_for(model, length, documents=2, questions=4)
    path = model
    if model != "llama":
        from longstraw.tools.real_models import model_path

        path = str(model_path(model))
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=exact_match if model == "llama" else contains_answer,
        args=GRPOConfig(
            output_dir=output_dir,
            learning_rate=1e-4 if model != "llama" else 3e-3,
            per_device_train_batch_size=16,  # 16 completions a step: 2 questions × G = 8
            num_generations=8,
            max_completion_length=16 if model != "llama" else 2,
            max_steps=steps,
            # rows of one document share its capture; 4 questions of a document span 2 steps
            longstraw={"share_prefixes": True, "rows_per_context": 2, "recapture_every": 2, "progress": False},
        ),
        train_dataset=Dataset.from_list(rows),
    )
    trainer.train()
    return trainer.state.log_history[:-1]  # each step's metrics (the last entry: the run's summary)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "llama"])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--output-dir", default="runs/trl_quickstart")
    a = ap.parse_args()
    for m in main(a.model, a.length, a.steps, a.output_dir):
        print(f"step {m['step']}: reward {m['reward']:.3f}, captures {m['state_captures']}, loss {m['loss']:.4f}")
