"""Ragged decoding: one decode batch over several branches of one prompt, each with its own length.

Branches of one captured prompt grow apart: the rows of a step that share a document each read their own question
(`longstraw.train.sharing`), the G trajectories of an agent each add their own turns and tool output
(`longstraw.agent`). Decoding them one branch after another reads the model's weights and the prompt's K/V once per
branch and token; `sample_branches` decodes them in one batch, reading both once per token for all of them.

The branches' caches are stacked layer by layer (each layer's `stack_rows`): attention layers hold the rows' own K/V
right-aligned with per-row padding (`AttentionBranchLayer.row_pad`) and attend through
`longstraw.ops.ragged_attention` (the prompt part read once for the batch); recurrent layers (linear attention, SSMs,
short convolutions) stack their per-row states; layers without a mixer have nothing to stack. Every row keeps its own
positions (`[B, 1]` per step). Other layer kinds (latent attention, compressed attention), context-parallel
branches and a model whose attention reads its positions from the cache (Llama 4's layers without RoPE) are not
stacked: `stackable` says so, and `sample_branches` then decodes the branches one after another.

`keep=True` (one sequence per branch, an agent's turn): each row's state is taken back out of the batch when it
leaves it (`BranchLayer.take_row`), so the sampled turn becomes part of its branch exactly as `Branch.sample` leaves it.

Memory: the branches' own states stacked in one buffer (padded to the longest) with room for the turn, where each
sampled token is written in place; the prompt state is read, never copied. With `keep=True` the branches hand their
state to the batch, each branch's copy freed as its layer is stacked, so the batch never holds a branch twice; rows
that leave early take a copy of theirs (the batch then moves its remaining rows down in place), the last ones their
rows of the buffer, with room after them for what the branch reads next (`room_after`: an agent's tool reply, written
in place). Without it (rows sharing a document) the branches stay as they are and the batch holds a copy.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from .hf.cache import BranchCache
from .kinds import branch_layers
from .model.positions import positions_left
from .sampler import Decodable, Samples, SamplingOptions, check_generator, decode, sample


class Growing(Decodable, Protocol):
    """A branch a ragged batch grows by one turn (`keep=True`: `longstraw.branch.Branch`): it hands its own state
    to the batch and takes its row back."""

    def lend_state(self) -> BranchCache: ...

    def adopt_turn(self, layers: list, turn: torch.Tensor, block: int) -> None: ...

    def sample(self, max_new_tokens: int, **options) -> Samples: ...


def _growing(b: Decodable) -> Growing:
    """`b` as a branch that grows (`keep=True`): a `PromptState` does not."""
    if not all(callable(getattr(b, name, None)) for name in ("lend_state", "adopt_turn", "sample")):
        raise TypeError(f"keep=True grows branches (longstraw.branch.Branch); got {type(b).__name__}")
    return b  # type: ignore[return-value]  # checked above


def stackable(branches: Sequence[Decodable]) -> bool:
    """Whether `sample_branches` decodes `branches` in one batch: one prompt state, on one process, and every layer of
    a kind `stack_layers` serves."""
    if not branches:
        return False
    state = _prompt(branches[0])
    if any(_prompt(b) is not state for b in branches) or getattr(state, "group", None) is not None:
        return False
    if _reads_position_from_cache(state.parts.decoder):
        return False
    probe = branches[0].branch_cache(1)
    return all(layer.stackable() for layer in branch_layers(probe))


#: per decoder, whether it reads positions from the cache (a module walk once per model, not per decode)
_POSITION_FROM_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reads_position_from_cache(decoder) -> bool:
    """Whether an attention module takes its queries' positions from the cache's length, one for the whole batch
    (transformers 5.24: Llama 4's temperature tuning of its layers without RoPE): rows at different positions would
    get the first row's. Looked up once per decoder."""
    known = _POSITION_FROM_CACHE.get(decoder)
    if known is None:
        known = any(
            getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True) for m in decoder.modules()
        )
        _POSITION_FROM_CACHE[decoder] = known
    return known


def _prompt(b: Decodable) -> Decodable:
    return getattr(b, "state", b)  # a Branch's prompt state, or the prompt state itself


def stack_layers(layers: list, rows: Sequence[int], room: int = 0):
    """One branch layer over the rows of `layers` (the same decoder layer of several branch caches, `rows[i]` rows
    each), with `room` more columns where it grows: the layer's own `stack_rows` (attention: own K/V right-aligned and
    padded in one buffer; recurrent: states concatenated)."""
    return layers[0].stack_rows(layers, rows, room)


@torch.no_grad()
def sample_branches(
    branches: Sequence[Decodable],
    nums: Sequence[int] | int,
    max_new_tokens: int | Sequence[int],
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids=(),
    generator: torch.Generator | None | Sequence[torch.Generator | None] = None,
    allowed_token_ids=None,
    keep: bool = False,
    room_after: int = 0,
) -> list[Samples]:
    """`nums[i]` responses after each of `branches` (`Branch`es of one `PromptState`, or the state itself), decoded
    in one batch when `stackable(branches)`, else one branch after another; `longstraw.sampler.sample`'s options.
    `max_new_tokens`: one cap, or one per branch; `generator`: one for all, or one per branch (each branch's rows
    draw from it together, as `sample(branch, nums[i], ...)` does).

    `keep`: one sequence per branch (`nums` all 1) whose tokens become part of its `Branch`, as `Branch.sample`
    leaves them (`max_new_tokens` cut to the positions the model has left). The branches hand their own state to the
    batch (each copied into it once, the branch's copy freed as it goes, so the batch never holds a branch twice) and
    take their row back at the end: a branch whose batch fails is lost (using it says so). `room_after`: columns of
    room each branch keeps after its turn, so that what comes next (an agent's tool reply) is written in place."""
    n = len(branches)
    counts = [nums] * n if isinstance(nums, int) else list(nums)
    caps = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    gens = list(generator) if isinstance(generator, Sequence) else [generator] * n
    if len(counts) != n or len(caps) != n or len(gens) != n:
        raise ValueError(f"nums, max_new_tokens and generator need one entry per branch ({n})")
    if keep and any(c != 1 for c in counts):
        raise ValueError("keep=True grows each branch by one sequence: nums must be 1 per branch")
    if n == 0:
        return []
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids)
    options = SamplingOptions(temperature, top_p, top_k, stop_token_ids, allowed_token_ids)
    if not stackable(branches):  # one branch after another
        if keep:
            return [
                _growing(b).sample(c, generator=g, allowed_token_ids=allowed_token_ids, **kw)  # type: ignore[arg-type]
                for b, c, g in zip(branches, caps, gens)
            ]
        return [
            sample(b, k, c, generator=g, allowed_token_ids=allowed_token_ids, **kw)  # type: ignore[arg-type]
            for b, k, c, g in zip(branches, counts, caps, gens)
        ]
    parts = branches[0].parts
    vocab = parts.config.vocab_size
    if keep:
        caps = [
            positions_left(parts.config, b.prompt_length, c, f"branch {i}")
            for i, (b, c) in enumerate(zip(branches, caps))
        ]
    for k, c in zip(counts, caps):
        options.check(k, c, vocab)
    device = branches[0].last_token.device
    for g in gens:
        check_generator(g, device)
    after = max(0, int(room_after))
    if keep:  # the branches' own caches, handed to the batch
        caches = [_growing(b).lend_state() for b in branches]
    else:
        caches = [b.branch_cache(k) for b, k in zip(branches, counts)]
    block = caches[0].block
    per_branch: list[list] = [list(own.layers) for own in caches]
    del caches
    layers = []
    for i in range(len(per_branch[0])):
        layers.append(stack_layers([own[i] for own in per_branch], counts, room=max(caps) + after))
        for own in per_branch:  # the batch holds this layer now: the branch's copy goes before the next is stacked
            own[i] = None
    for layer in layers:  # sliding-window layers keep only the own K/V later steps can read
        layer.start_decoding()
    cache = BranchCache(layers, block=block)
    row_of = [i for i, k in enumerate(counts) for _ in range(k)]
    step_input = torch.cat([b.last_token.expand(k) for b, k in zip(branches, counts)])[:, None]
    start = torch.tensor([branches[i].prompt_length - 1 for i in row_of], device=device)
    taken: dict[int, list] = {}

    decoding = [len(row_of)]

    def leave(rows: torch.Tensor, local: torch.Tensor) -> None:
        """Rows leaving the batch take their state out of it: the last ones keep their rows of the batch's buffer
        (`BranchLayer.split_rows`), earlier ones a copy of theirs (the batch moves its remaining rows over theirs)."""
        js = local.tolist()
        if len(js) == decoding[0]:
            parts = [layer.split_rows(js) for layer in branch_layers(cache)]
            for n, r in enumerate(rows.tolist()):
                taken[r] = [part[n] for part in parts]
        else:
            for r, j in zip(rows.tolist(), js):
                taken[r] = [layer.take_row(j, room=after) for layer in branch_layers(cache)]
        decoding[0] -= len(js)

    out = decode(
        parts,
        cache,
        step_input,
        start,
        [caps[i] for i in row_of],
        options,
        generator=[gens[i] for i in row_of],
        leave=leave if keep else None,
        after=after,
    )
    results, r = [], 0
    for k in counts:
        results.append(Samples(out.tokens[r : r + k], out.logprobs[r : r + k], out.truncated[r : r + k]))
        r += k
    if keep:
        for i, b in enumerate(branches):
            _growing(b).adopt_turn(taken[i], out.tokens[i], cache.block)
    return results
