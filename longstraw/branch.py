"""Branch: one trajectory's own state on top of a captured prompt, grown turn by turn without autograd.

An agent's context piles up after the prompt: tool output, observations, the policy's own turns. `PromptState.fork()`
gives each of the G trajectories of a prompt a `Branch`: one branch cache (batch 1) that reads the prompt's durable
state (shared by every branch of the prompt, never copied or written) and keeps only what its trajectory adds to
itself, exactly what a sampled response keeps (per layer the own K/V, recurrent and convolution state, latents,
compressed streams). Every layer kind the prompt serves, the branch serves: it is the sampler's own branch.

- `extend(tokens)` runs tokens the environment returns through the decoder without autograd, `chunk_size` at a time,
  as capture runs the prompt;
- `sample(max_new_tokens, ...)` decodes the policy's next turn from the branch; the sampled tokens stay in it;
- `replay(response_ids)` runs a response after the branch with autograd, reading the branch as constants (the detached
  replay of the prompt `prompt + added`), and leaves the branch as it was.

A branch also stands where a `PromptState` is read (`prompt_length`, `_cache(batch)`): `longstraw.sampler.sample(branch,
G, ...)` decodes G sequences after it, its own state repeated for them as views (`batch_repeat_interleave`), and
`longstraw.replay.segments.replay_segments` replays after it. So rows sharing a document extend one branch each by their
question, once, and sample and replay from it (`longstraw.train.sharing`).

The last token of the trajectory so far is held back (`last_token`), as a captured prompt holds back its last token:
whatever comes next (a sampled turn, tool output) starts by running it. Work per turn is that turn's tokens and the
observation after it, never the trajectory again.

Memory: the prompt's state (shared) + the branch's own growth, O(T) per attention layer for the T tokens the
trajectory added (O(window) for sliding-window layers, O(1) for recurrent ones) + one chunk's activations.

Context parallelism: a branch of a prompt captured over a process group (`capture(..., group=pg)`) is a collective,
as that state's `sample` is. Every rank grows the same trajectory (the same tokens, the same generator), the
attention against the prompt split over the ranks' slices and the branch's own growth held alike on every rank;
`extend` and `sample` refuse, on every rank, arguments that differ between ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, cast

import torch

from .hf.cache import BranchCache, snapshot
from .hf.decoder import run_decoder
from .hf.parts import ModelParts
from .kinds.base import BranchLayer, branch_layers
from .model.positions import check_positions, positions_left
from .sampler import (
    Replay,
    Samples,
    SamplingOptions,
    TokenIds,
    as_ids,
    check_generator,
    decode,
    replay_tokens,
)


class PromptView(Protocol):
    """What a branch reads of the prompt state it grows on (`longstraw.prompt_state.PromptState`, the
    context-parallel state): never written."""

    parts: ModelParts
    last_token: torch.Tensor
    chunk_size: int
    prompt_grad: str

    @property
    def prompt_length(self) -> int: ...

    def branch_cache(self, batch: int = 1) -> BranchCache: ...

    def replay_cache(self, branch: Branch | None = None, batch: int = 1) -> BranchCache: ...

    def checked_response(
        self, response_ids: TokenIds, checkpoint_layers: bool, length: int | None = None
    ) -> torch.Tensor: ...

    def checked_batch(
        self, rows: Sequence[TokenIds], checkpoint_layers: bool, length: int | None = None
    ) -> list[torch.Tensor]: ...

    @property
    def batches_replays(self) -> bool: ...

    def live_layers(self) -> list: ...


class Branch:
    """The growing state of one trajectory forked from a `PromptState` (see the module doc).

    `length`: the trajectory's positions so far (prompt included); `added`: the tokens it added after the prompt.
    Free it with `release()` or as a context manager; the prompt state stays.
    """

    def __init__(self, state: PromptView, chunk_size: int | None = None):
        self.state = state
        #: the process group of a context-parallel prompt state (`longstraw.distributed.Group`), else None
        self.group = getattr(state, "group", None)
        self.parts = state.parts
        self.chunk_size = chunk_size or state.chunk_size
        self._own: BranchCache | None = state.branch_cache(1)
        for layer in branch_layers(self._own):  # sliding-window layers keep only the own K/V later tokens can read
            layer.start_decoding()
        self.last_token = state.last_token.clone()
        self.length = state.prompt_length
        self.added = 0
        #: why the branch holds no state (None: released, or it holds one)
        self._gone: str | None = None

    # ------------------------------------------------------------------ bookkeeping
    def _live(self):
        if self._own is None:
            raise RuntimeError(f"this Branch {getattr(self, '_gone', None) or 'was released'}")
        self.state.live_layers()  # the prompt state must still be held
        return self._own

    def release(self) -> None:
        """Free the branch's own growth (the prompt state is untouched)."""
        self._own = None

    def __enter__(self) -> Branch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        status = "released" if self._own is None else f"{self.added} tokens added"
        return f"Branch(length={self.length}, {status})"

    @property
    def nbytes(self) -> int:
        """Bytes of the branch's own tensors (what it adds to the prompt state)."""
        return own_nbytes(self._live(), self.state)

    def _check_room(self, n: int) -> None:
        check_positions(self.parts.config, self.length + n, "the trajectory")

    @property
    def prompt_length(self) -> int:
        """The positions before the branch's next token, as a `PromptState` counts its prompt (= `length`)."""
        return self.length

    @property
    def prompt_grad(self) -> str:
        """ "detached": what the branch added was run without autograd, a constant for whatever reads it."""
        return "detached"

    def branch_cache(self, batch: int = 1) -> BranchCache:
        """A branch cache that starts where this branch is and grows apart from it (snapshots of its layers), for
        `batch` sequences (the branch's own tensors repeated as views); the branch itself is unchanged."""
        own = self._live()
        cache = BranchCache([snapshot(layer) for layer in own.layers], block=own.block)
        if batch > 1:
            for layer in cache.layers:
                cast(BranchLayer, layer).batch_repeat_interleave(batch)
        return cache

    def fork(self, chunk_size: int | None = None) -> Branch:
        """A new branch that starts where this one is (the same positions, its layers' snapshots) and grows apart
        from it: each of a row's trajectories forks from the row's branch as they fork from a prompt state."""
        new = Branch.__new__(Branch)
        new.state, new.group, new.parts = self.state, self.group, self.parts
        new.chunk_size = chunk_size or self.chunk_size
        new._own = self.branch_cache(1)
        new.last_token = self.last_token.clone()
        new.length, new.added = self.length, self.added
        new._gone = None
        return new

    def replay(
        self,
        response_ids: TokenIds,
        temperature: float = 1.0,
        checkpoint_layers: bool = False,
        prefix_ids: TokenIds | None = None,
    ) -> Replay:
        """`PromptState.replay` after the branch: `[last_token] + response[:-1]` with autograd, the prompt and the
        branch's own tokens (and `prefix_ids`, run without autograd first) read as constants; a `Replay` of the
        response's log-probs and entropies `[R]`. The branch is left as it was. The prompt state must be detached
        (exact mode differentiates through what the branch holds: replay prompt + added whole).

        Context parallelism: a collective, as `ContextParallelState.replay` is: every rank replays after the same
        branch (the same tokens), each its own response; the attention against the prompt reads every rank's slice
        and the branch's own K/V locally."""
        if self.state.prompt_grad != "detached":
            raise ValueError(
                "Branch.replay reads the branch as constants: that is the detached replay; with prompt_grad='exact' "
                "replay prompt + the branch's tokens through `PromptState.replay(..., prefix_ids=...)`"
            )
        if prefix_ids is not None and len(prefix_ids) > 0:  # the prefix read into a child branch first
            with self.fork() as child:
                child.extend(as_ids(prefix_ids, "prefix_ids", self.parts.config.vocab_size, self.last_token.device))
                return child.replay(response_ids, temperature, checkpoint_layers)
        response = self.state.checked_response(response_ids, checkpoint_layers, self.length)
        cache = self.state.replay_cache(self)
        return replay_tokens(
            self.parts, self.last_token, self.length - 1, response, cache, temperature, checkpoint_layers
        )

    # ------------------------------------------------------------------ growth
    @torch.no_grad()
    def extend(self, tokens: TokenIds) -> None:
        """Append `tokens` `[n]` (tool output, an observation, a scripted turn) to the trajectory without autograd."""
        cache = self._live()
        device = self.last_token.device
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(device)
        if ids.numel() == 0:
            return
        vocab = self.parts.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"tokens outside [0, {vocab}): min {int(ids.min())}, max {int(ids.max())}")
        self._check_room(ids.numel())
        if self.group is not None:
            self.group.agree("Branch.extend", {"length": self.length, "tokens": ids.cpu()})
        inputs = torch.cat([self.last_token, ids[:-1]])
        start = self.length - 1
        for s in range(0, inputs.numel(), self.chunk_size):
            e = min(s + self.chunk_size, inputs.numel())
            cache.reserve(inputs.numel() - e)  # the own K/V grow in place, one copy for the whole extension
            run_decoder(self.parts, inputs[None, s:e], torch.arange(start + s, start + e, device=device), cache)
        cache.reserve(0)
        self.last_token = ids[-1:].clone()
        self.length += ids.numel()
        self.added += ids.numel()

    def sample(
        self,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        allowed_token_ids: TokenIds | None = None,
    ) -> Samples:
        """Decode the next turn (one sequence) from the branch, `longstraw.sampler.sample`'s options; the turn's
        tokens (its stop token included) become part of the trajectory. `max_new_tokens` is cut to the positions
        the model has left."""
        cache = self._live()
        vocab = self.parts.config.vocab_size
        max_new_tokens = positions_left(self.parts.config, self.length, max_new_tokens)
        options = SamplingOptions(temperature, top_p, top_k, stop_token_ids, allowed_token_ids)
        options.check(1, max_new_tokens, vocab)
        device = self.last_token.device
        check_generator(generator, device)
        if self.group is not None:
            self.group.agree(
                "Branch.sample",
                {
                    "length": self.length,
                    **options.fields(max_new_tokens, generator),
                },
            )
        out = decode(
            self.parts,
            cache,
            self.last_token[None],
            self.length - 1,
            max_new_tokens,
            options,
            generator=generator,
        )
        turn = out.tokens[0]
        if self.group is not None:
            self.group.agree("Branch.sample: the sampled tokens", {"tokens": turn.cpu()})
        self.last_token = turn[-1:].clone()
        self.length += turn.numel()
        self.added += turn.numel()
        return out

    def lend_state(self) -> BranchCache:
        """The branch's own cache, handed to a ragged decode batch (`longstraw.ragged.sample_branches`, keep=True),
        which gives it back through `adopt_turn`; until then the branch holds nothing of its own (using it says so)."""
        own = self._live()
        self._own = None
        self._gone = "lost its state: the ragged decode batch it was handed to did not finish"
        return own

    def adopt_turn(self, layers: list, turn: torch.Tensor, block: int) -> None:
        """Take `layers` (this branch's row of a ragged decode batch, `longstraw.ragged.take_row`) as the branch's own
        state after it sampled `turn` `[n]`: what `sample` leaves."""
        self.state.live_layers()
        self._own = BranchCache(layers, block=block)
        self._gone = None
        self.last_token = turn[-1:].clone()
        self.length += turn.numel()
        self.added += turn.numel()


def own_nbytes(cache, state: PromptView) -> int:
    """Bytes of the tensors a branch cache holds of its own: those that share no storage with the prompt state."""
    shared = {t.untyped_storage().data_ptr() for layer in state.live_layers() for t in layer.tensors()}
    seen: set[int] = set()
    total = 0
    for layer in cache.layers:
        for t in _tensors(vars(layer)):
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr not in shared and ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


def detach_own(cache, index: int | None = None) -> None:
    """Cut every branch layer's own tensors from the autograd graph they were made in (values unchanged), so that
    the next forward reads them as constants after that graph's backward freed it. The prompt parts a layer reads
    (attributes and fields named `prompt...`) stay as they are: in exact mode they collect the prompt's gradient.
    `index`: layer `index` only (the others as they are: a layer-major replay's layers not yet run hold their
    starting states, in exact mode the prompt state's leaves)."""
    for layer in cache.layers if index is None else [cache.layers[index]]:
        for name, value in list(vars(layer).items()):
            if name.startswith("prompt"):
                continue
            new = _detached(value)
            if new is not value:
                setattr(layer, name, new)


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach() if value.requires_grad else value
    if isinstance(value, dict):
        new = {k: _detached(v) for k, v in value.items()}
        return value if all(new[k] is value[k] for k in value) else new
    if isinstance(value, (list, tuple)):
        items = [_detached(v) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        changed = {n: _detached(getattr(value, n)) for n in value.__dataclass_fields__ if not n.startswith("prompt")}
        changed = {n: v for n, v in changed.items() if v is not getattr(value, n)}
        return dataclasses.replace(value, **changed) if changed else value
    return value


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        for name in value.__dataclass_fields__:
            yield from _tensors(getattr(value, name))
