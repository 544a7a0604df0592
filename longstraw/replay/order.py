"""One entry point for every replay order: `choose_order` once per run, `replay_backward` for a row's responses.

A row's responses (a prompt state, or a `Branch` after the row's own question, and G responses of it) are replayed
with autograd and each one's loss back-propagated, in one of four orders (`ReplayOrder`):

- batched (`batch` = k > 1): k whole responses in one forward and one backward (`batched.replay_batch`), their losses
  summed; used only when every response of the row is replayed whole (on context-parallel ranks: every rank k of its
  own in one collective, except where DSA layers replay one per rank); the rows of one context (each after its own
  question, detached) share the batches (`replay_rows_backward`, `batched.replay_branches`) where every layer is
  plain attention (`rows_together`);
- whole: one response at a time (`PromptState.replay` / `Branch.replay`), each its own forward and backward;
- segments (`segments`): a response holding environment tokens (mask 0) one policy turn at a time
  (`segments.replay_segments`), the gradient of replaying it whole; on several context-parallel ranks
  (`collective`) every response goes that way, the ranks in lockstep;
- layer-major (`layer_major`): every response one decoder layer at a time (`layer_major`).

`replay_backward(state, responses, loss_of, order)` runs them: `loss_of(j, sl, replay)` gets the j-th response's
slice `sl` (its whole length, or one segment) and the `Replay` of that slice (log-probs and entropies with grad) and
returns that slice's share of the loss; each share is back-propagated once (a batch's shares summed first). Memory:
a batch of k holds k replays' graphs (`longstraw.model.chunking.replay_graph_bytes` each), the other orders one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..branch import Branch
from ..model.capability import layer_plan, model_parts
from ..model.chunking import replay_graph_bytes
from ..prompt_state import Replay
from .batched import batch_size, replay_batch, replay_branches, stacks_for_replay
from .layer_major import LayerMajor
from .segments import replay_segments

LossOf = Callable[[int, slice, Replay], torch.Tensor]


@dataclass(frozen=True)
class ReplayOrder:
    """The order a run replays its responses in (see the module doc), chosen once by `choose_order`."""

    #: whole responses of a row replayed together
    batch: int = 1
    #: responses with environment tokens replayed one policy turn at a time
    segments: bool = False
    #: every response one decoder layer at a time (one process)
    layer_major: LayerMajor | None = None
    #: every forward is a collective of several context-parallel ranks, in lockstep (each rank's batch as large)
    collective: bool = False
    #: why responses go one at a time where more were asked for (`choose_order`); "" otherwise
    note: str = ""

    def __post_init__(self):
        if not (isinstance(self.batch, int) and self.batch >= 1):
            raise ValueError(f"ReplayOrder.batch must be an int >= 1; got {self.batch!r}")

    def in_pieces(self, mask: torch.Tensor | None) -> bool:
        """Whether a response of loss mask `mask` is replayed in pieces (layer by layer, or by segments)."""
        if self.layer_major is not None:
            return True
        return self.segments and (self.collective or (mask is not None and bool((mask == 0).any())))

    @property
    def name(self) -> str:
        """What the order does, in words (the run record's `replay_order`)."""
        if self.layer_major is not None:
            text = "layer-major, one response at a time"
        elif self.segments and self.collective:  # on N ranks every response goes by segments (`in_pieces`)
            text = "every response by segments, one at a time"
            if self.batch > 1:
                text += " (segmented replay does not batch)"
        elif self.batch > 1:
            text = f"whole responses, {self.batch} at a time"
            if self.collective:
                text += " per rank, one collective per batch"
            if self.segments:
                text += "; responses with tool output by segments, one at a time (segmented replay does not batch)"
            return text
        else:
            text = "whole responses, one at a time" + (", by segments where tools answered" if self.segments else "")
        return f"{text} ({self.note})" if self.note else text


def spans(n: int, k: int) -> list[tuple[int, int]]:
    """[start, stop) of ⌈n / k⌉ batches of at most k over n responses, as even as they go (64 at k = 31: 22, 21, 21,
    not 31, 31, 2: the same passes over the weights and the prompt state, none of them nearly empty)."""
    count = -(-n // max(k, 1))
    out, start = [], 0
    for i in range(count):
        stop = start + n // count + (1 if i < n % count else 0)
        out.append((start, stop))
        start = stop
    return out


def choose_order(
    model,
    responses: int,
    replay_batch: int | str = 1,
    replay_memory: int | None = None,
    completion_length: int = 256,
    checkpoint_layers: bool = False,
    segments: bool = False,
    layer_major: LayerMajor | None = None,
    collective: bool = False,
    lockstep: bool = False,
) -> ReplayOrder:
    """The order for a run of `model` that replays at most `responses` responses together (a row's, or the rows of a
    document): `replay_batch` an int (≥ 1), or
    "auto": as many as `replay_memory` bytes hold of one replay's graph at `completion_length` tokens
    (`replay_graph_bytes`); 1 when the responses go in pieces (`layer_major`) or every forward is a collective of
    ranks that do not replay together (`lockstep` without `collective`: sharded layers or spread experts whose ranks
    take contexts of their own). Context-parallel ranks (`collective`) replay batches as one collective, each rank as
    many responses (`share.replays` pads them alike)."""
    note = ""
    if (lockstep and not collective) or layer_major is not None:
        batch = 1
        if replay_batch != 1:
            note = (
                "layer-major replay does not batch"
                if layer_major is not None
                else "ranks in lockstep that take contexts of their own replay one at a time"
            )
    elif replay_batch == "auto":
        cfg = model_parts(model).config
        elem = next(model.parameters()).element_size()
        graph = replay_graph_bytes(cfg, layer_plan(cfg), elem, completion_length, completion_length, checkpoint_layers)
        batch = batch_size("auto", graph, replay_memory, responses)
    else:
        batch = batch_size(replay_batch, 1, None, responses)
    return ReplayOrder(batch, segments, layer_major, collective, note)


def replay_backward(
    state,
    responses: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    loss_of: LossOf,
    order: ReplayOrder,
    temperature: float = 1.0,
    checkpoint_layers: bool = False,
    prefix_ids: torch.Tensor | None = None,
    before_last_backward: Callable[[], None] | None = None,
) -> list[torch.Tensor]:
    """Replay each of `responses` ((token ids `[T_j]`, loss mask `[T_j]` or None), all after `prefix_ids` on
    `state`) in `order` and back-propagate its loss (`loss_of`, see the module doc); returns each response's entropies
    `[T_j]`, detached. `before_last_backward`: called once, just before the last backward of this call."""
    n = len(responses)
    if n == 0:
        return []
    pieces = [order.in_pieces(mask) for _, mask in responses]
    entropies: list[torch.Tensor] = []
    owner = state.state if isinstance(state, Branch) else state
    # a context-parallel state with DSA layers replays one response per rank (`batches_replays`): its ranks alike
    if order.batch > 1 and not any(pieces) and owner.batches_replays:
        for start, stop in spans(n, order.batch):
            part = list(range(start, stop))
            outs = replay_batch(
                state,
                [responses[j][0] for j in part],
                temperature=temperature,
                checkpoint_layers=checkpoint_layers,
                prefix_ids=prefix_ids,
            )
            total = torch.stack([loss_of(j, slice(0, int(out.logprobs.numel())), out) for j, out in zip(part, outs)])
            if before_last_backward is not None and part[-1] == n - 1:
                before_last_backward()
            total.sum().backward()
            entropies += [out.entropy.detach() for out in outs]
        return entropies
    for j, (tokens, mask) in enumerate(responses):
        last = before_last_backward if j == n - 1 else None
        if pieces[j]:
            out = replay_segments(
                state,
                tokens,
                mask if mask is not None else torch.ones(len(tokens)),
                functools.partial(loss_of, j),
                temperature=temperature,
                checkpoint_layers=checkpoint_layers,
                prefix_ids=prefix_ids,
                before_last_backward=last,
                layer_major=order.layer_major,
            )
            entropies.append(out.entropy.detach())
            continue
        out = state.replay(tokens, temperature=temperature, checkpoint_layers=checkpoint_layers, prefix_ids=prefix_ids)
        loss = loss_of(j, slice(0, int(out.logprobs.numel())), out)
        if last is not None:
            last()
        loss.backward()
        entropies.append(out.entropy.detach())
    return entropies


def _exact(states: Sequence) -> bool:
    """Whether `states` are one exact prompt state on one process (the rows of a document, their questions read in
    the replay's forward)."""
    first = states[0]
    return (
        all(s is first for s in states)
        and getattr(first, "prompt_grad", None) == "exact"
        and not isinstance(first, Branch)
        and getattr(first, "group", None) is None
    )


def rows_together(
    order: ReplayOrder, states: Sequence, rows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None]]]
) -> bool:
    """Whether `replay_rows_backward` replays these rows (`states[i]`: row i's branch after its question, the prompt
    state, or in exact mode the prompt state for every row; `rows[i]`: its responses as `replay_backward` takes them)
    in shared batches: batched, every response whole, and either one exact state (any layer kind: each row's question
    in the batch's forward) or detached states stacked in one replay (`batched.stacks_for_replay`)."""
    if order.batch <= 1 or len(states) < 2 or any(order.in_pieces(mask) for row in rows for _, mask in row):
        return False
    return _exact(states) or stacks_for_replay(states)


def replay_rows_backward(
    states: Sequence,
    rows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None]]],
    loss_of: Sequence[LossOf],
    order: ReplayOrder,
    temperature: float = 1.0,
    checkpoint_layers: bool = False,
    before_last_backward: Callable[[], None] | None = None,
    prefixes: Sequence[torch.Tensor | None] | None = None,
) -> list[list[torch.Tensor]]:
    """`replay_backward(states[i], rows[i], loss_of[i], order, prefix_ids=prefixes[i])` for every row, the responses
    of all rows taken in order `order.batch` at a time across the rows (`rows_together` must hold): detached branches
    through `batched.replay_branches`, one exact state through `batched.replay_batch` with each response's own prefix
    (`prefixes[i]`: row i's question; detached rows have read theirs into their branch). Per row, each response's
    entropies, detached. `before_last_backward`: called once, just before the last backward."""
    exact = _exact(states)
    empty = torch.zeros(0, dtype=torch.long)
    flat = [(i, j) for i, row in enumerate(rows) for j in range(len(row))]
    entropies: list[list[torch.Tensor]] = [[] for _ in rows]
    for start, stop in spans(len(flat), order.batch):
        part = flat[start:stop]
        if exact:
            pre = [empty if prefixes is None or prefixes[i] is None else prefixes[i] for i, _ in part]
            outs = replay_batch(
                states[0],
                [rows[i][j][0] for i, j in part],
                temperature=temperature,
                checkpoint_layers=checkpoint_layers,
                prefixes=pre,  # type: ignore[arg-type]  # tensors
            )
            done = list(zip(part, outs))
        else:
            held = sorted({i for i, _ in part})
            own = [[j for i2, j in part if i2 == i] for i in held]  # each held row's responses in this batch
            grouped = replay_branches(
                [states[i] for i in held],
                [[rows[i][j][0] for j in js] for i, js in zip(held, own)],
                temperature=temperature,
                checkpoint_layers=checkpoint_layers,
            )
            done = [((i, j), out) for i, js, outs in zip(held, own, grouped) for j, out in zip(js, outs)]
        losses = []
        for (i, j), out in done:
            losses.append(loss_of[i](j, slice(0, int(out.logprobs.numel())), out))
            entropies[i].append(out.entropy.detach())
        if before_last_backward is not None and stop == len(flat):
            before_last_backward()
        torch.stack(losses).sum().backward()
    return entropies
