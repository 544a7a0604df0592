"""Prompt states kept across optimizer steps (`recapture_every: k`), captured once every k steps.

A document asked questions over several steps (or the iterations of `num_iterations`) is captured once every k steps
instead of every step.

A kept state was captured under older weights: its K/V (and recurrent states) are the prompt as the policy of the
step that captured it read it, while the responses are sampled and replayed by today's policy on top of it. The
drift this brings, measured (`bench/staleness.py`, docs/training.md): after 7 real updates the replay's importance
ratio moves 0.9 % on average on SmolLM2 at 6K, 13 % on Gemma 3 at 32K. `recapture_every: 1`, the default, captures
every step, as before. Detached mode only: an exact prompt gradient is the gradient of the prompt's forward under the
current weights.

`recapture_drift: d` probes a kept state before it is read again (`kv_drift_probe`): the document's first
`PROBE_TOKENS` tokens captured again by the current weights (causal: they read nothing else), their full-attention
K/V against the kept state's at those positions, ‖K/V_kept − K/V_now‖ / ‖K/V_now‖. Measured, this probe is the whole
document's K/V drift within 3 % (SmolLM2 at 6K, Gemma 3 at 8K), and the replays' mean |Δ log p| is 1.9–2.3× it at
every age on both models: the state is captured anew when `DRIFT_PER_KV` × the probe passes d. Cost: a capture of
`PROBE_TOKENS` tokens per kept state and step.

The store holds the states its steps used: at the start of a step states k or more steps old go, at its end those
the step did not read go (a document that comes back later is captured again). Memory: the states of one step's
contexts (one, with `rows_per_context` = `prompts_per_step`). A checkpoint ends every kept state (a state is not
saved: at 10^6 tokens it is gigabytes), so a run resumed from a checkpoint does what the uninterrupted run did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..api import capture
from ..prompt_state import PromptState

#: the drift probe's tokens: the document's start, captured again by the current weights
PROBE_TOKENS = 512
#: mean |Δ log p| of a kept state's replays per unit of the probe's relative K/V drift: measured 1.94–2.09 on SmolLM2
#: at 6K and 2.09–2.31 on Gemma 3 at 8K over ages 1–8 (`bench/staleness.py`); 2.5 leaves 8 % above the largest
DRIFT_PER_KV = 2.5


def _full_kv(state: PromptState, n: int) -> list[torch.Tensor]:
    """Keys and values of the state's full-attention layers at positions [0, n), float32 (the layers that keep every
    position; sliding-window layers keep only the prompt's last window)."""
    out = []
    for layer in state.layers or ():  # None: released
        kv = layer.prefix_kv(n)
        if kv is not None:
            out += [kv[0].float(), kv[1].float()]
    return out


@torch.no_grad()
def kv_drift_probe(model, state: PromptState, prefix: torch.Tensor, tokens: int = PROBE_TOKENS) -> float:
    """The relative change ‖K/V_state − K/V_now‖ / ‖K/V_now‖ of the full-attention K/V at the prompt's first positions,
    K/V_now from `prefix[:tokens]` captured by `model` as it is now (see the module doc)."""
    n = min(tokens, prefix.numel())
    with capture(model, prefix[:n], prompt_grad="detached", verify=False) as head:
        now = _full_kv(head, n - 1)
    kept = _full_kv(state, n - 1)
    if not now:
        raise ValueError(
            "recapture_drift probes the full-attention layers' K/V, and this model keeps none of a whole prompt "
            "(sliding-window, recurrent or latent layers only, or an 8-bit state): use recapture_every alone"
        )
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(kept, now))
    den = sum(float(b.pow(2).sum()) for b in now)
    return (num / max(den, 1e-30)) ** 0.5


@dataclass
class _Kept:
    prefix: torch.Tensor  # [L] the token ids the state holds
    state: PromptState
    step: int  # the optimizer step that captured it
    used: bool = True  # read by the current step
    probed: int = -1  # the optimizer step whose weights the drift probe last compared it with


class StateStore:
    """Captured prompt states by their token ids, each reused for `every` optimizer steps from the one that captured
    it. `begin(step)` / `end()` bracket a step; `get(prefix, capture)` returns a kept state of exactly these ids, or
    captures one (`capture()`) and keeps it. The store owns what it returns: callers do not release it."""

    def __init__(
        self,
        every: int,
        bound: float | None = None,
        probe: Callable[[PromptState, torch.Tensor], float] | None = None,
    ):
        if every < 1:
            raise ValueError(f"recapture_every must be >= 1, got {every}")
        if bound is not None and (bound <= 0 or probe is None):
            raise ValueError("a drift bound needs a positive value and a probe")
        self.every = every
        #: `recapture_drift`: the mean |Δ log p| past which a kept state is captured anew; None: no probe
        self.bound = bound
        self.probe = probe
        #: the latest probe's predicted mean |Δ log p| (None before any)
        self.last_drift: float | None = None
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
                # probed once per step: the rollout and the update of a step read it under the same weights
                if self.bound is not None and self.probe is not None and k.step < self.step and k.probed < self.step:
                    k.probed = self.step
                    self.last_drift = DRIFT_PER_KV * self.probe(k.state, k.prefix)
                    if self.last_drift > self.bound:  # too far from today's weights: captured anew below
                        k.state.release()
                        self._kept.remove(k)
                        break
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
