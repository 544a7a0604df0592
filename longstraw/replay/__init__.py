"""Replay: the responses of a step with autograd against their prompt state, in one of several orders.

- `order`: the one entry point: `choose_order` (once per run, from the config and the memory budget) and
  `replay_backward` (a row's responses in that order, each one's loss back-propagated), which the trainer calls.
- `batched.replay_batch`: k responses of one state (the G samples of a row) in one forward and one backward as a
  padded batch, the prompt state read once for the k (their queries folded, `longstraw.ops.attention`); k = 1 is
  `PromptState.replay`, the reference it is held equal to.
- `segments.replay_segments`: a multi-turn trajectory one segment at a time, the whole trajectory's gradient.
- `layer_major`: a trajectory one decoder layer at a time (one layer's own K/V held).
- `carry`: what a replay in pieces carries from one piece to the next.
"""

from __future__ import annotations
