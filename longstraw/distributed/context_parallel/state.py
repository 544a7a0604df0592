"""`ContextParallelState`: the durable state of this rank's slice of a prompt, and its collective replay, sampling
and exact-mode reverse pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ...branch import Branch
from ...hf.cache import BranchCache
from ...kinds.linear_attention import RecurrentBranchLayer, RecurrentState
from ...kinds.sliding_window import SlidingKVState
from ...prompt_state import PromptState, as_ids, check_length, run_decoder
from ...sampler import Samples, TokenIds, sampling_fields
from ..collectives import Group
from .full_attention import CaptureBranchLayer, ReplayInfo, SliceKVState
from .kinds import capture_branch, replay_branch, sample_branch
from .linear_attention import RecurrentRelayExact, present_states
from .slices import rank_sum
from .sliding_window import SlidingCaptureBranchLayer


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
        return sum(layer.nbytes for layer in self._live() if isinstance(layer, SliceKVState))

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
        """`PromptState.replay`'s check of the response, as a collective: every rank's response length is agreed
        (with the replay's number, `checkpoint_layers` and grad mode, which must match), and an invalid response on
        any rank is refused on every rank."""
        parts = self.parts
        self._live()
        try:
            response = as_ids(response_ids, "response_ids", parts.config.vocab_size, self.last_token.device)
            check_length(parts.config, (self.prompt_length if length is None else length) + response.numel())
            mine, error = response.numel(), None
        except (ValueError, TypeError) as err:
            mine, error = -1, err
        self._replays += 1
        self._lengths = [
            row[0]
            for row in self.group.agree(
                "ContextParallelState.replay",
                {
                    "captured state": self._key,
                    "replay number": self._replays,
                    "checkpoint_layers": bool(checkpoint_layers),
                    "grad enabled": torch.is_grad_enabled(),
                    "replayed after position": self.prompt_length if length is None else length,
                },
                free=(mine,),
            )
        ]
        bad = [r for r, n in enumerate(self._lengths) if n < 0]
        if bad:
            raise ValueError(
                f"ContextParallelState.replay: invalid response_ids on rank(s) {bad}; no rank replays"
            ) from error
        return response

    def replay_cache(self, branch: Branch | None = None) -> BranchCache:
        """The cache of a replay: sliced layers attend across the ranks' slices (`ReplayAttention`), the others read
        their replicated state locally. After `branch` (a branch of this state, the same on every rank): the sliced
        layers start from the branch's own K/V, the others from snapshots of the branch's layers."""
        start = self.prompt_length - 1
        grown = None if branch is None else branch.branch_cache(1).layers
        layers = []
        for i, layer in enumerate(self._live()):
            if isinstance(layer, SliceKVState):
                replay = replay_branch(layer, ReplayInfo(self.group, self._lengths, layer), start)
                layers.append(replay if grown is None else replay.adopt(grown[i]))
            else:
                layers.append(layer.branch() if grown is None else grown[i])
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
        branches: list[CacheLayerMixin | LinearAttentionCacheLayerMixin] = []
        hooks = []
        for i, layer in enumerate(layers):
            if isinstance(layer, RecurrentState):
                branches.append(RecurrentBranchLayer({}, {}, layer.number_of_states, layer.conv_trim))
            elif isinstance(layer, SlidingKVState):
                assert layer.window is not None  # a sliding window (chunked attention is not served)
                branches.append(SlidingCaptureBranchLayer(g, self.bounds, i, layer.window))
            else:
                branches.append(capture_branch(layer, g, self.bounds, i, self.chunk_size))
        cache = BranchCache(branches, block=self.block)
        # sliding windows: the replays' gradient of the replicated final window, summed over the ranks; each rank
        # adds the rows of its own slice to the roots below
        windows = {}
        for i, layer in enumerate(layers):
            if isinstance(layer, SlidingKVState) and layer.keys is not None:
                assert layer.values is not None  # stored with the keys
                mine = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (layer.keys, layer.values)]
                got = g.all_gather(f"reverse pass layer {i}: final window gradient", mine)
                windows[i] = rank_sum(got)
        for i, layer in enumerate(layers):
            if isinstance(layer, RecurrentState):
                # the final states' gradient: every rank's replays added theirs to its own copy; summed in rank order
                final = present_states(layer.branch(), layer.number_of_states)
                mine = [
                    states[i2].grad if states[i2].grad is not None else torch.zeros_like(states[i2])
                    for states, i2 in final
                ]
                got = g.all_gather(f"reverse pass layer {i}: final linear-attention state gradient", mine)
                relay = RecurrentRelayExact(g, cache, i, layer, device, rank_sum(got))
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
        for i, (layer, branch) in enumerate(zip(layers, cache.layers)):
            if i in windows:  # this slice's rows of the prompt's final window
                assert isinstance(layer, SlidingKVState) and layer.keys is not None  # (as `windows` was built)
                assert isinstance(branch, SlidingCaptureBranchLayer)  # built above for each sliding layer
                assert branch.keys is not None and branch.values is not None  # the slice ran through the layer
                dk_w, dv_w = windows[i]
                w_start = self.prompt_length - 1 - layer.keys.shape[-2]
                a, b = max(s, w_start), e
                if a < b and branch.keys.requires_grad:
                    outputs += [branch.keys[:, :, a - s : b - s], branch.values[:, :, a - s : b - s]]
                    grads += [
                        dk_w[:, :, a - w_start : b - w_start].to(branch.keys.dtype),
                        dv_w[:, :, a - w_start : b - w_start].to(branch.values.dtype),
                    ]
                continue
            if not isinstance(layer, SliceKVState):  # linear attention: its gradient travels through the relay
                continue
            assert isinstance(branch, CaptureBranchLayer)  # built above by `capture_branch`
            # committed at capture; exact mode refuses a quantized state
            assert isinstance(layer.keys, torch.Tensor) and isinstance(layer.values, torch.Tensor)
            pairs = (
                ((branch.keys, layer.keys),)
                if layer.values is layer.keys
                else ((branch.keys, layer.keys), (branch.values, layer.values))
            )  # MLA: one leaf, read as keys and values
            for own, leaf in pairs:
                assert own is not None  # the slice ran through the layer
                if own.requires_grad and leaf.grad is not None:
                    outputs.append(own)
                    grads.append(leaf.grad.to(own.dtype))
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
                **sampling_fields(
                    max_new_tokens, temperature, top_p, top_k, stop_token_ids, allowed_token_ids, generator
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
            [
                sample_branch(layer, self.group, start) if isinstance(layer, SliceKVState) else layer.branch(batch)
                for layer in self._live()
            ],
            block=self.block,
        )
