"""Ragged decoding: one decode batch over several branches of one prompt, each with its own length.

Branches of one captured prompt grow apart: the rows of a step that share a document each read their own question
(`longstraw.train.sharing`), the G trajectories of an agent each add their own turns and tool output
(`longstraw.agent`). Decoding them one branch after another reads the model's weights and the prompt's K/V once per
branch and token; `sample_branches` decodes them in one batch, reading both once per token for all of them.

The branches' caches are stacked layer by layer (`stack_layers`): attention layers hold the rows' own K/V
right-aligned with per-row padding (`AttentionBranchLayer.row_pad`) and attend through
`longstraw.ops.ragged_attention` (the prompt part read once for the batch); recurrent layers (linear attention, SSMs,
short convolutions) stack their per-row states; layers without a mixer have nothing to stack. Every row keeps its own
positions (`[B, 1]` per step). Other layer kinds (latent attention, compressed attention), context-parallel
branches and a model whose attention reads its positions from the cache (Llama 4's layers without RoPE) are not
stacked: `stackable` says so, and `sample_branches` then decodes the branches one after another.

`keep=True` (one sequence per branch, an agent's turn): each row's state is taken back out of the batch when it
leaves it (`take_row`), so the sampled turn becomes part of its branch exactly as `Branch.sample` leaves it.

Memory: the branches' own states stacked (a copy of each branch's own K/V, padded to the longest) + B rows of
sampled own K/V; the prompt state is read, never copied.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from .hf.cache import BranchCache, snapshot
from .kinds import AttentionBranchLayer, HybridBranchLayer, MixerlessBranchLayer, RecurrentBranchLayer
from .model.positions import positions_left
from .sampler import Samples, banned_tokens, check_generator, check_sampling, decode, sample

if TYPE_CHECKING:
    from .branch import Branch
    from .prompt_state import PromptState


def _attention_ok(layer) -> bool:
    return not layer.is_collective and layer.carried_k is None


def layer_stackable(layer) -> bool:
    """Whether `stack_layers` can batch this branch layer with others of its kind."""
    kind = type(layer)
    if kind in (AttentionBranchLayer, HybridBranchLayer):
        return _attention_ok(layer)
    return kind in (RecurrentBranchLayer, MixerlessBranchLayer)


def stackable(branches: Sequence[Branch | PromptState]) -> bool:
    """Whether `sample_branches` decodes `branches` in one batch: one prompt state, on one process, and every layer of
    a kind `stack_layers` serves."""
    if not branches:
        return False
    state = _prompt(branches[0])
    if any(_prompt(b) is not state for b in branches) or getattr(state, "group", None) is not None:
        return False
    if _reads_position_from_cache(state._parts.decoder):
        return False
    probe = branches[0]._cache(1)
    return all(layer_stackable(layer) for layer in probe.layers)


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


def _prompt(b) -> PromptState:
    return getattr(b, "state", b)  # a Branch's prompt state, or the prompt state itself


def _cat_states(states: list[dict], name: str) -> dict:
    """Per state index, the rows' states concatenated along the batch (None where every row has none)."""
    out: dict[int, torch.Tensor | None] = {}
    for i in states[0]:
        parts = [s[i] for s in states]
        if all(p is None for p in parts):
            out[i] = None
        elif any(p is None for p in parts):
            raise ValueError(f"the branches' {name} {i} is set in some rows and not in others")
        else:
            out[i] = torch.cat(parts)
    return out


def stack_layers(layers: list, rows: Sequence[int]) -> object:
    """One branch layer over the rows of `layers` (the same decoder layer of several branch caches, `rows[i]` rows
    each): own K/V right-aligned and padded (`row_pad`, `row_offset`), recurrent states concatenated."""
    first = layers[0]
    if isinstance(first, MixerlessBranchLayer):
        return first
    new = snapshot(first)
    if isinstance(first, RecurrentBranchLayer):  # a hybrid layer is both
        for name in ("conv_states", "recurrent_states"):
            setattr(new, name, _cat_states([getattr(layer, name) for layer in layers], name))
        new.has_previous_state = dict(first.has_previous_state)
    if isinstance(first, AttentionBranchLayer):
        if any(not _same_part(layer.prompt_k, first.prompt_k) for layer in layers):
            raise ValueError("stack_layers: the branches read different prompt states")
        width = max(_own_width(layer) for layer in layers)
        like = next((layer for layer in layers if layer.keys is not None), None)
        keys, values, pads, offsets = [], [], [], []
        for layer, n in zip(layers, rows):
            own = _own_width(layer)
            pads += [width - own] * n
            offsets += [layer.own_offset] * n
            if like is None:
                continue
            if layer.keys is None or layer.values is None:  # no own keys yet: all padding
                k = like.keys.new_zeros(n, like.keys.shape[1], width, like.keys.shape[3])
                v = like.values.new_zeros(n, like.values.shape[1], width, like.values.shape[3])
            else:
                k = layer.keys.expand(n, *layer.keys.shape[1:])
                v = layer.values.expand(n, *layer.values.shape[1:])
                k = torch.nn.functional.pad(k, (0, 0, width - own, 0))
                v = torch.nn.functional.pad(v, (0, 0, width - own, 0))
            keys.append(k)
            values.append(v)
        new.keys = torch.cat(keys) if keys else None
        new.values = torch.cat(values) if values else None
        new.row_pad, new.row_offset, new.row_layout = pads, offsets, None
    return new


def _same_part(a, b) -> bool:
    """Whether two prompt parts are the same keys (views of one state's buffer are made per branch)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    return a is b


def _own_width(layer) -> int:
    return 0 if layer.keys is None else layer.keys.shape[-2]


def take_row(layer, j: int):
    """Row `j` of a stacked branch layer as a branch layer of its own (batch 1): the inverse of `stack_layers`."""
    if isinstance(layer, MixerlessBranchLayer):
        return layer
    new = snapshot(layer)
    if isinstance(layer, RecurrentBranchLayer):
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name)
            setattr(new, name, {i: None if t is None else t[j : j + 1] for i, t in states.items()})
        new.has_previous_state = dict(layer.has_previous_state)
    if isinstance(layer, AttentionBranchLayer):
        if layer.row_pad is not None and layer.row_offset is not None:
            p = layer.row_pad[j]
            if layer.keys is not None and layer.values is not None:
                new.keys, new.values = layer.keys[j : j + 1, :, p:], layer.values[j : j + 1, :, p:]
                if new.keys.shape[-2] == 0:
                    new.keys = new.values = None
            new.own_offset = layer.row_offset[j]
        elif layer.keys is not None and layer.values is not None:
            new.keys, new.values = layer.keys[j : j + 1], layer.values[j : j + 1]
        new.row_pad = new.row_offset = new.row_layout = None
    return new


@torch.no_grad()
def sample_branches(
    branches: Sequence[Branch | PromptState],
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
) -> list[Samples]:
    """`nums[i]` responses after each of `branches` (`Branch`es of one `PromptState`, or the state itself), decoded
    in one batch when `stackable(branches)`, else one branch after another; `longstraw.sampler.sample`'s options.
    `max_new_tokens`: one cap, or one per branch; `generator`: one for all, or one per branch (each branch's rows
    draw from it together, as `sample(branch, nums[i], ...)` does).

    `keep`: one sequence per branch (`nums` all 1) whose tokens become part of its `Branch`, as `Branch.sample`
    leaves them (`max_new_tokens` cut to the positions the model has left)."""
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
    if not stackable(branches):  # one branch after another
        if keep:
            return [
                cast("Branch", b).sample(c, generator=g, allowed_token_ids=allowed_token_ids, **kw)  # type: ignore[arg-type]
                for b, c, g in zip(branches, caps, gens)
            ]
        return [
            sample(b, k, c, generator=g, allowed_token_ids=allowed_token_ids, **kw)  # type: ignore[arg-type]
            for b, k, c, g in zip(branches, counts, caps, gens)
        ]
    parts = branches[0]._parts
    vocab = parts.config.vocab_size
    if keep:
        caps = [
            positions_left(parts.config, b.prompt_length, c, f"branch {i}")
            for i, (b, c) in enumerate(zip(branches, caps))
        ]
    for k, c in zip(counts, caps):
        check_sampling(k, c, temperature, top_p, top_k, vocab)
    device = branches[0].last_token.device
    for g in gens:
        check_generator(g, device)
    caches = [b._cache(k) for b, k in zip(branches, counts)]
    layers = [stack_layers([c.layers[i] for c in caches], counts) for i in range(len(caches[0].layers))]
    for layer in layers:  # sliding-window layers keep only the own K/V later steps can read
        if isinstance(layer, AttentionBranchLayer):
            layer.trim = True
    cache = BranchCache(layers, block=caches[0].block)
    row_of = [i for i, k in enumerate(counts) for _ in range(k)]
    step_input = torch.cat([b.last_token.expand(k) for b, k in zip(branches, counts)])[:, None]
    start = torch.tensor([branches[i].prompt_length - 1 for i in row_of], device=device)
    taken: dict[int, list] = {}

    def leave(rows: torch.Tensor, local: torch.Tensor) -> None:
        for r, j in zip(rows.tolist(), local.tolist()):
            taken[r] = [take_row(layer, j) for layer in cache.layers]

    out = decode(
        parts,
        cache,
        step_input,
        start,
        [caps[i] for i in row_of],
        generator=[gens[i] for i in row_of],
        banned=banned_tokens(allowed_token_ids, vocab, device),
        leave=leave if keep else None,
        **kw,
    )
    results, r = [], 0
    for k in counts:
        results.append(Samples(out.tokens[r : r + k], out.logprobs[r : r + k], out.truncated[r : r + k]))
        r += k
    if keep:
        for i, b in enumerate(branches):
            cast("Branch", b).adopt_turn(taken[i], out.tokens[i], cache.block)
    return results
