"""Which rows of a step share a prompt prefix, so that it is captured once (`Context`).

Long-context data asks many questions of one document: rows `document + question_1`, `document + question_2`, ...
A step's rows are grouped into contexts, each captured once up to the longest token prefix its rows share; a row's own
remainder (its suffix: the question, and whatever the chat template writes after it) is read on top of that state
when sampling (`prefix_ids`) and when replaying (`PromptState.replay(..., prefix_ids=...)`).

Two ways rows come together:
- a `context` column (`Example.columns["context"]`, any hashable value naming the document): rows with equal values
  form one context, wherever they are in the step; they must share at least one token;
- otherwise consecutive rows whose common token prefix is at least `min_shared` tokens, each row's remainder at most
  `max_suffix` tokens (a remainder runs once per response in the replay: a long one is cheaper captured whole).

A row alone is a context of its whole prompt (suffix empty), as without sharing. Work: O(rows · P) token comparisons.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Context:
    """Rows `rows` of a step (indices into its examples, in step order) whose prompts all begin with the same
    `length` tokens: captured once, as `prompt_ids[:length]` of any of them."""

    length: int
    rows: tuple[int, ...]


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading tokens `a` `[A]` and `b` `[B]` have in common."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def shared_contexts(
    prompts: Sequence[torch.Tensor],
    keys: Sequence[Hashable | None] | None = None,
    min_shared: int = 1,
    max_suffix: int | None = None,
) -> list[Context]:
    """The contexts of a step's prompts `[P_b]` (see the module doc), in the order of their first rows.

    `keys[b]`: row b's `context` value (None: the row has none). Rows with a key group by key; rows without one
    group with their neighbours by shared length (`min_shared` ≥ 1 tokens, remainders ≤ `max_suffix`, None: any).
    """
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1; got {min_shared}")
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(f"{len(keys)} context keys for {len(prompts)} prompts")
    groups: list[list[int]] = []
    lengths: list[int] = []
    by_key: dict[Hashable, int] = {}
    open_group: int | None = None  # the last group of rows without a key, which the next such row may join
    for b, p in enumerate(prompts):
        key = None if keys is None else keys[b]
        if key is not None:
            g = by_key.get(key)
            if g is None:
                by_key[key] = len(groups)
                groups.append([b])
                lengths.append(p.numel())
            else:
                shared = common_prefix_length(prompts[groups[g][0]][: lengths[g]], p)
                if shared == 0:
                    raise ValueError(
                        f"rows {groups[g][0]} and {b} name the same context {_short(key)} but their prompts share no "
                        "token: put the shared document first (a per-row system line or question before it defeats "
                        "sharing)"
                    )
                groups[g].append(b)
                lengths[g] = shared
            open_group = None
            continue
        if open_group is not None:
            g = open_group
            shared = common_prefix_length(prompts[groups[g][0]][: lengths[g]], p)
            rows = [*groups[g], b]
            if shared >= min_shared and (
                max_suffix is None or all(prompts[r].numel() - shared <= max_suffix for r in rows)
            ):
                groups[g].append(b)
                lengths[g] = shared
                continue
        open_group = len(groups)
        groups.append([b])
        lengths.append(p.numel())
    return [Context(n, tuple(rows)) for n, rows in zip(lengths, groups)]


def shared_fraction(prompts: Sequence[torch.Tensor], contexts: Sequence[Context]) -> float:
    """The fraction of the step's prompt tokens not captured, thanks to sharing: 1 − (Σ contexts' lengths + Σ rows'
    suffixes) / Σ prompt lengths (0 without sharing; 1 − 1/Q for Q rows of one document and short questions)."""
    total = sum(p.numel() for p in prompts)
    read = sum(c.length for c in contexts) + sum(prompts[b].numel() - c.length for c in contexts for b in c.rows)
    return 1.0 - read / max(total, 1)


def _short(key) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:57] + "..."
