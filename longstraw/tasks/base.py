"""Examples, tasks and their verifiable rewards.

A task makes `Example(prompt, answer, length)` items from a seed: the same (seed, index) always gives
the same example, so a resumed run sees exactly the data it would have seen. Rewards follow TRL's
signature `(prompts, completions, **kwargs) -> list[float]`, with the dataset's `answer` column in
kwargs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """A prompt and its answer. `supervised`: prompt token positions that a supervised warm-up also
    trains on (each predicted from the position before it), e.g. rehearsed answers inside the prompt."""

    prompt: str
    answer: str
    supervised: tuple[int, ...] = ()


def _words(text: str) -> list[str]:
    return text.replace("[EOS]", " ").split()


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


REWARD_FUNCTIONS = {"exact_match": exact_match, "fraction_correct": fraction_correct}


def rng_for(seed: int, index: int) -> random.Random:
    """The generator of example `index` under `seed` (independent of any other draw)."""
    return random.Random(seed * 1_000_003 + index)
