"""Expert parallelism: a mixture-of-experts model's routed experts spread over the ranks of a process group.

`shard_experts(model, group)` finds the model's experts modules by what they are, not by name: modules whose class
dispatches its forward through transformers' experts interface (`use_experts_implementation`, transformers 5.24:
Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, ...), holding their experts as 3-D weights `[E, ...]`. Rank r
of N keeps experts [r·E/N, (r+1)·E/N) of each (the weights sliced; `num_experts` the local count), and the model's
experts implementation becomes `longstraw_expert_parallel`, registered in `ALL_EXPERTS_FUNCTIONS` (the extension
point transformers' own grouped-mm kernels use). A call then:
1. sends every (token, choice) pair to the rank holding its expert: the counts first (an all-to-all of N ints),
   then the hidden states (`all_to_all_single` with those splits; differentiable, its backward the mirrored
   all-to-all) and the local expert ids;
2. runs the received rows through the module's own eager forward (`forward.__wrapped__`), each row one choice of
   weight 1 among the local experts;
3. brings the outputs home with the reverse all-to-all, weights each by its routing weight and sums a token's
   choices (`index_add_`), as the eager forward does.
Routing is the router's, computed once per token before the call, as without expert parallelism. Each call is a
collective: every rank of the group must call each MoE layer the same number of times, whatever its own number of
tokens (zero included). Gradients: an expert's weights receive the gradient of every rank's tokens routed to it, on
the rank that holds it (no all-reduce); the other parameters' gradients are each rank's own tokens', summed over the
ranks as any data-parallel gradient is. `ExpertShards.load` records the rows each rank received per layer.
PEFT's LoRA adapters of the experts' 3-D weights (`target_parameters`) are spread with them (`_slice_adapters`);
`ExpertShards.whole` / `local` gather a spread parameter whole and slice it back (checkpoints, through
`longstraw.distributed.fsdp.full_tensors(..., spread=)`); `fsdp.clip_grad_norm(..., spread=)` takes one norm over
spread, sharded and whole gradients. A call whose rows reach none of this rank's experts keeps its output in the
autograd graph, so that the backward's all-to-alls run on every rank or on none.
Memory: E/N experts per rank; the dispatch buffers are T·k rows of the hidden size, out and back.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from .collectives import Group
from .ranks import consecutive_group

IMPLEMENTATION = "longstraw_expert_parallel"
#: each sharded experts module's `ExpertShards` and its index in it (read by `expert_parallel_forward`)
_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def experts_modules(model) -> list[torch.nn.Module]:
    """The modules of `model` whose forward goes through transformers' experts interface (their class was wrapped by
    `use_experts_implementation`: the forward names the interface), with experts stored as `[E, ...]` weights."""
    out = []
    for m in model.modules():
        forward = type(m).__dict__.get("forward")
        wrapped = getattr(forward, "__wrapped__", None)
        if wrapped is None or "experts_interface" not in getattr(forward, "__code__", wrapped.__code__).co_freevars:
            continue
        if isinstance(getattr(m, "num_experts", None), int):
            out.append(m)
    return out


def spreads_experts(module: torch.nn.Module) -> bool:
    """Whether `module` holds an experts module spread over ranks by `shard_experts` (its calls are collectives)."""
    return any(m in _SHARDED for m in module.modules())


@dataclass
class ExpertShards:
    """What `shard_experts` did: the group, the modules (in model order), each module's first local expert and
    count; `load[i]` the rows each call of module i received on this rank (appended per call, read and cleared by
    `take_load`); `spread` the parameters held in slices, by id: the experts' weights and the PEFT adapters around
    them (`_Slicing`)."""

    group: Group
    modules: list[torch.nn.Module]
    first: list[int]
    count: list[int]
    load: list[list[int]] = field(default_factory=list)
    spread: dict[int, _Slicing] = field(default_factory=dict)
    #: per module, the names of its spread weights (what its eager forward reads, adapted or not)
    names: list[list[str]] = field(default_factory=list)

    def is_spread(self, p: torch.Tensor) -> bool:
        """Whether `p` is a parameter this rank holds a slice of (its gradient is whole on this rank: no all-reduce
        over the group)."""
        return id(p) in self.spread

    def whole(self, p: torch.Tensor, name: str, value: torch.Tensor | None = None) -> torch.Tensor:
        """A spread parameter whole, or `value` laid out as it (its gradient, an optimizer moment): a collective of
        the group, every rank passing its slice, in the same order."""
        sl = self.spread[id(p)]
        mine = (p if value is None else value).detach().contiguous()
        parts = [t[0] for t in self.group.all_gather(f"expert parallel: {name} gathered", [mine])]
        if sl.lora_rank is None:
            return torch.cat(parts)
        out = parts[0].shape[0]  # PEFT's lora_B `[out, r · E]`, expert-minor columns
        return torch.cat([t.reshape(out, sl.lora_rank, -1) for t in parts], dim=2).reshape(out, -1)

    def local(self, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `whole` for the spread parameter `p` (the inverse of `whole`)."""
        sl = self.spread[id(p)]
        first, n = self.first[sl.module], self.count[sl.module]
        if sl.lora_rank is None:
            per = whole.shape[0] // (self.group.size * n)  # rows per expert: 1 for weights, r for lora_A
            return whole[first * per : (first + n) * per]
        out = whole.shape[0]
        return whole.reshape(out, sl.lora_rank, -1)[:, :, first : first + n].reshape(out, -1)

    def take_load(self) -> list[int]:
        """Per experts module, the rows this rank received since the last call (its experts' work), and clears it."""
        totals = [sum(calls) for calls in self.load]
        for calls in self.load:
            calls.clear()
        return totals

    def load_metrics(self) -> dict:
        """The rows each rank's experts received since the last call, per MoE layer (all-gathered over the group, a
        collective; cleared): `expert_load_imbalance`, the most loaded rank's rows over the mean at the worst layer
        (1.0: balanced), and `expert_rows`, the rows in all."""
        per_rank = self.group.all_gather_ints("expert parallel: load", self.take_load())
        worst = 1.0
        for layer in zip(*per_rank):
            mean = sum(layer) / len(layer)
            if mean > 0:
                worst = max(worst, max(layer) / mean)
        return {"expert_load_imbalance": worst, "expert_rows": sum(sum(r) for r in per_rank)}


@dataclass(frozen=True)
class _Slicing:
    """How a spread parameter is sliced: of experts module `module`; `lora_rank` None: along dim 0 in blocks per
    expert (the experts' weights `[E, ...]`, PEFT's lora_A `[E · r, in]`); else PEFT's lora_B `[out, r · E]`, whose
    columns are rank-major (column j · E + e: expert e's j-th)."""

    module: int
    lora_rank: int | None = None


def shard_experts(model, group=None) -> ExpertShards:
    """Keep this rank's share of every experts module's experts (see the module doc); the experts count must divide
    by the group's size. Returns the `ExpertShards`. In place: the dropped experts' weights are freed."""
    g = Group(group)
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__}: no experts module (a mixture-of-experts layer) to spread")
    shards = ExpertShards(g, modules, [], [])
    for i, m in enumerate(modules):
        e = m.num_experts
        if e % g.size:
            raise ValueError(f"{type(m).__name__}: {e} experts do not divide over {g.size} ranks")
        n = e // g.size
        first = g.rank * n
        shards.names.append([])
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 2 and p.shape[0] == e:  # one slice per expert (weights, and biases `[E, out]`)
                local = torch.nn.Parameter(p.detach()[first : first + n].clone(), requires_grad=p.requires_grad)
                setattr(m, name, local)
                shards.spread[id(local)] = _Slicing(i)
                shards.names[i].append(name)
        m.num_experts = n
        _SHARDED[m] = (shards, i)
        shards.first.append(first)
        shards.count.append(n)
        shards.load.append([])
    _slice_adapters(model, shards)
    _register()
    model.set_experts_implementation(IMPLEMENTATION)
    return shards


def spread_experts(model, n: int, timeout_s: float) -> tuple[ExpertShards, dist.ProcessGroup | None]:
    """`expert_parallel: n` over the default group of W ranks: each group of n consecutive ranks spreads every MoE
    layer's experts over its ranks (`shard_experts`: call it once every rank holds the same weights); with W > n, the
    ranks holding the same experts in the other groups form a group of their own, which sums those gradients
    (returned; None when W = n). Every forward must be a collective of all W ranks (as the context-parallel capture,
    sampling of the same sequences and padded replays are), so that each group's all-to-alls run in step."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    if world % n:
        raise ValueError(f"expert_parallel: {n} needs a process count it divides; this run has {world}")
    group = replicas = None
    if world > n:  # torch.distributed: every rank creates every group, in the same order
        timeout = datetime.timedelta(seconds=timeout_s)
        group = consecutive_group(n, timeout_s)
        for i in range(n):
            g = dist.new_group(list(range(i, world, n)), timeout=timeout)
            if rank % n == i:
                replicas = g
    return shard_experts(model, group), replicas


def _slice_adapters(model, shards: ExpertShards) -> None:
    """Slice the PEFT LoRA adapters of spread experts weights (`target_parameters`, PEFT 0.21's `ParamWrapper`: lora_A
    `[E · r, in]`, lora_B `[out, r · E]`, `num_experts` E) to this rank's experts, so that the adapter's delta is that
    of the experts the rank holds. Every rank must have built the same adapters (seeded, or broadcast) before."""
    index = {m: i for i, m in enumerate(shards.modules)}
    for w in model.modules():
        lora_a, lora_b = getattr(w, "lora_A", None), getattr(w, "lora_B", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or not isinstance(lora_b, torch.nn.ModuleDict):
            continue
        if not isinstance(getattr(w, "num_experts", None), int):
            continue
        base = w.get_base_layer()
        i = index.get(base)
        if i is None:
            continue
        first, n, total = shards.first[i], shards.count[i], w.num_experts
        if n == 1:
            raise ValueError(
                f"{type(base).__name__}: one expert per rank with a LoRA adapter on the experts: PEFT 0.21 reads a "
                "one-expert adapter as a 2-D weight; use fewer ranks for the experts, or leave them out of "
                "lora_target_modules"
            )
        ranks: dict = getattr(w, "r", {})  # PEFT: adapter name → rank
        for name in list(lora_a.keys()):
            r = int(ranks[name])
            a, b = cast(torch.Tensor, lora_a[name].weight), cast(torch.Tensor, lora_b[name].weight)
            if a.shape[0] != r * total or b.shape[1] != r * total:
                raise ValueError(f"{type(w).__name__}: adapter {name!r} of unexpected shape {tuple(a.shape)}")
            new_a = torch.nn.Parameter(a.detach()[first * r : (first + n) * r].clone(), requires_grad=a.requires_grad)
            cols = b.detach().reshape(b.shape[0], r, total)[:, :, first : first + n]
            new_b = torch.nn.Parameter(cols.reshape(b.shape[0], r * n).clone(), requires_grad=b.requires_grad)
            cast(torch.nn.Linear, lora_a[name]).weight = new_a
            cast(torch.nn.Linear, lora_b[name]).weight = new_b
            shards.spread[id(new_a)] = _Slicing(i)
            shards.spread[id(new_b)] = _Slicing(i, lora_rank=r)
        w.num_experts = n


def _register() -> None:
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, expert_parallel_forward)


class _Exchange(torch.autograd.Function):
    """`all_to_all_single` of rows `[n, H]` with split sizes; backward: the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group: Group, name: str):
        ctx.send, ctx.recv, ctx.group, ctx.name = send, recv, group, name
        out = x.new_empty((sum(recv), *x.shape[1:]))
        try:
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.group)
        except RuntimeError as err:
            group.fail(name, err)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        try:
            dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group.group)
        except RuntimeError as err:
            ctx.group.fail(f"{ctx.name} (backward)", err)
        return back, None, None, None, None


def _counts(group: Group, send: list[int], name: str) -> list[int]:
    """How many rows each rank sends to this one (an all-to-all of one int per rank)."""
    out = torch.empty(group.size, dtype=torch.int64)
    try:
        dist.all_to_all_single(out, torch.tensor(send, dtype=torch.int64), group=group.group)
    except RuntimeError as err:
        group.fail(name, err)
    return out.tolist()


def expert_parallel_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts module's output `[T, H]` for `hidden_states` `[T, H]` routed to `top_k_index` `[T, k]` (global
    expert ids) with `top_k_weights` `[T, k]`, its experts spread over the group (see the module doc)."""
    shards, i = _SHARDED[self]
    g, n = shards.group, shards.count[i]
    name = f"expert parallel layer {i}"
    t, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    dest = torch.div(flat, n, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=g.size).tolist()
    recv = _counts(g, send, f"{name}: counts")
    rows = torch.div(order, k, rounding_mode="floor")  # the token of each sent row
    x = _Exchange.apply(hidden_states[rows], send, recv, g, f"{name}: hidden states")
    with torch.no_grad():
        ids = torch.empty(sum(recv), dtype=torch.int64, device=flat.device)
        try:
            dist.all_to_all_single(ids, (flat[order] - dest[order] * n).contiguous(), recv, send, group=g.group)
        except RuntimeError as err:
            g.fail(f"{name}: expert ids", err)
    shards.load[i].append(int(sum(recv)))
    eager = type(self).forward.__wrapped__
    y = eager(self, x, ids[:, None], torch.ones(ids.numel(), 1, dtype=top_k_weights.dtype, device=x.device))
    if torch.is_grad_enabled():
        # the backward's all-to-alls run on every rank or on none: whether `y` is in the graph must not depend on
        # which experts this rank's rows reached (none: the eager forward returns a constant)
        inputs = [t for t in (x, *(getattr(self, w) for w in shards.names[i])) if t.requires_grad]
        if inputs and not y.requires_grad:
            y = y + sum(t.reshape(-1)[:1].sum() for t in inputs) * 0.0
    back = _Exchange.apply(y, recv, send, g, f"{name}: outputs")
    weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, rows, weighted.to(out.dtype))
