"""Shared-prefix sampling: G responses decoded together from ONE captured prompt state.

All G sequences read the same durable prompt state: full-attention layers fold the G queries into
one row block against the single prompt K/V (never copied G times), linear-attention layers start
from the captured conv/recurrent state viewed G times (`expand`, no copy). Each sequence keeps only
its own new K/V or states, and leaves the batch when it emits a stop token.

Log-probs returned are the "old" scores of GRPO: log softmax(logits / temperature) of each chosen
token over the whole vocabulary (as TRL computes them), whatever top-k / top-p filtering restricted
sampling to; `temperature=0` is greedy decoding with log-probs at temperature 1.

Memory: durable state + G · (own K/V per layer of up to max_new_tokens tokens) + one step's
activations for the active rows; O(G · V) for one step's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .hf.cache import BranchCache
from .hf.decoder import run_decoder
from .hf.parts import ModelParts
from .kinds import branch_layers
from .model.positions import check_positions
from .ops.logprobs import chunked_logprobs


class Decodable(Protocol):
    """Where decoding starts (`longstraw.prompt_state.PromptState`, a `longstraw.branch.Branch` of one, the
    context-parallel state): the model's parts, the positions before the next token, the held-back last token `[1]`,
    and a cache of `batch` rows over it."""

    parts: ModelParts
    last_token: torch.Tensor

    @property
    def prompt_length(self) -> int: ...

    def branch_cache(self, batch: int = 1) -> BranchCache: ...


#: token ids as callers pass them: a 1-D (or `[1, T]`) integer tensor, or a sequence of ints
TokenIds = torch.Tensor | Sequence[int]


@dataclass
class Samples:
    """G sampled responses: `tokens[i]` 1-D LongTensor (its stop token included, no padding),
    `logprobs[i]` 1-D float32 old log-probs of those tokens, `truncated` bool `[G]` (no stop token
    within `max_new_tokens`)."""

    tokens: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    truncated: torch.Tensor


def filter_logits(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of logits `[B, V]` (removed entries set to −inf), as
    transformers' logits processors do; at least one token always stays."""
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the tokens before it already cover top_p
        drop = (probs.cumsum(-1) - probs) > top_p
        drop[..., 0] = False
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return z


@dataclass(frozen=True)
class SamplingOptions:
    """How a decode chooses its tokens: what every sampling call takes as keywords (`sample`, `PromptState.sample`,
    `Branch.sample`, `longstraw.ragged.sample_branches`) and hands down as one object. `temperature` 0: greedy;
    `top_k` 0 and `top_p` 1: no filtering (transformers' order: top-k, then top-p); `stop_token_ids`: tokens that end
    a sequence (kept in it); `allowed_token_ids`: the tokens the choice is restricted to (None: all), the returned
    log-probs staying those of the unrestricted distribution (the policy being trained)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: Sequence[int] = ()
    allowed_token_ids: Sequence[int] | torch.Tensor | None = None

    def check(self, num: int, max_new_tokens: int, vocab: int) -> None:
        """Refuse options (and a count or length) a decode cannot run with, naming them."""
        if num < 1:
            raise ValueError(f"num must be >= 1; got {num}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0 or self.top_k > vocab:
            raise ValueError(f"top_k must be in [0, vocab size {vocab}]; got {self.top_k}")

    def banned(self, vocab: int, device) -> torch.Tensor | None:
        """`[V]` bool, True for the tokens the decode may not choose (None: all allowed)."""
        if self.allowed_token_ids is None:
            return None
        allowed = torch.as_tensor(list(self.allowed_token_ids), dtype=torch.long, device=device)
        if allowed.numel() == 0 or int(allowed.min()) < 0 or int(allowed.max()) >= vocab:
            raise ValueError(f"allowed_token_ids must be non-empty token ids in [0, {vocab})")
        banned = torch.ones(vocab, dtype=torch.bool, device=device)
        banned[allowed] = False
        return banned

    def fields(self, max_new_tokens, generator: torch.Generator | None) -> dict:
        """What every rank of a collective decode must agree on (`Group.agree` fields): the options, the length and
        the generator's state (the global one when `generator` is None)."""
        allowed = self.allowed_token_ids
        return {
            "max_new_tokens": max_new_tokens if isinstance(max_new_tokens, int) else repr(max_new_tokens),
            "temperature": repr(self.temperature),
            "top_p": repr(self.top_p),
            "top_k": repr(self.top_k),
            "stop_token_ids": repr(sorted(int(t) for t in self.stop_token_ids)),
            "allowed_token_ids": repr(None if allowed is None else sorted(int(t) for t in allowed)),
            "generator state": generator.get_state() if generator is not None else torch.get_rng_state(),
        }


@torch.no_grad()
def as_ids(ids, name: str, vocab_size: int, device, allow_empty: bool = False) -> torch.Tensor:
    """Validate token ids: a 1-D (or [1, T]) integer tensor of known tokens → 1-D LongTensor on device (empty only
    with `allow_empty`)."""
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D or [1, T]; got shape {tuple(ids.shape)}")
    if ids.numel() == 0 and allow_empty:  # `[]` included, whatever dtype `as_tensor` gave it
        return torch.zeros(0, dtype=torch.long, device=device)
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"{name} must hold integer token ids; got {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} holds token ids outside [0, {vocab_size}): min {lo}, max {hi}")
    return ids.to(device=device, dtype=torch.long)


@dataclass
class Replay:
    """One replayed branch, float32, with grad.

    `logprobs[t]` = log p(response[t] | prompt, response[:t]) `[R]` under the logits divided by the
    temperature; `entropy[t]` the entropy of that next-token distribution `[R]`.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor


def replay_tokens(
    parts,
    last_token: torch.Tensor,
    start: int,
    response: torch.Tensor,
    cache,
    temperature: float,
    checkpoint_layers: bool,
    skip: int = 0,
) -> Replay:
    """The forward of a replay: `[last_token] + response[:-1]` `[1 + R − 1]` at positions `start, start + 1, ...`
    through `cache` (the state a replay reads: a prompt's, a branch's), with autograd where it is enabled; the
    log-probs and entropies of `response[skip:]` `[R − skip]` (the first `skip` tokens are a prefix read in the same
    forward). The LM head runs in chunks (`longstraw.ops.logprobs`): no `[R, vocab]` tensor is saved."""
    inputs = torch.cat([last_token, response[:-1]])
    positions = torch.arange(start, start + inputs.numel(), device=inputs.device)
    hidden = run_decoder(parts, inputs[None], positions, cache, checkpoint_layers=checkpoint_layers)
    logprobs, entropy = chunked_logprobs(
        hidden[0, skip:],
        parts.lm_head,
        response[skip:],
        temperature=temperature,
        softcap=parts.final_logit_softcapping,
        scale=parts.logit_scale,
    )
    return Replay(logprobs=logprobs, entropy=entropy)


def check_length(cfg, total: int) -> None:
    """Refuse prompt + response past the model's positions (`longstraw.model.positions.check_positions`)."""
    check_positions(cfg, total)


def sample(
    state: Decodable,
    num: int,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_token_ids=(),
    generator: torch.Generator | None = None,
    allowed_token_ids=None,
    prefix_ids=None,
) -> Samples:
    """Decode `num` responses of at most `max_new_tokens` tokens from `state` (a `PromptState`, or a `Branch`: after
    what it added), see the module doc.

    `allowed_token_ids`: restrict the choice (sampling or greedy) to these tokens; the returned
    log-probs stay those of the unrestricted distribution (the policy being trained).
    `prefix_ids` `[L]`: tokens already in the response (earlier turns, tool output): read once into
    every row's own state, then decoding continues after them; returned tokens exclude the prefix.
    """
    parts = state.parts
    # the longest response's positions, refused past the model's as `replay` refuses them
    check_length(parts.config, state.prompt_length + (0 if prefix_ids is None else len(prefix_ids)) + max_new_tokens)
    options = SamplingOptions(temperature, top_p, top_k, stop_token_ids, allowed_token_ids)
    options.check(num, max_new_tokens, parts.config.vocab_size)
    device = state.last_token.device
    check_generator(generator, device)
    cache = state.branch_cache(num)
    for layer in branch_layers(cache):  # sliding-window layers keep only the own K/V later steps can read
        layer.start_decoding()
    step_input = state.last_token.expand(num)[:, None]
    start = state.prompt_length - 1
    if prefix_ids is not None and len(prefix_ids) > 0:
        prefix = torch.as_tensor(prefix_ids, dtype=torch.long, device=device).reshape(-1)
        read = torch.cat([state.last_token, prefix[:-1]])  # the prefix's own K/V or states, batch of num
        run_decoder(parts, read.expand(num, -1), torch.arange(start, start + read.numel(), device=device), cache)
        step_input = prefix[-1:].expand(num)[:, None]
        start += prefix.numel()
    return decode(parts, cache, step_input, start, max_new_tokens, options, generator=generator)


def check_generator(generator: torch.Generator | None, device) -> None:
    if generator is not None and generator.device.type != torch.device(device).type:
        raise ValueError(
            f"the sampling generator lives on {generator.device}, the model on {device}: "
            f"create it with torch.Generator(device={str(device)!r})"
        )


@torch.no_grad()
def decode(
    parts,
    cache,
    step_input: torch.Tensor,
    start: int | torch.Tensor,
    max_new_tokens: int | Sequence[int],
    options: SamplingOptions,
    *,
    generator: torch.Generator | None | Sequence[torch.Generator | None] = None,
    leave=None,
    after: int = 0,
) -> Samples:
    """The decoding loop over a branch cache of B rows: `step_input` `[B, 1]` is each row's last token, not yet run,
    at position `start` (an int, or `[B]` per row: a ragged batch, `longstraw.ragged`); each step runs it, chooses the
    next token and appends it. Rows leave the cache's batch when they stop or reach their `max_new_tokens` (an int, or
    one per row) (`cache.batch_select_indices`). `generator`: one for all rows, or one per row (rows of one generator
    draw together, in row order, as they would alone). `leave(rows, local)`: called before rows leave the batch (and
    for the last ones at the end) with their original indices `[n]` and their indices in the cache's batch now, so
    that a caller can keep their state. What the rows keep of their own afterwards is the cache's. The cache's own
    K/V grow in place with room for the tokens still to come and `after` more (`BranchCache.reserve`)."""
    num = step_input.shape[0]
    device = step_input.device
    stop = torch.tensor(sorted(set(int(t) for t in options.stop_token_ids)), dtype=torch.long, device=device)
    banned = options.banned(parts.config.vocab_size, device)
    temperature, top_p, top_k = options.temperature, options.top_p, options.top_k
    caps = None
    if not isinstance(max_new_tokens, int):
        caps = torch.as_tensor(list(max_new_tokens), dtype=torch.long, device=device)
        if caps.shape != (num,) or int(caps.min()) < 1:
            raise ValueError(f"max_new_tokens per row must be {num} values >= 1; got {list(max_new_tokens)}")
        max_new_tokens = int(caps.max())
    gens = list(generator) if isinstance(generator, Sequence) else None
    if gens is not None and len(gens) != num:
        raise ValueError(f"generator per row: {num} expected, got {len(gens)}")
    active = torch.arange(num, device=device)  # original row of each row still decoding
    tokens = torch.zeros(num, max_new_tokens, dtype=torch.long, device=device)
    logps = torch.zeros(num, max_new_tokens, device=device)
    lengths = torch.full((num,), max_new_tokens, dtype=torch.long, device=device)
    truncated = torch.ones(num, dtype=torch.bool, device=device)
    if isinstance(start, torch.Tensor):  # per row: positions `[B, 1]` per step
        row_start = start.to(device=device, dtype=torch.long).reshape(num)
        steps = None
    else:
        row_start = None
        steps = torch.arange(start, start + max_new_tokens, device=device)  # positions, made once (no copy per token)
    for t in range(max_new_tokens):
        if row_start is None:
            assert steps is not None
            positions = steps[t : t + 1]
        else:
            positions = (row_start[active] + t)[:, None]
        cache.reserve(max_new_tokens - t - 1 + after)  # the own K/V grow in place (`BranchCache.reserve`)
        hidden = run_decoder(parts, step_input, positions, cache)[:, -1]
        z = parts.logits(hidden).float()  # this step's own tensor: scaled in place
        if temperature not in (0, 1):
            z.div_(temperature)
        # the distribution's weights e^{z − max} (unnormalised) and log Σ: a pass for the max, one for the weights
        # and one for their sum, where a log-softmax and its exp took four and a float64 copy
        m = z.amax(-1, keepdim=True)
        weights = torch.sub(z, m).exp_()
        lse = m.squeeze(-1) + weights.sum(-1).log_()
        if temperature == 0:
            chosen = (z if banned is None else z.masked_fill(banned, float("-inf"))).argmax(-1)
        else:
            if top_k or top_p < 1.0:
                masked = z if banned is None else z.masked_fill(banned, float("-inf"))
                weights = torch.softmax(filter_logits(masked, top_k, top_p), -1)
            elif banned is not None:
                weights.masked_fill_(banned, 0.0)
            chosen = _draw(weights, generator if gens is None else [gens[i] for i in active.tolist()])
        tokens[active, t] = chosen
        logps[active, t] = z.gather(-1, chosen[:, None]).squeeze(-1) - lse
        if not stop.numel() and caps is None:  # nothing can stop a row: no check, no host synchronisation per token
            step_input = chosen[:, None]
            continue
        done = torch.isin(chosen, stop)
        capped = torch.zeros_like(done) if caps is None else (caps[active] == t + 1) & ~done
        if done.any() or capped.any():
            finished = active[done]
            lengths[finished] = t + 1
            truncated[finished] = False
            lengths[active[capped]] = t + 1
            out = done | capped
            if leave is not None:
                leave(active[out], out.nonzero().squeeze(-1))
            keep = (~out).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            active, chosen = active[keep], chosen[keep]
            cache.batch_select_indices(keep)
        step_input = chosen[:, None]
    else:
        if leave is not None:
            leave(active, torch.arange(active.numel(), device=device))
    cache.reserve(0)
    return Samples(
        tokens=[tokens[i, : lengths[i]].clone() for i in range(num)],
        logprobs=[logps[i, : lengths[i]].clone() for i in range(num)],
        truncated=truncated.cpu(),
    )


#: tokens per block of the two-level draw (`_inverse_transform`): the block's cumulative sum is the only one taken
DRAW_BLOCK = 2048


def _draw(weights: torch.Tensor, generator, block: int = DRAW_BLOCK) -> torch.Tensor:
    """One token per row of `weights` `[B, V]` (≥ 0, each row's sum > 0; a token of weight 0 is never drawn), token
    i with probability weights[i] / Σ weights: with one generator (or None) for all rows, or a list, one per row
    (rows of the same generator draw together, in row order). By inverse transform: one uniform number per row from
    its generator, the first token whose cumulative weight passes it (`_inverse_transform`); `torch.multinomial`
    draws an exponential number per token instead (`reference_draw`), ~1/3 of a 64-row decode step on SmolLM2's
    vocabulary."""
    u = torch.empty(weights.shape[0], 1, dtype=torch.float64, device=weights.device)
    if not isinstance(generator, list):
        u.uniform_(generator=generator)
    else:
        order: dict[int, list[int]] = {}
        for i, g in enumerate(generator):
            order.setdefault(id(g), []).append(i)
        for rows in order.values():
            idx = torch.tensor(rows, device=weights.device)
            u[idx] = torch.rand(len(rows), 1, generator=generator[rows[0]], dtype=torch.float64, device=u.device)
    return _inverse_transform(weights, u, block)


def _block_sums(weights: torch.Tensor, block: int) -> torch.Tensor:
    """`[B, ⌈V / block⌉]` float64 sums of consecutive `block` tokens (the last block shorter), summed in the
    weights' dtype (no float64 copy of the `[B, V]` weights)."""
    b, v = weights.shape
    full = v // block
    parts = [weights[:, : full * block].reshape(b, full, block).sum(-1)] if full else []
    if v > full * block:
        parts.append(weights[:, full * block :].sum(-1, keepdim=True))
    return torch.cat(parts, -1).to(torch.float64)


def _inverse_transform(weights: torch.Tensor, u: torch.Tensor, block: int = DRAW_BLOCK) -> torch.Tensor:
    """`[B]` tokens drawn from the rows of `weights` `[B, V]` at the uniform numbers `u` `[B, 1]` (float64) by inverse
    transform, in two levels: the block whose cumulative sum first passes u · total (float64 over the block sums),
    then the token inside it whose cumulative weight (float64, over that block alone) first passes what is left. One
    pass over the weights (the block sums) instead of a float64 copy and a cumulative sum of all of them. A remainder
    that rounding puts at or past a block's own total takes the block's last token of positive weight."""
    b, v = weights.shape
    cdf = _block_sums(weights, block).cumsum_(-1)
    x = u * cdf[:, -1:]
    k = torch.searchsorted(cdf, x, right=True)
    over = k >= cdf.shape[1]  # u · total rounded up to the total: the last block of positive weight
    if bool(over.any()):
        last = (
            cdf.shape[1]
            - 1
            - (cdf.diff(dim=-1, prepend=torch.zeros_like(cdf[:, :1])) > 0)
            .flip(-1)
            .to(torch.uint8)
            .argmax(-1, keepdim=True)
        )
        k = torch.where(over, last, k)
    x = x - torch.where(k > 0, cdf.gather(1, (k - 1).clamp(min=0)), torch.zeros_like(x))
    cols = k * block + torch.arange(block, device=weights.device)  # `[B, block]` the chosen block's tokens
    inner = weights.gather(1, cols.clamp(max=v - 1)).masked_fill_(cols >= v, 0).to(torch.float64)
    j = torch.searchsorted(inner.cumsum(-1), x, right=True)
    past = j >= block
    if bool(past.any()):
        last = block - 1 - (inner > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
        j = torch.where(past, last, j)
    return (k * block + j).squeeze(-1)


def reference_draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`[B]` tokens drawn from the rows of `weights` by `torch.multinomial`: the plain version `_draw` is held to."""
    return torch.multinomial(weights, 1, generator=generator).squeeze(-1)
