"""Where a run's examples come from: a built-in task, or JSONL rows (training and held-out apart)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from ..tasks import TASKS, Example, load_jsonl
from ..tasks.synthetic import SyntheticTask


@dataclass
class Data:
    """A built-in task (examples made from (seed, index, length); evaluation draws its own indices) or JSONL
    rows, training and held-out (`eval_rows`) apart."""

    task: SyntheticTask | None
    rows: list[Example] | None
    seed: int
    eval_rows: list[Example] | None = None

    def example(self, index: int, length: int, sft: bool = False) -> Example:
        if self.rows is not None:
            return self.rows[index % len(self.rows)]
        assert self.task is not None  # a built-in task where there are no rows
        ex = self.task.sft_example(self.seed, index, length) if sft else self.task.example(self.seed, index, length)
        return replace(ex, source=f"{type(self.task).__name__} example {index} (seed {self.seed}, length {length})")


def split_rows(rows: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(training rows, held-out rows): ceil(fraction · n) rows chosen by `seed`, the rest in their file order."""
    if fraction == 0:
        return rows, rows
    n_eval = math.ceil(fraction * len(rows))
    if n_eval >= len(rows):
        raise ValueError(
            f"the dataset has {len(rows)} row(s): too few to hold out eval_fraction={fraction}; "
            "give an eval_dataset or set eval_fraction: 0"
        )
    held = set(random.Random(seed).sample(range(len(rows)), n_eval))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def build_data(cfg, tokenizer=None) -> Data:
    """The run's data; JSONL rows are parsed (and chats formatted with `tokenizer`) here, before any step."""
    if cfg.dataset is not None:
        rows = load_jsonl(cfg.dataset, tokenizer)
        if cfg.eval_dataset is not None:
            return Data(None, rows, cfg.seed, load_jsonl(cfg.eval_dataset, tokenizer))
        train, held = split_rows(rows, cfg.eval_fraction, cfg.seed)
        return Data(None, train, cfg.seed, held)
    task = TASKS[cfg.task](**cfg.task_options)
    for length in [cfg.prompt_length, *cfg.curriculum, *cfg.eval_lengths]:
        if int(length) < task.min_length():
            raise ValueError(f"prompt length {length} is shorter than {cfg.task} needs ({task.min_length()} tokens)")
    return Data(task, None, cfg.seed)
