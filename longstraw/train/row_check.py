"""Every dataset row checked before step 1, and what the start of a run prints about its rows.

A bad row found only when a step draws it costs the steps before it (and a rerun stops at the same row). So when a
run starts, every row (training and held-out) is tokenized once (through the token cache, when the run has one) and
checked:

- its prompt + `max_completion_length` fit the model's positions (`max_position_embeddings`, which a configured RoPE
  scaling sets: `longstraw.model.positions`); with a rollout hook or an environment, whose trajectories stop at the
  positions, the prompt leaves at least one position;
- it has every column its reward functions cannot run without: a keyword of the function's signature with no
  default, other than TRL's `prompts`, `completions`, `completion_ids` (a keyword with a default, or one read from
  `**kwargs`, is read where present and cannot be checked). A keyword no row has refuses the function itself. With
  a rollout hook the columns come from the hook too, and only exist when it runs: not checked;
- its prompt has tokens (an empty chat `content` is refused where the rows are read,
  `longstraw.tasks.jsonl.parse_row`);
- at most half of its prompt's tokens are the tokenizer's unknown token (`unk_token_id`): a tokenizer that does not
  cover the text (the built-in tiny tokenizer's vocabulary is the toy task's, and turns English into `[UNK]`) trains
  on prompts it cannot read.

The first failure stops the run naming the file and row (`data.jsonl:7`, `train_dataset row 6`); with
`drop_invalid_rows: true` each failing row is dropped and named, and the count reported. Memory: one row's ids at a
time, plus one int per row.
"""

from __future__ import annotations

import difflib
import inspect
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..tasks import Example

#: the keywords a reward function gets whatever the rows hold (`longstraw.train.rewards.RewardSet.score`)
GIVEN = frozenset({"prompts", "completions", "completion_ids"})

_FIX = "fix or remove the row, or set drop_invalid_rows: true to drop such rows"


def required_columns(fn: Callable) -> list[str]:
    """The keywords `fn` cannot be called without, other than TRL's given ones (`GIVEN`): its parameters with no
    default (none when the signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in GIVEN]


@dataclass(frozen=True)
class RowRules:
    """What every row must satisfy. `limit`: the model's positions (None: unbounded); `completion`: the positions a
    response may add after the prompt; `rewards`: (name, function) of the run's reward functions, None when their
    columns cannot be known before a step (a rollout hook adds its own); `unk`: the tokenizer's unknown token id
    (None: it has none)."""

    limit: int | None
    completion: int
    rewards: list[tuple[str, Callable]] | None
    drop: bool = False
    unk: int | None = None


@dataclass
class RowReport:
    """What the check found: the kept rows' prompt token counts, how many share their first `prefix` tokens with
    another kept row, and each dropped row's reason."""

    lengths: list[int]
    shared: int
    prefix: int
    dropped: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        n = len(self.lengths)
        head = (
            f"data: {n} rows; prompt tokens min {min(self.lengths)} / median {statistics.median(self.lengths):g} / "
            f"max {max(self.lengths)}; {self.shared} rows share their first {self.prefix} tokens with another row"
        )
        if not self.dropped:
            return [head]
        total = n + len(self.dropped)
        return [head, f"dropped {len(self.dropped)} of {total} rows (drop_invalid_rows):", *self.dropped]


def refuse_unread_columns(rows: Sequence[Example], rewards: list[tuple[str, Callable]]) -> None:
    """Refuse a reward function that reads a column no row has (whatever drop_invalid_rows says: it would drop every
    row)."""
    present = set().union(*(ex.reward_columns() for ex in rows)) if rows else set()
    for name, fn in rewards:
        for col in required_columns(fn):
            if col not in present:
                near = difflib.get_close_matches(col, sorted(present), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(
                    f"reward function {name!r} reads the column {col!r}, which no row has{hint}; the rows' columns: "
                    f"{sorted(present)}: rename the column or the function's keyword, or give it a default"
                )


def row_problem(ex: Example, ids: torch.Tensor, rules: RowRules) -> str | None:
    """Why row `ex` (its prompt's ids `[P]`) cannot train, or None."""
    where = ex.source or "a row"
    p = ids.numel()
    if p == 0:
        return f"{where}: the prompt encodes to no tokens; {_FIX}"
    if rules.limit is not None and p + rules.completion > rules.limit:
        return (
            f"{where}: prompt of {p} tokens + max_completion_length {rules.completion} = {p + rules.completion} "
            f"positions, past the model's max_position_embeddings={rules.limit}; shorten the row, lower "
            f"max_completion_length, set RoPE scaling (model_overrides), or set drop_invalid_rows: true"
        )
    unknown = int((ids == rules.unk).sum()) if rules.unk is not None else 0
    if 2 * unknown > p:
        return (
            f"{where}: {unknown} of the prompt's {p} tokens are the tokenizer's unknown token (id {rules.unk}): the "
            "tokenizer does not cover this text; use a tokenizer made for it (the model's own: processing_class, or "
            "the model folder's), or set drop_invalid_rows: true"
        )
    if rules.rewards is not None:
        columns = ex.reward_columns()
        for name, fn in rules.rewards:
            for col in required_columns(fn):
                if col not in columns:
                    return (
                        f"{where}: reward function {name!r} reads the column {col!r}, which this row does not have; "
                        + _FIX
                    )
    return None


def shared_prefix_rows(prefixes: Sequence[tuple[int, ...] | None]) -> int:
    """How many rows share their first k tokens with another row (`prefixes`: each row's first k ids, None for a
    row shorter than k)."""
    counts = Counter(p for p in prefixes if p is not None)
    return sum(c for c in counts.values() if c > 1)


def check_rows(
    rows: list[Example],
    eval_rows: list[Example] | None,
    encode: Callable[[str], torch.Tensor],
    rules: RowRules,
    prefix: int,
) -> tuple[list[Example], list[Example] | None, RowReport]:
    """(kept training rows, kept held-out rows, report) of the module doc's check; ValueError on the first failing
    row unless `rules.drop`. `encode`: a prompt's ids `[P]`; `prefix`: the shared-prefix length reported."""
    if rules.rewards is not None:
        refuse_unread_columns(rows, rules.rewards)
    distinct = list({id(ex): ex for ex in [*rows, *(eval_rows or [])]}.values())
    bad: set[int] = set()
    dropped: list[str] = []
    lengths: dict[int, int] = {}
    prefixes: dict[int, tuple[int, ...] | None] = {}
    for ex in distinct:
        ids = encode(ex.prompt) if ex.prompt else torch.zeros(0, dtype=torch.long)
        problem = row_problem(ex, ids, rules)
        if problem is not None:
            if not rules.drop:
                raise ValueError(problem)
            bad.add(id(ex))
            dropped.append(problem.replace(f"; {_FIX}", "").replace(", or set drop_invalid_rows: true", ""))
            continue
        lengths[id(ex)] = ids.numel()
        prefixes[id(ex)] = tuple(ids[:prefix].tolist()) if ids.numel() >= prefix else None
    kept = [ex for ex in rows if id(ex) not in bad]
    held = None if eval_rows is None else [ex for ex in eval_rows if id(ex) not in bad]
    if not kept:
        raise ValueError(f"every training row was dropped (the first: {dropped[0]}): fix the rows")
    if held is not None and not held:
        raise ValueError(f"every held-out row was dropped (the first: {dropped[0]}): fix the rows")
    ids_kept = list(prefixes)
    report = RowReport([lengths[i] for i in ids_kept], shared_prefix_rows([prefixes[i] for i in ids_kept]), prefix)
    report.dropped = dropped
    return kept, held, report
