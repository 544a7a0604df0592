"""Context-parallel capture and branch replay over a process group (the design is in `longstraw.distributed`).

`longstraw.capture(model, prompt_ids, ..., group=pg)`: every rank of the group calls it with the same arguments and
gets a `ContextParallelState` holding the durable state of its own slice of the prompt. `state.replay(response_ids)` is
then a collective in which every rank brings its own branch.

One file per layer kind, as in `longstraw.kinds` and `longstraw.ops`: `full_attention` (the sliced K/V and the
attention across slices), `latent_attention` (MLA / DSA latents and indexer keys), `sliding_window` (the replicated
final window), `linear_attention` (the recurrent state relayed rank to rank); `kinds` says which kinds are served and
which branch layers read them, `capture` the collective capture, `state` the state and its collective replay,
sampling and reverse pass, `slices` how the prompt is split.
"""

from __future__ import annotations

from .capture import agree, capture, check_served
from .full_attention import SliceKVState
from .latent_attention import SliceIndexedLatentState, SliceLatentState
from .slices import slice_bounds
from .state import ContextParallelState

__all__ = [
    "ContextParallelState",
    "SliceIndexedLatentState",
    "SliceKVState",
    "SliceLatentState",
    "agree",
    "capture",
    "check_served",
    "slice_bounds",
]
