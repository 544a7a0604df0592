"""Segmented replay: a multi-turn trajectory replayed one policy turn at a time against the prompt state.

A trajectory after the prompt is `tokens` `[T]` with a `mask` `[T]` (1: the policy wrote it, 0: the environment did:
tool output, observations). Its segments are the maximal runs of equal mask. `replay_segments` walks them in order
on one branch cache forked from the prompt state (`longstraw.branch`):

- an environment segment runs without autograd, `chunk_size` tokens at a time: it is never in a graph;
- a policy segment runs with autograd, its log-probs go to `segment_loss`, whose result is back-propagated at once;
  the branch's own state is then cut from the freed graph (`detach_own`) and read as a constant by what follows.

The gradient is the detached one, turn by turn: each policy segment's log-probs are differentiated through that
segment's own computation, the prompt and the earlier segments held as constants, as a transformers cache filled
without grad would hold them (`longstraw.reference.segmented_reference_grads` is that reference). The values are the
model's: each token's log-prob equals the full-sequence forward's.

Memory: the prompt state + the branch's own growth (the whole trajectory's K/V or states, without autograd) + one
policy segment's graph: independent of the number of turns and of G (trajectories are replayed one at a time).
Work: every trajectory token runs once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .branch import detach_own
from .hf.decoder import run_decoder
from .layers import AttentionBranchLayer
from .logprobs import chunked_logprobs
from .state import PromptState, Replay, as_ids, check_length


@dataclass(frozen=True)
class Segment:
    """Tokens `[start, end)` of a trajectory, written by the policy (`policy=True`) or by the environment."""

    start: int
    end: int
    policy: bool


def segments(mask: torch.Tensor) -> list[Segment]:
    """The maximal runs of equal `mask` `[T]` (1: policy, 0: environment), in order."""
    m = torch.as_tensor(mask).reshape(-1)
    if m.numel() == 0:
        return []
    flips = (m[1:] != m[:-1]).nonzero().flatten().add(1).tolist()
    bounds = [0, *flips, m.numel()]
    return [Segment(a, b, bool(m[a] > 0)) for a, b in zip(bounds[:-1], bounds[1:])]


def replay_segments(state: PromptState, response_ids, mask, segment_loss: Callable[[slice, Replay], torch.Tensor],
                    temperature: float = 1.0, checkpoint_layers: bool = False) -> Replay:
    """Replay a trajectory one policy segment at a time (see the module doc); back-propagates each segment's loss.

    `segment_loss(sl, replay)` gets the slice `sl` of the trajectory the segment covers and its log-probs and
    entropies `[len]` (with grad) and returns the segment's share of the loss (a 0-d tensor, or None to skip its
    backward). Returns the whole trajectory's log-probs and entropies `[T]`, detached (0 at environment tokens).
    """
    if getattr(state, "group", None) is not None:
        raise NotImplementedError("segmented replay runs in one process: a context-parallel prompt state (group=...) "
                                  "replays trajectories whole; set segment_replay: false")
    if state.prompt_grad == "exact":
        raise NotImplementedError(
            "segmented replay holds the earlier turns as constants (the detached gradient); prompt_grad='exact' "
            "would need their gradient too: use prompt_grad='detached', or replay the trajectory whole")
    parts = state._parts
    device = state.last_token.device
    response = as_ids(response_ids, "response_ids", parts.config.vocab_size, device)
    m = torch.as_tensor(mask, dtype=torch.float32).reshape(-1)
    if m.numel() != response.numel():
        raise ValueError(f"mask has {m.numel()} entries for {response.numel()} tokens")
    check_length(parts.config, state.prompt_length + response.numel())
    inputs = torch.cat([state.last_token, response[:-1]])
    start = state.prompt_length - 1
    cache = state._cache(1)
    for layer in cache.layers:  # sliding-window layers keep only the own K/V later tokens can read
        if isinstance(layer, AttentionBranchLayer):
            layer.trim = True
    logprobs = torch.zeros(response.numel(), device=device)
    entropy = torch.zeros(response.numel(), device=device)
    parts_list = segments(m)
    last_policy = max((i for i, seg in enumerate(parts_list) if seg.policy), default=-1)
    for i, seg in enumerate(parts_list[: last_policy + 1]):  # environment tokens after the last turn: never read
        positions = torch.arange(start + seg.start, start + seg.end, device=device)
        if not seg.policy:
            with torch.no_grad():
                for s in range(seg.start, seg.end, state.chunk_size):
                    e = min(s + state.chunk_size, seg.end)
                    run_decoder(parts, inputs[None, s:e], positions[s - seg.start : e - seg.start], cache)
            continue
        sl = slice(seg.start, seg.end)
        with torch.enable_grad():
            hidden = run_decoder(parts, inputs[None, sl], positions, cache, checkpoint_layers=checkpoint_layers)
            lp, ent = chunked_logprobs(hidden[0], parts.lm_head, response[sl], temperature=temperature,
                                       softcap=parts.final_logit_softcapping, scale=parts.logit_scale)
            loss = segment_loss(sl, Replay(logprobs=lp, entropy=ent))
            if loss is not None and loss.requires_grad:
                loss.backward()
        logprobs[sl], entropy[sl] = lp.detach(), ent.detach()
        del hidden, lp, ent, loss
        if i < last_policy:
            detach_own(cache)
    return Replay(logprobs=logprobs, entropy=entropy)
