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
Memory: E/N experts per rank; the dispatch buffers are T·k rows of the hidden size, out and back.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .collectives import Group

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
    count; `load[i]` the rows each call of module i received on this rank (appended per call)."""

    group: Group
    modules: list[torch.nn.Module]
    first: list[int]
    count: list[int]
    load: list[list[int]] = field(default_factory=list)


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
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 2 and p.shape[0] == e:  # one slice per expert (weights, and biases `[E, out]`)
                local = torch.nn.Parameter(p.detach()[first : first + n].clone(), requires_grad=p.requires_grad)
                setattr(m, name, local)
        m.num_experts = n
        _SHARDED[m] = (shards, i)
        shards.first.append(first)
        shards.count.append(n)
        shards.load.append([])
    _register()
    model.set_experts_implementation(IMPLEMENTATION)
    return shards


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

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
            group._fail(name, err)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        try:
            dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group.group)
        except RuntimeError as err:
            ctx.group._fail(f"{ctx.name} (backward)", err)
        return back, None, None, None, None


def _counts(group: Group, send: list[int], name: str) -> list[int]:
    """How many rows each rank sends to this one (an all-to-all of one int per rank)."""
    out = torch.empty(group.size, dtype=torch.int64)
    try:
        dist.all_to_all_single(out, torch.tensor(send, dtype=torch.int64), group=group.group)
    except RuntimeError as err:
        group._fail(name, err)
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
            g._fail(f"{name}: expert ids", err)
    shards.load[i].append(int(sum(recv)))
    eager = type(self).forward.__wrapped__
    y = eager(self, x, ids[:, None], torch.ones(ids.numel(), 1, dtype=top_k_weights.dtype, device=x.device))
    back = _Exchange.apply(y, recv, send, g, f"{name}: outputs")
    weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, rows, weighted.to(out.dtype))
