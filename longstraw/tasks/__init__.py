"""Built-in long-context tasks, user data files, rewards and the task tokenizer."""

from .base import REWARD_FUNCTIONS, Example, exact_match, fraction_correct
from .jsonl import load_jsonl
from .synthetic import TASKS, Aggregation, KVRetrieval, MultiKVRetrieval
from .tokenizer import build_tokenizer

__all__ = [
    "REWARD_FUNCTIONS",
    "TASKS",
    "Aggregation",
    "Example",
    "KVRetrieval",
    "MultiKVRetrieval",
    "build_tokenizer",
    "exact_match",
    "fraction_correct",
    "load_jsonl",
]
