"""Prompt states kept across optimizer steps (`recapture_every: k`), captured once every k steps.

A document asked questions over several steps (or the iterations of `num_iterations`) is captured once every k steps
instead of every step.

A kept state was captured under older weights: its K/V (and recurrent states) are the prompt as the policy of the
step that captured it read it, while the responses are sampled and replayed by today's policy on top of it. The
drift this brings, measured on SmolLM2 at P = 6K (`bench/staleness.py`, docs/training.md): after 7 real updates the
replay's importance ratio moves 1.3 % on average and the gradient's cosine to a fresh capture's is 0.99995;
`recapture_every: 1`, the default, captures every step, as before. Detached mode only: an exact prompt gradient is
the gradient of the prompt's forward under the current weights.

The store holds the states its steps used: at the start of a step states k or more steps old go, at its end those
the step did not read go (a document that comes back later is captured again). Memory: the states of one step's
contexts (one, with `rows_per_context` = `prompts_per_step`). A checkpoint ends every kept state (a state is not
saved: at 10^6 tokens it is gigabytes), so a run resumed from a checkpoint does what the uninterrupted run did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..prompt_state import PromptState


@dataclass
class _Kept:
    prefix: torch.Tensor  # [L] the token ids the state holds
    state: PromptState
    step: int  # the optimizer step that captured it
    used: bool = True  # read by the current step


class StateStore:
    """Captured prompt states by their token ids, each reused for `every` optimizer steps from the one that captured
    it. `begin(step)` / `end()` bracket a step; `get(prefix, capture)` returns a kept state of exactly these ids, or
    captures one (`capture()`) and keeps it. The store owns what it returns: callers do not release it."""

    def __init__(self, every: int):
        if every < 1:
            raise ValueError(f"recapture_every must be >= 1, got {every}")
        self.every = every
        self.step = 0
        self._kept: list[_Kept] = []
        #: captures made and states reused since the start (the run's `recaptures`, `state_reuses` metrics)
        self.captures = 0
        self.reuses = 0

    def begin(self, step: int) -> None:
        """Start optimizer step `step`: states captured `every` or more steps before it are released."""
        self.step = step
        for k in self._kept:
            k.used = False
        self._drop(lambda k: step - k.step >= self.every)

    def get(self, prefix: torch.Tensor, capture: Callable[[], PromptState]) -> PromptState:
        for k in self._kept:
            if k.prefix.numel() == prefix.numel() and torch.equal(k.prefix, prefix.to(k.prefix.device)):
                k.used = True
                self.reuses += 1
                return k.state
        state = capture()
        if state.prompt_grad != "detached":
            state.release()
            raise ValueError("recapture_every > 1 keeps detached states only (prompt_grad: detached)")
        self.captures += 1
        self._kept.append(_Kept(prefix.detach().clone(), state, self.step))
        return state

    def owns(self, state: PromptState) -> bool:
        return any(k.state is state for k in self._kept)

    def age(self, state: PromptState) -> int:
        """Optimizer steps since `state` (a kept one) was captured: 0 in the step that captured it."""
        return next(self.step - k.step for k in self._kept if k.state is state)

    def end(self) -> None:
        """End the step: states it did not read are released."""
        self._drop(lambda k: not k.used)

    def clear(self) -> None:
        """Release every kept state (at a checkpoint, and at the end of the run)."""
        self._drop(lambda k: True)

    @property
    def nbytes(self) -> int:
        return sum(k.state.nbytes for k in self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def _drop(self, cond: Callable[[_Kept], bool]) -> None:
        keep = []
        for k in self._kept:
            if cond(k):
                k.state.release()
            else:
                keep.append(k)
        self._kept = keep
