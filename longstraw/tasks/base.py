"""Examples, tasks and their verifiable rewards.

A task makes `Example(prompt, answer, length)` items from a seed: the same (seed, index) always gives
the same example, so a resumed run sees exactly the data it would have seen. Rewards follow TRL's
signature `(prompts, completions, **kwargs) -> list[float]`, with the dataset's other columns (the
built-in tasks' `answer`) as keyword lists.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """A prompt and its answer.

    prompt: the text the model reads (for chat rows, the chat template's output, generation prompt added);
    answer: the reference answer (built-in tasks, supervised warm-up), None when the data has none;
    supervised: prompt token positions that a supervised warm-up also trains on (each predicted from the
    position before it), e.g. rehearsed answers inside the prompt;
    messages: the chat of a `messages` row (reward functions get it as the prompt, as TRL passes
    conversational prompts), None for text prompts;
    columns: every other field of the data row, handed to reward functions as keyword lists;
    source: where the row comes from, for error messages ("data.jsonl:7").
    """

    prompt: str
    answer: str | None
    supervised: tuple[int, ...] = ()
    messages: list | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def reward_columns(self) -> dict[str, Any]:
        """The keyword columns reward functions receive for this row (`answer` included when set)."""
        return self.columns if self.answer is None else {"answer": self.answer, **self.columns}


def _text(completion) -> str:
    """A completion as text: a string, or a conversational completion [{"role": ..., "content": ...}]."""
    if isinstance(completion, list):
        return " ".join(str(m.get("content", "")) for m in completion)
    return completion


def _words(text) -> list[str]:
    return _text(text).replace("[EOS]", " ").split()


def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's words (stop token aside) are exactly the answer's, else 0.0."""
    return [float(_words(c) == _words(a)) for c, a in zip(completions, answer)]


def fraction_correct(prompts, completions, answer, **kwargs) -> list[float]:
    """Fraction of answer words matched position by position (multi-key retrieval)."""
    out = []
    for c, a in zip(completions, answer):
        cw, aw = _words(c), _words(a)
        out.append(sum(x == y for x, y in zip(cw, aw)) / max(len(aw), 1) if len(cw) <= len(aw) else 0.0)
    return out


def contains_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's first line holds the answer as a whole word (a code in a sentence), else 0.0."""
    out = []
    for c, a in zip(completions, answer):
        text = c if isinstance(c, str) else c[0]["content"]
        first = text.strip().split("\n")[0]
        out.append(float(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", first) is not None))
    return out


def environment_reward(prompts, completions, environment_reward=None, **kwargs) -> list[float | None]:
    """The environment's own score of each trajectory (`env.get_reward()`, a multi-turn rollout's `environment_reward`
    column); abstains (None) where the rollout has none."""
    if environment_reward is None:
        return [None] * len(completions)
    return [None if r is None else float(r) for r in environment_reward]


REWARD_FUNCTIONS: dict[str, Callable] = {
    "exact_match": exact_match,
    "fraction_correct": fraction_correct,
    "contains_answer": contains_answer,
    "environment_reward": environment_reward,
}


def rng_for(seed: int, index: int) -> random.Random:
    """The generator of example `index` under `seed` (independent of any other draw)."""
    return random.Random(seed * 1_000_003 + index)
