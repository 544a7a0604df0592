"""Reward functions: found by name or import path, called with TRL's convention, checked per row.

A reward function has TRL's signature

    def my_reward(prompts, completions, completion_ids, **columns) -> list[float | None]

`prompts` are the rows' prompts (text, or the chat `messages` of a chat row), `completions` the decoded
responses (text, or `[{"role": "assistant", "content": ...}]` for chat rows, as TRL passes them),
`completion_ids` their token ids, and every other data column (`answer`, ...) comes as a keyword list.
`None` means "this function abstains for this completion" (skipped in the weighted sum, as in TRL).

`reward_funcs` entries in a config: a built-in name (`longstraw.tasks.REWARD_FUNCTIONS`), a module
path `package.module:function`, or a file path `path/to/file.py:function`. A function that raises,
returns the wrong number of rewards, or returns NaN stops the run naming the function and the row.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tasks import REWARD_FUNCTIONS, Example


class RewardFunctionError(RuntimeError):
    """A reward function failed (raised, wrong count, NaN); the message names it and the row."""


def resolve_callable(spec: str, what: str = "reward function") -> Callable:
    """`package.module:function` or `path/to/file.py:function` → the function (errors name the spec)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(
            f"{what} {spec!r}: expected a built-in name, 'package.module:function' or 'path/to/file.py:function'"
        )
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{what} {spec!r}: file {path} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"longstraw_user_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None  # a .py file: a source loader
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"{what} {spec!r}: cannot import module {target!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r}: {target} has no callable {name!r}")
    return fn


def resolve_reward(entry) -> tuple[str, Callable]:
    """(name, function) of a config entry or a callable."""
    if callable(entry):
        return getattr(entry, "__name__", "reward"), entry
    if entry in REWARD_FUNCTIONS:
        return entry, REWARD_FUNCTIONS[entry]
    fn = resolve_callable(entry)
    return getattr(fn, "__name__", entry), fn


@dataclass
class RewardSet:
    """The run's reward functions and their weights."""

    funcs: list[tuple[str, Callable]]
    weights: list[float]

    def __post_init__(self):
        if not self.funcs:
            raise ValueError("no reward functions")
        if len(self.weights) != len(self.funcs):
            raise ValueError(
                f"reward_weights has {len(self.weights)} weights for {len(self.funcs)} reward functions "
                f"({', '.join(self.names)}): give one weight per reward function, in their order"
            )

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.funcs]

    def score(
        self, example: Example, completions: list, completion_ids: list[list[int]], extra: dict | None = None
    ) -> torch.Tensor:
        """`[N, F]` rewards of the F functions for N completions of one example (NaN where one abstains). `extra`:
        per-completion columns (name → N values) of a rollout hook, passed on like the data columns."""
        n = len(completions)
        prompt = example.messages if example.messages is not None else example.prompt
        if example.messages is not None:
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns = {k: [v] * n for k, v in example.reward_columns().items()}
        columns.update(extra or {})
        where = example.source or "the example"
        cols = []
        for name, fn in self.funcs:
            try:
                r = fn(prompts=[prompt] * n, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as e:  # noqa: BLE001 - re-raised with the function and row named
                raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__} on {where}: {e}") from e
            try:
                values = [float("nan") if x is None else float(x) for x in r]
            except (TypeError, ValueError) as e:
                raise RewardFunctionError(f"reward function {name!r} returned non-numbers on {where}: {e}") from None
            if len(values) != n:
                raise RewardFunctionError(
                    f"reward function {name!r} returned {len(values)} rewards for {n} completions on {where}"
                )
            bad = [i for i, (x, raw) in enumerate(zip(values, r)) if raw is not None and math.isnan(x)]
            if bad:
                raise RewardFunctionError(
                    f"reward function {name!r} returned NaN for completion {bad[0]} on {where} (return None to abstain)"
                )
            cols.append(torch.tensor(values))
        return torch.stack(cols, dim=1)
