"""`ContextParallelState`: the durable state of this rank's slice of a prompt, and its collective replay, sampling
and exact-mode reverse pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ...branch import Branch
from ...hf.cache import BranchCache
from ...prompt_state import PromptState, as_ids, check_length, run_decoder
from ...sampler import Samples, SamplingOptions, TokenIds
from ..collectives import Group
from .kinds import kind_of


class ContextParallelState(PromptState):
    """The durable state of this rank's slice of a prompt captured over a process group (`capture(..., group=)`).

    `replay(response_ids)` is a collective: every rank of the group calls it, each with its own response (lengths
    may differ), and gets its own branch's log-probs with grad; so is the backward of what it returns (every rank
    must run it). `nbytes` is this rank's share; `slice` its captured positions `(start, end)`."""

    def __init__(
        self,
        parts,
        layers,
        last_token,
        prompt_length,
        chunk_size,
        prompt_grad,
        block,
        *,
        group: Group,
        bounds,
        key: int,
    ):
        super().__init__(parts, layers, last_token, prompt_length, chunk_size, prompt_grad, block)
        self.group = group
        self.bounds = bounds
        self._key = key
        self._replays = 0
        self._lengths: list[int] = []  # every rank's response length in the replay under way

    @property
    def sliced_nbytes(self) -> int:
        """Bytes of this rank's slice of the states that grow with P (full-attention K/V)."""
        return sum(layer.nbytes for layer in self._live() if kind_of(layer).sliced)

    @property
    def replicated_nbytes(self) -> int:
        """Bytes of the O(1) states every rank holds alike (sliding windows, linear-attention states)."""
        return self.nbytes - self.sliced_nbytes

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.size

    @property
    def slice(self) -> tuple[int, int]:
        return self.bounds[self.group.rank]

    def __repr__(self) -> str:
        status = "released" if self.layers is None else f"{self.nbytes / 2**20:.2f} MiB here"
        s, e = self.slice
        return (
            f"ContextParallelState(prompt_length={self.prompt_length}, rank {self.rank} of {self.world_size}, "
            f"positions [{s}, {e}), {status})"
        )

    def checked_response(
        self, response_ids: TokenIds, checkpoint_layers: bool, length: int | None = None
    ) -> torch.Tensor:
        """`PromptState.replay`'s check of the response, as a collective (`checked_batch` of one row): every rank's
        response length is agreed (with the replay's number, `checkpoint_layers` and grad mode, which must match), and
        an invalid response on any rank is refused on every rank."""
        return self.checked_batch([response_ids], checkpoint_layers, length)[0]

    def checked_batch(
        self, rows: Sequence[TokenIds], checkpoint_layers: bool, length: int | None = None
    ) -> list[torch.Tensor]:
        """`checked_response` of a batch of rows, as one collective: every rank replays a batch of as many rows
        (refused otherwise: the ranks' queries are gathered as one tensor), each rank's width (its longest row) is
        agreed, and an invalid row on any rank is refused on every rank."""
        parts = self.parts
        self._live()
        if len(rows) > 1 and not self.batches_replays:
            raise ValueError(
                "ContextParallelState: DSA layers (sparse attention over the slices) replay one response per rank at "
                "a time; replay the responses one at a time"
            )
        try:
            checked = [as_ids(r, "response_ids", parts.config.vocab_size, self.last_token.device) for r in rows]
            width = max(r.numel() for r in checked)
            check_length(parts.config, (self.prompt_length if length is None else length) + width)
            error = None
        except (ValueError, TypeError) as err:
            checked, width, error = [], -1, err
        self._replays += 1
        self._lengths = [
            row[0]
            for row in self.group.agree(
                "ContextParallelState.replay",
                {
                    "captured state": self._key,
                    "replay number": self._replays,
                    "responses replayed together": len(rows),
                    "checkpoint_layers": bool(checkpoint_layers),
                    "grad enabled": torch.is_grad_enabled(),
                    "replayed after position": self.prompt_length if length is None else length,
                },
                free=(width,),
            )
        ]
        bad = [r for r, n in enumerate(self._lengths) if n < 0]
        if bad:
            raise ValueError(
                f"ContextParallelState.replay: invalid response_ids on rank(s) {bad}; no rank replays"
            ) from error
        return checked

    @property
    def batches_replays(self) -> bool:
        """Whether responses replay in batches here (`replay_batch`): every layer kind's replay takes a batch of
        queries per rank, except DSA's (its selection runs one branch per rank)."""
        return all(kind_of(layer).batches_replays for layer in self._live())

    def replay_cache(self, branch: Branch | None = None, batch: int = 1) -> BranchCache:
        """The cache of a replay of `batch` responses (the same count on every rank): sliced layers attend across
        the ranks' slices (`ReplayAttention`), the others read their replicated state locally. After `branch` (a
        branch of this state, the same on every rank): the sliced layers start from the branch's own K/V, the others
        from snapshots of the branch's layers, repeated for the batch's rows."""
        start = self.prompt_length - 1
        grown = None if branch is None else branch.branch_cache(batch).layers
        layers = []
        for i, layer in enumerate(self._live()):
            layers.append(
                kind_of(layer).replay_branch(
                    layer, self.group, self._lengths, start, None if grown is None else grown[i], batch
                )
            )
        return BranchCache(layers, block=self.block)

    def backward(self) -> None:
        """Exact mode, a collective: push the gradient the replays accumulated on every rank's slice into the
        parameters.

        Each rank recomputes its slice with autograd (the capture's forward, layer-synchronous, `CaptureAttention`)
        and back-propagates its slice's accumulated K/V gradient; the attention's backward sends dK/dV of earlier
        slices and dq of later ranks' rows back to their owners, so the parameter gradients summed over the ranks
        are those of one process's `PromptState.backward()`. Memory: the slice's whole graph (not chunked yet).
        Detached mode: nothing to do."""
        if self.prompt_grad != "exact":
            return
        layers = self._live()
        if self._backward_done:
            raise RuntimeError("PromptState.backward() was already called for this state")
        self.group.agree("ContextParallelState.backward", {"captured state": self._key, "replays": self._replays})
        s, e = self.slice
        g = self.group
        device = self.last_token.device
        kinds = [kind_of(layer) for layer in layers]
        branches = [
            kind.capture_branch(layer, g, self.bounds, i, self.chunk_size)
            for i, (layer, kind) in enumerate(zip(layers, kinds))
        ]
        cache = BranchCache(branches, block=self.block)
        # the replays' gradients of replicated states (a final window, the final linear-attention states), summed over
        # the ranks; each rank's slice continues them
        gathered = [kind.reverse_gradient(layer, g, i) for i, (layer, kind) in enumerate(zip(layers, kinds))]
        hooks = []
        for i, (layer, kind) in enumerate(zip(layers, kinds)):
            relay = kind.reverse_relay(layer, g, cache, i, device, gathered[i])
            if relay is not None:
                block = cast(torch.nn.ModuleList, self.parts.decoder.layers)[i]
                hooks += [block.register_forward_pre_hook(relay.before), block.register_forward_hook(relay.after)]
        assert self._prompt is not None  # exact mode: the captured tokens (`capture`)
        try:
            with torch.enable_grad():
                hidden = run_decoder(self.parts, self._prompt[None, s:e], torch.arange(s, e, device=device), cache)
        finally:
            for h in hooks:
                h.remove()
        # the slice's output with a zero gradient: every layer's output then takes part in the backward, so hooks
        # on the layers' outputs run before their inner nodes (FSDP2 gathers a sharded layer's parameters there)
        outputs, grads = ([hidden], [torch.zeros_like(hidden)]) if hidden.requires_grad else ([], [])
        for layer, kind, branch, got in zip(layers, kinds, cache.layers, gathered):
            for output, grad in kind.reverse_roots(layer, branch, got, s, e, self.prompt_length):
                outputs.append(output)
                grads.append(grad)
        if outputs:
            torch.autograd.backward(outputs, grads)
        del cache, outputs, grads
        self._backward_done = True

    def sample(
        self,
        num: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        allowed_token_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> Samples:
        """`PromptState.sample` as a collective: every rank decodes all `num` sequences alike and returns the same
        `Samples`, the attention against the prompt split over the ranks (`SampleBranchLayer`). The arguments and the
        generator's state (the global one when `generator` is None) must agree across ranks (refused otherwise); the
        sampled tokens are compared at the end as well. Spread the samples' replays over the ranks yourself, e.g.
        rank r replays samples r, r + N, ..."""

        self.group.agree(
            "ContextParallelState.sample",
            {
                "captured state": self._key,
                "num": num if isinstance(num, int) else repr(num),
                **SamplingOptions(temperature, top_p, top_k, stop_token_ids, allowed_token_ids).fields(
                    max_new_tokens, generator
                ),
            },
        )
        samples = super().sample(
            num, max_new_tokens, temperature, top_p, top_k, stop_token_ids, generator, allowed_token_ids
        )
        self.group.agree(
            "ContextParallelState.sample: the sampled tokens", {"tokens": [t.cpu() for t in samples.tokens]}
        )
        return samples

    def branch_cache(self, batch: int = 1) -> BranchCache:
        """The cache of a decode (`longstraw.sampler`): sliced layers read collectively, the others locally."""
        start = self.prompt_length - 1
        return BranchCache(
            [kind_of(layer).sample_branch(layer, self.group, start, batch) for layer in self._live()],
            block=self.block,
        )
