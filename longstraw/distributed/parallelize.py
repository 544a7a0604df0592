"""How a training run is spread over its processes, applied once: `parallelize(model, ranks, ...)` → `Parallel`.

    parallel = parallelize(model, ranks, context_parallel=0, expert_parallel=2, fsdp=True, timeout_s=600)
    # every step:
    parallel.begin_step(model)                       # sharded layers: gradients kept unreduced until the last backward
    ... backwards (the last one after parallel.before_last_backward(model)) ...
    parallel.reduce_gradients(params)                # replicated gradients summed over the ranks, experts over replicas
    norm = parallel.clip_grad_norm(params, 1.0)      # one norm over shards, spread experts and replicated weights

`parallelize` runs, in this order on every rank: rank 0's trainable weights broadcast (randomly initialised adapters
may differ), the context-parallel groups formed (`ContextGroups`), the experts spread (`expert_parallel`,
`longstraw.distributed.expert_parallel`), the decoder layers sharded (`fsdp`, FSDP2, `longstraw.distributed.fsdp`)
with the spread experts left out of FSDP2's gathers. The stages then take `parallel.context` (their collectives'
ranks) and `parallel.groups`; checkpoints `whole` / `load_whole`. One process: every step is a no-op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from ..hf.parts import base_model, decoder_of
from .expert_parallel import ExpertShards, spread_experts
from .fsdp import clip_grad_norm, full_tensors, gradient_sync, is_sharded, load_full_tensors, shard
from .ranks import ContextGroups, Ranks

__all__ = ["Parallel", "StepShare", "parallelize"]


@dataclass(frozen=True)
class StepShare:
    """One rank's part of a training step's work, as the update stage sees it (`Parallel.step_share`): the ranks its
    captures and replays are collectives of (`context`), which items it takes and how it pads them, where the loss
    metrics are summed (`world`), and what runs just before the step's last backward. `StepShare()`: one process —
    every item its own, no padding, no collective.

    A replay on several ranks is a collective, so every rank of `context` runs as many as the others: `replays(n)`
    pads this rank's share with None (a replay of weight 0). Forwards that are not collectives (a full-sequence
    batch) skip what a rank has none of, unless `lockstep` (sharded layers, spread experts: every forward is one)."""

    context: Ranks = field(default_factory=Ranks)
    #: the ranks the loss metrics are summed over (None: `context`)
    world: Ranks | None = None
    #: called just before the step's last backward (sharded layers reduce their gradients there); None: nothing
    before_last_backward: Callable[[], None] | None = None
    #: every rank runs every forward (sharded layers, spread experts)
    lockstep: bool = False
    #: the context-parallel groups when there are several (`context_parallel`): `context` is one of them, which takes
    #: every `count`-th context of a step, and the groups exchange their sampled rows; None: one group takes them all
    groups: ContextGroups | None = None

    @property
    def group(self):
        """What `longstraw.capture(..., group=)` takes: the context's process group (None: one process)."""
        return self.context.pg

    @property
    def collective(self) -> bool:
        """Whether captures and replays are collectives of several ranks."""
        return self.context.size > 1

    def replays(self, n: int) -> list[int | None]:
        """This rank's replays of n items: [r, r + N, ...] padded with None to ⌈n / N⌉ (`Ranks.padded_share`)."""
        return self.context.padded_share(n)

    def owns(self, k: int) -> bool:
        """Whether item k is this rank's (round robin over the context's ranks)."""
        return k % self.context.size == self.context.rank

    def forwards(self, items: list[int]) -> list[int | None]:
        """This rank's `items` (round robin, `Ranks.share`); with `lockstep` padded with None to ⌈n / N⌉ entries
        (`Ranks.padded_share`)."""
        if self.lockstep:
            return [None if k is None else items[k] for k in self.context.padded_share(len(items))]
        return [items[k] for k in self.context.share(len(items))]

    @property
    def several_groups(self) -> bool:
        """Whether the step's contexts are shared out among several context-parallel groups."""
        return self.groups is not None and self.groups.count > 1

    def owns_context(self, k: int) -> bool:
        """Whether this rank's group captures, samples and replays context k of the step."""
        return self.groups is None or self.groups.owns(k)

    def exchange(self, name: str, mine: dict) -> dict:
        """Every group's `mine` (key → picklable value) merged on every rank (`ContextGroups.exchange`); `mine` with
        one group."""
        return mine if self.groups is None or self.groups.count == 1 else self.groups.exchange(name, mine)

    def from_main(self, name: str, fn):
        """`fn()` on the context's first rank, its result or exception on each of its ranks (`Ranks.from_main`)."""
        return self.context.from_main(name, fn)

    def sum_floats(self, name: str, values: list[float]) -> list[float]:
        """`values` summed over `world` (unchanged on one process)."""
        return (self.world or self.context).sum_floats(name, values)

    def max_floats(self, name: str, values: list[float]) -> list[float]:
        """The largest of `values` over `world`, value by value."""
        return (self.world or self.context).max_floats(name, values)


@dataclass
class Parallel:
    """Where a run's weights and work live on its ranks (`parallelize`)."""

    #: all of the run's ranks (the gradient sum, checks, files)
    ranks: Ranks
    #: the context-parallel groups; `groups.context` is this rank's
    groups: ContextGroups
    #: this rank's share of the experts (`expert_parallel`); None: every rank holds every expert
    experts: ExpertShards | None = None
    #: the ranks holding the same experts in the other expert groups (None: one group)
    expert_replicas: Ranks | None = None
    #: whether the decoder layers are sharded (`fsdp` on several ranks)
    sharded: bool = False

    @property
    def context(self) -> Ranks:
        """The ranks this rank captures, samples and replays with (its context-parallel group)."""
        return self.groups.context

    @property
    def partitioned(self) -> bool:
        """Whether some trainable weights are not whole on each rank (sharded layers, spread experts)."""
        return self.sharded or self.experts is not None

    def is_spread(self, p: torch.Tensor) -> bool:
        """Whether `p` is a slice of spread experts' weights or adapters."""
        return self.experts is not None and self.experts.is_spread(p)

    def replicated(self, params: list) -> list:
        """`params` (tensors, or (name, tensor) pairs) that every rank holds whole and alike."""

        def whole(p) -> bool:
            t = p[1] if isinstance(p, tuple) else p
            return not self.is_spread(t) and not (self.sharded and is_sharded(t))

        return [p for p in params if whole(p)]

    def begin_step(self, model: torch.nn.Module) -> None:
        """Before a step's backwards: sharded layers accumulate their gradients unreduced."""
        if self.sharded:
            gradient_sync(model, False)

    def before_last_backward(self, model: torch.nn.Module) -> Callable[[], None] | None:
        """What to call just before the step's last backward (sharded layers: reduce-scatter there); None: nothing."""
        if not self.sharded:
            return None
        return lambda: gradient_sync(model, True)

    def step_share(self, model: torch.nn.Module, context: Ranks | None = None) -> StepShare:
        """This rank's part of a step on `model` (`StepShare`): collectives among `context` (default: this rank's
        context-parallel group, taking its share of the step's contexts), metrics summed over every rank."""
        return StepShare(
            self.context if context is None else context,
            self.ranks,
            self.before_last_backward(model),
            lockstep=self.partitioned,
            groups=self.groups if context is None and self.groups.count > 1 else None,
        )

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the step's gradients of `params` over the ranks: the replicated ones over all, spread experts' over the
        ranks holding the same experts (sharded layers were reduced in the last backward)."""
        if self.ranks.size == 1:
            return
        self.ranks.all_reduce_grads(self.replicated(params), "trainer: gradient all-reduce")
        if self.expert_replicas is not None:
            spread = [p for p in params if self.is_spread(p)]
            self.expert_replicas.all_reduce_grads(spread, "trainer: expert gradient all-reduce")

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> float | None:
        """With partitioned weights: the gradient norm over every rank's shards, spread experts and replicated
        weights, the gradients clipped to `max_norm` (0: not clipped), the same on every rank. None with whole
        weights (clip with torch)."""
        if not self.partitioned:
            return None
        return clip_grad_norm(params, max_norm, self.ranks.pg, spread=self.experts)

    def whole(self, named: list[tuple[str, torch.Tensor]], keep: bool) -> dict[str, torch.Tensor]:
        """`named` gathered whole (a collective with partitioned weights), kept where `keep`."""
        return full_tensors(named, keep=keep, spread=self.experts)

    def load_whole(self, named: list[tuple[str, torch.Tensor]], values, what: str) -> None:
        """Set `named` from whole `values`: each rank takes its shard or slice."""
        load_full_tensors(named, values, what, spread=self.experts)


def parallelize(
    model: torch.nn.Module,
    ranks: Ranks,
    *,
    context_parallel: int = 0,
    expert_parallel: int = 1,
    fsdp: bool = False,
    timeout_s: float = 600.0,
) -> Parallel:
    """Spread `model` and the work over `ranks` (see the module doc); a collective of every rank. Refuses what is not
    built: `fsdp` with context-parallel groups smaller than the run."""
    ranks.broadcast_params(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad], "parallelize: initial weights from rank 0"
    )
    groups = ContextGroups(ranks, context_parallel, timeout_s)
    if groups.count > 1 and fsdp:
        raise ValueError(
            f"context_parallel: {context_parallel} of {ranks.size} processes with fsdp: true: layers sharded over "
            "every rank need every forward run by all of them, and the groups run different prompts; use "
            "context_parallel: 0 (one group of all ranks)"
        )
    parallel = Parallel(ranks, groups)
    if expert_parallel > 1:
        experts, replicas = spread_experts(model, expert_parallel, timeout_s)
        parallel.experts, parallel.expert_replicas = experts, None if replicas is None else Ranks(replicas)
    if fsdp and ranks.size == 1:
        print("longstraw: fsdp: true on one process: nothing to shard, the weights stay whole", file=sys.stderr)
    if fsdp and ranks.size > 1:
        layers = cast(torch.nn.ModuleList, decoder_of(base_model(model)).layers)  # the decoder's blocks
        in_layers = [p for p in layers.parameters() if p.requires_grad]
        spread = {p for p in model.parameters() if parallel.is_spread(p)}  # each rank's own: FSDP leaves them
        shard(
            model,
            float32_masters=any(p.dtype in (torch.bfloat16, torch.float16) for p in in_layers),
            ignored=spread or None,
        )
        parallel.sharded = True
    return parallel
