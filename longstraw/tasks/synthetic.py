"""Built-in long-context tasks with verifiable answers, at a configurable prompt length.

- `kv_retrieval`: K key/value pairs scattered in filler text; "? k" asks one key's value (the
  answer follows the key, as it does in the pairs: the pattern an induction head completes).
- `multi_kv_retrieval`: the same, asking Q keys at once ("? k_a k_b ="), answer their Q values.
- `aggregation`: count how many pairs hold a given value ("count v ="): needs the whole context.

`length` is the prompt length in tokens (the tokenizer is word-level); filler words are spread
between the pairs to reach it. Baselines a model gets without real retrieval: context-blind 1/V for
V values, positional shortcut (always copy the value at one place) 1/K.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Example, rng_for


@dataclass(frozen=True)
class SyntheticTask:
    """Common shape of the synthetic tasks."""

    num_pairs: int = 16
    num_keys: int = 64
    num_values: int = 16
    num_filler: int = 32
    reward: str = "exact_match"

    def __post_init__(self):
        if not 1 <= self.num_pairs <= self.num_keys:
            raise ValueError(f"num_pairs must be in [1, num_keys={self.num_keys}]; got {self.num_pairs}")
        if self.num_values < 2:
            raise ValueError("num_values must be >= 2")

    def min_length(self) -> int:
        """Shortest prompt: the pairs and the question, no filler."""
        return 2 * self.num_pairs + 2

    def answer_words(self) -> list[str]:
        """Words an answer can use (for sampling restricted to answer tokens)."""
        return [f"v{i}" for i in range(self.num_values)]

    def max_answer_words(self) -> int:
        return 1

    def _layout(self, rng, pairs: list[tuple[str, str]], question: list[str], length: int) -> str:
        """Pairs in order with filler words spread between them to reach `length` tokens."""
        body = 2 * len(pairs) + len(question)
        if length < body:
            raise ValueError(f"length {length} is shorter than the {body} tokens this task needs")
        filler = length - body
        cuts = sorted(rng.randint(0, filler) for _ in range(len(pairs)))
        gaps = [b - a for a, b in zip([0] + cuts, cuts + [filler])]
        words: list[str] = []
        for (k, v), gap in zip(pairs, gaps):
            words += [f"f{rng.randrange(self.num_filler)}" for _ in range(gap)] + [k, v]
        words += [f"f{rng.randrange(self.num_filler)}" for _ in range(gaps[-1])]
        return " ".join(words + question)

    def _pairs(self, rng):
        keys = rng.sample(range(self.num_keys), self.num_pairs)
        return [(f"k{k}", f"v{rng.randrange(self.num_values)}") for k in keys]

    def example(self, seed: int, index: int, length: int) -> Example:
        raise NotImplementedError(f"{type(self).__name__} must define example()")

    def document_example(self, seed: int, document: int, question: int, length: int) -> Example:
        """Question `question` of document `document` (`rows_per_context`): every question of a document reads the
        same text, all but its last words (the question), so the rows share it token for token; each asks about
        other pairs (the pairs in a seeded order per document, cycling after `num_pairs`)."""
        rng = rng_for(seed, document)
        pairs = self._pairs(rng)
        order = random.Random(f"{seed}:{document}:questions").sample(range(len(pairs)), len(pairs))
        words, answer = self._question(pairs, lambda j: pairs[order[j % len(order)]], question)
        return Example(self._layout(rng, pairs, words, length), answer)

    def _question(self, pairs, pick, question: int) -> tuple[list[str], str]:
        """The words of question `question` of a document and its answer; `pick(j)`: the document's j-th pair in its
        question order. The words' count may not depend on `question` (the document's layout does not)."""
        raise NotImplementedError(f"{type(self).__name__} does not ask several questions of one document")

    def sft_example(self, seed: int, index: int, length: int) -> Example:
        """The example a supervised warm-up trains on (by default the same as `example`)."""
        return self.example(seed, index, length)


@dataclass(frozen=True)
class KVRetrieval(SyntheticTask):
    def example(self, seed: int, index: int, length: int) -> Example:
        rng = rng_for(seed, index)
        pairs = self._pairs(rng)
        k, v = pairs[rng.randrange(len(pairs))]
        return Example(self._layout(rng, pairs, ["?", k], length), v)

    def _question(self, pairs, pick, question: int) -> tuple[list[str], str]:
        k, v = pick(question)
        return ["?", k], v

    def sft_example(self, seed: int, index: int, length: int) -> Example:
        """Every pair rehearsed once in random order ("? k v" each) before the final "? k": K
        supervised answers per prompt instead of one, the same lookup each time."""
        rng = rng_for(seed, index)
        pairs = self._pairs(rng)
        order = rng.sample(pairs, len(pairs))
        rehearsal = [w for k, v in order for w in ("?", k, v)]
        k, v = pairs[rng.randrange(len(pairs))]
        body = self._layout(rng, pairs, [], max(length - len(rehearsal) - 2, 2 * len(pairs))).split()
        words = body + rehearsal + ["?", k]
        supervised = tuple(len(body) + 3 * i + 2 for i in range(len(order)))
        return Example(" ".join(words), v, supervised)


@dataclass(frozen=True)
class MultiKVRetrieval(SyntheticTask):
    num_queries: int = 2
    reward: str = "fraction_correct"

    def max_answer_words(self) -> int:
        return self.num_queries

    def min_length(self) -> int:
        return 2 * self.num_pairs + self.num_queries + 2

    def example(self, seed: int, index: int, length: int) -> Example:
        if self.num_queries > self.num_pairs:
            raise ValueError("num_queries must be <= num_pairs")
        rng = rng_for(seed, index)
        pairs = self._pairs(rng)
        asked = rng.sample(pairs, self.num_queries)
        question = ["?", *[k for k, _ in asked], "="]
        return Example(self._layout(rng, pairs, question, length), " ".join(v for _, v in asked))

    def _question(self, pairs, pick, question: int) -> tuple[list[str], str]:
        if self.num_queries > self.num_pairs:
            raise ValueError("num_queries must be <= num_pairs")
        asked = [pick(question * self.num_queries + j) for j in range(self.num_queries)]
        return ["?", *[k for k, _ in asked], "="], " ".join(v for _, v in asked)


@dataclass(frozen=True)
class Aggregation(SyntheticTask):
    """How many pairs hold value v? The answer is the count in decimal digits, one token each."""

    def answer_words(self) -> list[str]:
        return [str(d) for d in range(10)]

    def max_answer_words(self) -> int:
        return len(str(self.num_pairs))

    def min_length(self) -> int:
        return 2 * self.num_pairs + 3

    def example(self, seed: int, index: int, length: int) -> Example:
        rng = rng_for(seed, index)
        pairs = self._pairs(rng)
        v = pairs[rng.randrange(len(pairs))][1]
        count = sum(val == v for _, val in pairs)
        return Example(self._layout(rng, pairs, ["count", v, "="], length), " ".join(str(count)))

    def _question(self, pairs, pick, question: int) -> tuple[list[str], str]:
        v = pick(question)[1]
        return ["count", v, "="], " ".join(str(sum(val == v for _, val in pairs)))


TASKS = {"kv_retrieval": KVRetrieval, "multi_kv_retrieval": MultiKVRetrieval, "aggregation": Aggregation}
