"""Where a run's examples come from: a built-in task, or a dataset's rows (JSONL, parquet, Arrow or a `datasets`
folder; training and held-out apart)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..tasks import TASKS, Example
from ..tasks.dataset_files import load_rows
from ..tasks.synthetic import SyntheticTask


@dataclass
class Data:
    """A built-in task (examples made from (seed, index, length); evaluation draws its own indices) or JSONL
    rows, training and held-out (`eval_rows`) apart."""

    task: SyntheticTask | None
    rows: list[Example] | None
    seed: int
    eval_rows: list[Example] | None = None
    #: `rows_per_context`: a built-in task's row i is question i mod Q of document i // Q (None: its own document)
    rows_per_context: int | None = None

    def example(self, index: int, length: int, sft: bool = False) -> Example:
        if self.rows is not None:
            return self.rows[index % len(self.rows)]
        assert self.task is not None  # a built-in task where there are no rows
        name = type(self.task).__name__
        q = self.rows_per_context
        if q is not None and not sft:
            doc, question = divmod(index, q)
            ex = self.task.document_example(self.seed, doc, question, length)
            return replace(ex, source=f"{name} document {doc}, question {question} (seed {self.seed}, length {length})")
        ex = self.task.sft_example(self.seed, index, length) if sft else self.task.example(self.seed, index, length)
        return replace(ex, source=f"{name} example {index} (seed {self.seed}, length {length})")


def rows_by_context(rows: list[Example], q: int) -> list[Example]:
    """`rows` reordered document by document (`rows_per_context: q`): the rows of each `context` value in blocks of
    `q`, a document's last block filled up with its first rows (so that every block of q consecutive rows is one
    document's), documents in the order they first appear; rows without a `context` are blocks of their own."""
    by_context: dict = {}
    for i, row in enumerate(rows):
        key = row.columns.get("context")
        key = ("row", i) if key is None else ("context", key if isinstance(key, str | int | float) else repr(key))
        by_context.setdefault(key, []).append(row)
    out: list[Example] = []
    for group in by_context.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        blocks = -(-len(group) // q)
        out.extend(group[j % len(group)] for j in range(blocks * q))
    return out


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


#: `check(rows, eval_rows, dropped)` → (rows, eval_rows): the rows that may train (`longstraw.train.row_check`);
#: `dropped` holds the reasons of rows dropped while they were read
RowCheck = Callable[[list[Example], list[Example] | None, list[str]], tuple[list[Example], list[Example] | None]]


def build_data(
    cfg,
    tokenizer=None,
    rows: list[Example] | None = None,
    eval_rows: list[Example] | None = None,
    check: RowCheck | None = None,
    dropped: list[str] | None = None,
) -> Data:
    """The run's data; a dataset's rows are parsed (and chats formatted with `tokenizer`) and `check`ed here, before
    any step. `rows`, `eval_rows`: examples parsed already (a `datasets.Dataset` handed to
    `longstraw.train.trl_shape`'s `GRPOTrainer`), instead of the config's `dataset`, `eval_dataset`; `dropped`: the
    reasons of the rows dropped while those were parsed (`drop_invalid_rows`)."""
    if rows is not None or cfg.dataset is not None:
        dropped = list(dropped or [])
        keep = dropped if cfg.drop_invalid_rows else None
        rows = rows if rows is not None else load_rows(cfg.dataset, tokenizer, keep)
        if eval_rows is None and cfg.eval_dataset is not None:
            eval_rows = load_rows(cfg.eval_dataset, tokenizer, keep)
        if check is not None:
            rows, eval_rows = check(rows, eval_rows, dropped)
        q = cfg.rows_per_context
        if eval_rows is not None:
            return Data(None, rows if q is None else rows_by_context(rows, q), cfg.seed, eval_rows)
        train, held = split_rows(rows, cfg.eval_fraction, cfg.seed)
        return Data(None, train if q is None else rows_by_context(train, q), cfg.seed, held)
    task = TASKS[cfg.task](**cfg.task_options)
    for length in [cfg.prompt_length, *cfg.curriculum, *cfg.eval_lengths]:
        if int(length) < task.min_length():
            raise ValueError(f"prompt length {length} is shorter than {cfg.task} needs ({task.min_length()} tokens)")
    if cfg.rows_per_context is not None:
        task.document_example(cfg.seed, 0, 0, max(cfg.prompt_length, task.min_length()))  # refuses tasks without it
    return Data(task, None, cfg.seed, rows_per_context=cfg.rows_per_context)
