"""Segmented replay: a multi-turn trajectory replayed one segment at a time against the prompt state, with the
gradient of replaying it whole.

A trajectory after the prompt is `tokens` `[T]` with a `mask` `[T]` (1: the policy wrote it, 0: the environment did:
tool output, observations). Its segments are the maximal runs of equal mask. `replay_segments` walks them in order
on one branch cache forked from the prompt state (`longstraw.branch`) without autograd, keeping what each produced
(`longstraw.replay.carry.Carry`), but the last policy segment: with autograd, its loss (`segment_loss`) back-propagated
at once. Then a reverse pass recomputes the segments before it last to first with autograd and back-propagates through
each, in one backward, the gradient that later segments sent to its own K/V (or recurrent states) and, for a policy
segment, its loss. (`layer_major`: one decoder layer at a time instead, `longstraw.replay.layer_major`.)

The gradient is the whole trajectory's, whichever way it is replayed: one forward + backward of
[prompt + trajectory] with the prompt read as the state holds it. With a detached prompt state (`prompt_grad=
"detached"`, the LongStraw objective) the prompt is a constant and everything after it is differentiated: each turn
through its own computation, the earlier turns and the tool output it reads (the reference is
`longstraw.model.oracles.cache_reference_logprobs` over the whole trajectory, and `PromptState.replay` of it whole);
with `prompt_grad="exact"` also through the prompt (its share left on the state's leaves for
`PromptState.backward()`). The values are the model's either way: each token's log-prob equals the full-sequence
forward's. Layer kinds the carry does not serve (DeepSeek-V4's compressed attention) replay whole: the same gradient,
the whole trajectory's graph.

Memory: the prompt state + the trajectory's own K/V or states (without autograd) + their gradient (accumulated during
the reverse pass) + one segment's graph: independent of G (trajectories are replayed one at a time); the graph does
not grow with the number of turns. Work: the whole replay's forward and backward, and one more forward of the
segments before the last policy turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from ..branch import Branch, detach_own
from ..hf.decoder import run_decoder
from ..prompt_state import PromptState, Replay, TokenIds, as_ids, check_length
from .carry import Carry, Segment, policy_loss, segments
from .layer_major import LayerMajor, replay_layer_major


def replay_segments(
    state: PromptState | Branch,
    response_ids: TokenIds,
    mask: torch.Tensor | Sequence[float],
    segment_loss: Callable[[slice, Replay], torch.Tensor | None],
    temperature: float = 1.0,
    checkpoint_layers: bool = False,
    prefix_ids: TokenIds | None = None,
    before_last_backward: Callable[[], None] | None = None,
    layer_major: LayerMajor | None = None,
) -> Replay:
    """Replay a trajectory one policy segment at a time (see the module doc); back-propagates each segment's loss.

    `segment_loss(sl, replay)` gets the slice `sl` of the trajectory the segment covers and its log-probs and
    entropies `[len]` (with grad) and returns the segment's share of the loss (a 0-d tensor, or None to skip its
    backward); it is called once per policy segment, the last one first, then the others last to first (the reverse
    pass). Returns the whole trajectory's log-probs and entropies `[T]`, detached (0 at environment tokens).

    `prefix_ids` `[L]`: tokens between the prompt state and the trajectory (a row's own question after a shared
    document, `PromptState.replay`): detached, read first into a branch without autograd (constants, as the prompt
    is); exact, read first as an environment segment (in the gradient); slices and outputs stay the trajectory's own.
    `before_last_backward`: called once, just before the replay's last backward (FSDP2 turns gradient reduction on
    there). `layer_major`: replay one decoder layer at a time instead (`longstraw.replay.layer_major`: the same
    gradient, one layer's own K/V held instead of every layer's and their gradient; one process, no
    `before_last_backward`); `segment_loss` is then called in order.

    Context parallelism (a `ContextParallelState` or a branch of one): a collective, as its `replay` is: every rank
    of the group calls it, each with its own trajectory (lengths and segments may differ). The ranks run their
    segments in lockstep (`_lockstep`): every rank makes the same number of forwards, and of backwards, each reading
    the prompt across the ranks' slices; a rank with fewer segments takes part with one-token forwards of weight 0.
    The gradient is that of the trajectory replayed whole, as in one process.
    """
    if prefix_ids is not None and len(prefix_ids) > 0 and state.prompt_grad == "detached":
        # the prefix a constant, as the prompt is: read into a branch without autograd (`PromptState.replay`)
        with state.fork() as branch:
            branch.extend(torch.as_tensor(prefix_ids, dtype=torch.long).reshape(-1))
            return replay_segments(
                branch,
                response_ids,
                mask,
                segment_loss,
                temperature=temperature,
                checkpoint_layers=checkpoint_layers,
                before_last_backward=before_last_backward,
                layer_major=layer_major,
            )
    if prefix_ids is not None and len(prefix_ids) > 0:  # exact: the prefix in the gradient, an environment segment
        prefix = torch.as_tensor(prefix_ids, dtype=torch.long).reshape(-1)
        n = prefix.numel()
        tokens = torch.as_tensor(response_ids, dtype=torch.long).reshape(-1)
        m = torch.as_tensor(mask, dtype=torch.float32).reshape(-1)
        if m.numel() != tokens.numel() and getattr(state, "group", None) is None:  # (collective: refused below)
            raise ValueError(f"mask has {m.numel()} entries for {tokens.numel()} tokens")

        def shifted(sl: slice, out: Replay):
            return segment_loss(slice(sl.start - n, sl.stop - n), out)

        out = replay_segments(
            state,
            torch.cat([prefix.to(tokens.device), tokens]),
            torch.cat([torch.zeros(n), m]),
            shifted,
            temperature=temperature,
            checkpoint_layers=checkpoint_layers,
            before_last_backward=before_last_backward,
            layer_major=layer_major,
        )
        return Replay(logprobs=out.logprobs[n:], entropy=out.entropy[n:])
    parts = state.parts
    device = state.last_token.device
    group = getattr(state, "group", None)
    m = torch.as_tensor(mask, dtype=torch.float32).reshape(-1)
    if group is None:
        response = as_ids(response_ids, "response_ids", parts.config.vocab_size, device)
        if m.numel() != response.numel():
            raise ValueError(f"mask has {m.numel()} entries for {response.numel()} tokens")
        check_length(parts.config, state.prompt_length + response.numel())
        cache = state.branch_cache(1)
    else:
        # context parallelism: a collective; the response checked on every rank, the cache reads the prompt's slices
        owner = state if isinstance(state, PromptState) else state.state
        if m.numel() != torch.as_tensor(response_ids).numel():
            response_ids = torch.full((1,), -1)  # refused on every rank by the agreed check below
        response = owner.checked_response(response_ids, checkpoint_layers, state.prompt_length)
        cache = owner.replay_cache(None if state is owner else cast(Branch, state))
    if layer_major is not None and (group is not None or before_last_backward is not None):
        raise NotImplementedError(
            "layer-major replay runs in one process without FSDP2; under context parallelism or FSDP2 replay in "
            "segments (layer_major=None)"
        )
    if not Carry.serves(cache):  # the same gradient, the whole trajectory's graph
        return _replay_whole(state, response, m, segment_loss, temperature, checkpoint_layers, before_last_backward)
    if layer_major is not None:
        return replay_layer_major(state, cache, response, m, segment_loss, temperature, layer_major)
    return _replay_carried(
        state, cache, response, m, segment_loss, temperature, checkpoint_layers, before_last_backward
    )


def _replay_whole(
    state, response, mask, segment_loss, temperature: float, checkpoint_layers: bool, before_last_backward=None
) -> Replay:
    """The trajectory in one replay; each policy segment's loss taken on its slice of it, back-propagated together
    (with context parallelism a backward runs on every rank, of weight 0 where there is no loss)."""
    out = state.replay(response, temperature=temperature, checkpoint_layers=checkpoint_layers)
    losses = []
    for seg in segments(mask):
        if seg.policy:
            sl = slice(seg.start, seg.end)
            loss = segment_loss(sl, Replay(logprobs=out.logprobs[sl], entropy=out.entropy[sl]))
            if loss is not None and loss.requires_grad:
                losses.append(loss)
    if not losses and getattr(state, "group", None) is not None and out.logprobs.requires_grad:
        losses.append(out.logprobs.sum() * 0.0)  # the other ranks' backward is a collective
    if losses:
        if before_last_backward is not None:
            before_last_backward()
        torch.stack(losses).sum().backward()
    on = mask > 0
    zero = torch.zeros((), device=out.logprobs.device)
    return Replay(
        logprobs=torch.where(on, out.logprobs.detach(), zero), entropy=torch.where(on, out.entropy.detach(), zero)
    )


def _run_forward(parts, cache, inputs, start: int, seg: Segment, chunk: int) -> None:
    """A segment through the branch cache without autograd, `chunk` tokens per forward (an environment segment, or a
    policy segment the reverse pass builds the graph of)."""
    with torch.no_grad():
        for s in range(seg.start, seg.end, chunk):
            e = min(s + chunk, seg.end)
            run_decoder(parts, inputs[None, s:e], torch.arange(start + s, start + e, device=inputs.device), cache)


def _run_policy(
    parts,
    cache,
    inputs,
    response,
    start: int,
    seg: Segment,
    segment_loss,
    temperature: float,
    checkpoint_layers: bool,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    collective: bool = False,
    before_backward=None,
) -> None:
    """A policy segment with autograd: its log-probs and entropies (written, detached, into `logprobs` / `entropy`)
    go to `segment_loss`, whose result is back-propagated before the graph is dropped (`collective`: a backward runs
    even without a loss, of weight 0, as the other ranks' does)."""
    sl = slice(seg.start, seg.end)
    positions = torch.arange(start + seg.start, start + seg.end, device=inputs.device)
    with torch.enable_grad():
        hidden = run_decoder(parts, inputs[None, sl], positions, cache, checkpoint_layers=checkpoint_layers)
        loss = policy_loss(parts, hidden, response, seg, segment_loss, temperature, logprobs, entropy)
        if collective and hidden.requires_grad:
            # every layer's output takes part in the backward, whatever the loss reads (the same collectives on
            # every rank)
            zero = hidden.sum() * 0.0
            loss = zero if loss is None or not loss.requires_grad else loss + zero
        if loss is not None and loss.requires_grad:
            if before_backward is not None:
                before_backward()
            loss.backward()


@dataclass(frozen=True)
class _Slot:
    """One forward (and maybe backward) of the segmented replay. `index`: the segment this rank runs (None: nothing
    here, a one-token forward of weight 0 on a throwaway cache keeps it in step with the other ranks); `lengths`:
    every rank's query count in this forward (context parallelism; None in one process); `backward`: whether a
    backward follows (on every rank when any rank back-propagates here)."""

    index: int | None
    lengths: list[int] | None
    backward: bool


def _lockstep(group, segs: list[Segment], last_policy: int) -> tuple[list[_Slot], list[_Slot]]:
    """The first pass's and the reverse pass's slots of this rank, the same number on every rank of `group` (None:
    one process, this rank's segments as they are). First pass: segment j of every rank in slot j; a backward
    wherever some rank's segment j is its last policy segment. Reverse pass: every rank's segments before its last
    policy segment, last first, each with its backward. A rank with fewer segments pads with idle slots (one
    query)."""
    mine = [seg.end - seg.start for seg in segs[: last_policy + 1]]  # (a rank's last segment: its last policy one)
    if group is None:
        first = [_Slot(j, None, j == last_policy) for j in range(len(mine))]
        return first, [_Slot(j, None, True) for j in range(last_policy - 1, -1, -1)]
    counts = [row[0] for row in group.all_gather_ints("segmented replay: segment counts", [len(mine)])]
    width = max(counts)
    rows = group.all_gather_ints("segmented replay: segment lengths", mine + [0] * (width - len(mine)))
    me = group.rank
    first = []
    for j in range(width):
        lengths = [rows[r][j] if j < counts[r] else 1 for r in range(group.size)]
        backward = any(j == counts[r] - 1 for r in range(group.size))
        first.append(_Slot(j if j < counts[me] else None, lengths, backward))
    reverse = []
    for i in range(max(counts) - 1):  # rank r reverses its segments counts[r] - 2 ... 0
        at = [counts[r] - 2 - i for r in range(group.size)]
        lengths = [rows[r][at[r]] if at[r] >= 0 else 1 for r in range(group.size)]
        reverse.append(_Slot(at[me] if at[me] >= 0 else None, lengths, True))
    return first, reverse


def _set_lengths(cache, lengths: list[int] | None) -> None:
    """Every rank's query count in the next forward, for the layers that read the prompt across the ranks."""
    if lengths is None:
        return
    for layer in cache.layers:
        info = getattr(layer, "info", None)
        if info is not None:
            layer.info = type(info)(info.group, lengths, info.layer)


def _idle(state, inputs, start: int, slot: _Slot, checkpoint_layers: bool, before_backward=None) -> None:
    """A rank with no segment in `slot`: the trajectory's first input token through a throwaway replay cache (the
    same collectives as the other ranks' forward), and a backward of weight 0 when the slot has one."""
    owner = state if isinstance(state, PromptState) else state.state
    cache = owner.replay_cache(None if state is owner else state)
    _set_lengths(cache, slot.lengths)
    positions = torch.arange(start, start + 1, device=inputs.device)
    with torch.set_grad_enabled(slot.backward):
        hidden = run_decoder(state.parts, inputs[None, :1], positions, cache, checkpoint_layers=checkpoint_layers)
        if slot.backward and hidden.requires_grad:
            if before_backward is not None:
                before_backward()
            (hidden.sum() * 0.0).backward()


def _replay_carried(
    state,
    cache,
    response,
    mask,
    segment_loss,
    temperature: float,
    checkpoint_layers: bool = False,
    before_last_backward=None,
) -> Replay:
    """The whole trajectory's gradient of every policy segment's loss (see the module doc), through the earlier
    segments, and with an exact prompt state through the prompt. A first pass in order runs each segment without
    autograd, storing what it produced in the carry, but the last policy segment: with autograd, its loss
    back-propagated at once into the parameters and into the carry of what it read. A reverse pass then recomputes the
    segments before it, last to first, with autograd, and back-propagates in one backward what each produced (with
    the gradient accumulated on it) and, for a policy segment, its loss: every segment's backward runs once. An exact
    prompt's share stays on the prompt state's leaves for `PromptState.backward()`. Cost: one more forward of the
    trajectory before its last policy turn than the whole replay; memory: the carry (`Carry`) + one segment's graph.
    Context parallelism: the slots of `_lockstep`; a segment in a first-pass slot where another rank back-propagates
    runs with autograd and a backward of weight 0."""
    parts = state.parts
    device = state.last_token.device
    group = getattr(state, "group", None)
    collective = group is not None
    inputs = torch.cat([state.last_token, response[:-1]])
    start = state.prompt_length - 1
    carry = Carry(cache, response.numel())
    logprobs = torch.zeros(response.numel(), device=device)
    entropy = torch.zeros(response.numel(), device=device)
    segs = segments(mask)
    last_policy = max((i for i, seg in enumerate(segs) if seg.policy), default=-1)
    first, reverse = _lockstep(group, segs, last_policy)
    backwards = [slot for slot in first + reverse if slot.backward]
    last_slot = backwards[-1] if backwards else None
    called = []

    def hook(slot: _Slot):
        if slot is not last_slot or before_last_backward is None:
            return None
        called.append(True)
        return before_last_backward

    for slot in first:
        _set_lengths(cache, slot.lengths)
        if slot.index is None:
            _idle(state, inputs, start, slot, checkpoint_layers, hook(slot))
            continue
        j = slot.index
        seg = segs[j]
        carry.enter(cache, j, seg.start)
        if j == last_policy:  # the segments before it take their loss in the reverse pass
            _run_policy(
                parts,
                cache,
                inputs,
                response,
                start,
                seg,
                segment_loss,
                temperature,
                checkpoint_layers,
                logprobs,
                entropy,
                collective,
                hook(slot),
            )
        elif slot.backward:  # another rank back-propagates its last policy segment here: the same collectives, weight 0
            positions = torch.arange(start + seg.start, start + seg.end, device=device)
            with torch.enable_grad():
                hidden = run_decoder(
                    parts, inputs[None, seg.start : seg.end], positions, cache, checkpoint_layers=checkpoint_layers
                )
                if hidden.requires_grad:
                    last = hook(slot)
                    if last is not None:
                        last()
                    (hidden.sum() * 0.0).backward()
        else:  # one forward per segment under context parallelism (a forward is a collective)
            _run_forward(parts, cache, inputs, start, seg, seg.end - seg.start if collective else state.chunk_size)
        carry.leave(cache, j, seg.start, seg.end, first_pass=True)
        detach_own(cache)
    for slot in reverse:  # the last policy segment's own state is read by nothing
        _set_lengths(cache, slot.lengths)
        if slot.index is None:
            _idle(state, inputs, start, slot, False, hook(slot))
            continue
        j = slot.index
        seg = segs[j]
        carry.enter(cache, j, seg.start)
        with torch.enable_grad():
            positions = torch.arange(start + seg.start, start + seg.end, device=device)
            hidden = run_decoder(parts, inputs[None, seg.start : seg.end], positions, cache)
            pairs = carry.leave(cache, j, seg.start, seg.end, first_pass=False)
            # the gradients copied: backward accumulates into the same buffers (at earlier positions)
            roots, grads = [t for t, _ in pairs], [g.to(t.dtype, copy=True) for t, g in pairs]
            if seg.policy:  # its loss in the same backward as the gradient later segments sent to it
                loss = policy_loss(parts, hidden, response, seg, segment_loss, temperature, logprobs, entropy)
                if loss is not None and loss.requires_grad:
                    roots.append(loss)
                    grads.append(torch.ones_like(loss))
            if collective and hidden.requires_grad:  # every layer's collectives, as on the other ranks
                roots.append(hidden)
                grads.append(torch.zeros_like(hidden))
            if roots:
                last = hook(slot)
                if last is not None:
                    last()
                torch.autograd.backward(roots, grads)
        del pairs, roots, grads
        detach_own(cache)
    if before_last_backward is not None and not called:  # (one process, no gradient left to push at the end)
        before_last_backward()
    return Replay(logprobs=logprobs, entropy=entropy)
