"""Linear-attention (recurrent) layers over a process group: the conv and recurrent state travels rank to rank across
the slice boundaries (`RecurrentRelay`), and in exact mode's reverse pass its gradient travels back
(`RecurrentRelayExact`)."""

from __future__ import annotations

import torch

from ...hf.cache import BranchCache
from ...kinds.linear_attention import RecurrentBranchLayer, RecurrentState
from ..collectives import Group
from .slices import rank_sum


def state_slots(branch: RecurrentBranchLayer, number: int) -> list[tuple[dict, int, bool]]:
    """(dict, index, whether set) of a linear-attention branch layer's conv and recurrent state slots, in order."""
    return [
        (states, i, bool(done[i]) and states.get(i) is not None)
        for i in range(number)
        for states, done in (
            (branch.conv_states, branch.is_conv_states_initialized),
            (branch.recurrent_states, branch.is_recurrent_states_initialized),
        )
    ]


class RecurrentRelay:
    """Carries a linear-attention layer's conv and recurrent state across the slice boundaries during capture: rank r
    waits for the state at the end of rank r − 1's slice before its decoder layer runs (a forward pre-hook puts it in
    the branch layer the model reads), and sends its own end state to rank r + 1 after the layer (a forward hook).
    Serial per layer: rank r's layer l starts when rank r − 1's layer l is done; consecutive linear layers pipeline
    (rank r − 1 runs layer l + 1 while rank r runs layer l), an attention layer's all-gather joins them again."""

    def __init__(self, group: Group, cache: BranchCache, layer_idx: int, state: RecurrentState, device):
        self.group, self.cache, self.layer_idx, self.state, self.device = group, cache, layer_idx, state, device
        self.name = f"capture layer {layer_idx}: linear-attention state"

    @staticmethod
    def pack(branch: RecurrentBranchLayer, number: int) -> list[torch.Tensor]:
        slots = state_slots(branch, number)
        return [
            torch.tensor([int(present) for _, _, present in slots], dtype=torch.int64),
            *[states[i] for states, i, present in slots if present],
        ]

    @staticmethod
    def unpack(tensors: list[torch.Tensor], number: int) -> tuple[dict, dict]:
        flags, rest = tensors[0].tolist(), list(tensors[1:])
        conv: dict[int, torch.Tensor] = {}
        rec: dict[int, torch.Tensor] = {}
        for i in range(number):
            for which, states in ((0, conv), (1, rec)):
                if flags[2 * i + which]:
                    states[i] = rest.pop(0)
        return conv, rec

    def before(self, module, args):
        g, st = self.group, self.state
        if g.rank > 0:
            conv, rec = self.unpack(g.recv(self.name, g.rank - 1, self.device), st.number_of_states)
            self.cache.layers[self.layer_idx] = RecurrentBranchLayer(conv, rec, st.number_of_states, st.conv_trim)

    def after(self, module, args, output):
        g = self.group
        if g.rank < g.size - 1:
            g.send(self.name, self.pack(self.cache.layers[self.layer_idx], self.state.number_of_states), g.rank + 1)


def present_states(branch: RecurrentBranchLayer, number: int) -> list[tuple[dict, int]]:
    """(dict, index) of a branch layer's states that are set, in `RecurrentRelay.pack` order."""
    return [(states, i) for states, i, present in state_slots(branch, number) if present]


class _RelayIn(torch.autograd.Function):
    """Exact mode's reverse pass, rank r > 0: the states that rank r − 1's slice ended in enter this rank's layer
    through this function; its backward sends their gradient back to rank r − 1. `anchor` (a scalar that requires
    grad) keeps the function in the graph whatever else requires grad."""

    @staticmethod
    def forward(ctx, relay, anchor, *states):
        ctx.relay = relay
        return tuple(t.view_as(t) for t in states)

    @staticmethod
    def backward(ctx, *grads):
        relay = ctx.relay
        relay.group.send(
            relay.grad_name,
            [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, relay.received)],
            relay.group.rank - 1,
        )
        return (None, None) + (None,) * len(grads)


class _RelayOut(torch.autograd.Function):
    """Exact mode's reverse pass: the layer's output passes through this function with the states its slice ends in;
    its backward (run when the output's gradient is there) adds their gradient: received from rank r + 1, or on the
    last rank the final states' gradient summed over every rank's replays."""

    @staticmethod
    def forward(ctx, relay, hidden, anchor, *states):
        ctx.relay, ctx.shapes = relay, [(t.shape, t.dtype) for t in states]
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        relay = ctx.relay
        g = relay.group
        if g.rank < g.size - 1:
            got = g.recv(relay.grad_name, g.rank + 1, relay.device)
        else:
            got = relay.final_grads
        return (None, grad, None, *[t.to(dtype) for t, (_, dtype) in zip(got, ctx.shapes)])


class RecurrentRelayExact(RecurrentRelay):
    """`RecurrentRelay` for exact mode's reverse pass: the same forward relay (rank r starts from rank r − 1's end
    states), with the state gradients travelling back rank r + 1 → r through `_RelayOut` / `_RelayIn`. Serial per
    layer, as the forward relay is: rank r's layer l backward completes when rank r + 1's has sent its gradient."""

    def __init__(self, group, cache, layer_idx, state, device, final_grads):
        super().__init__(group, cache, layer_idx, state, device)
        self.grad_name = f"reverse pass layer {layer_idx}: linear-attention state gradient"
        self.final_grads = final_grads
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.received = []

    def before(self, module, args):
        g, st = self.group, self.state
        if g.rank == 0:
            return
        conv, rec = self.unpack(g.recv(self.name, g.rank - 1, self.device), st.number_of_states)
        branch = RecurrentBranchLayer(conv, rec, st.number_of_states, st.conv_trim)
        slots = present_states(branch, st.number_of_states)
        self.received = [states[i] for states, i in slots]
        for (states, i), t in zip(slots, _RelayIn.apply(self, self.anchor, *self.received)):
            states[i] = t
        self.cache.layers[self.layer_idx] = branch

    def after(self, module, args, output):
        g, st = self.group, self.state
        branch = self.cache.layers[self.layer_idx]
        ends = [states[i] for states, i in present_states(branch, st.number_of_states)]
        if g.rank < g.size - 1:
            g.send(self.name, self.pack(branch, st.number_of_states), g.rank + 1)
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = _RelayOut.apply(self, hidden, self.anchor, *ends)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


class RecurrentKind:
    """The context parallelism of a linear-attention layer (`CollectiveKind`): its O(1) state is replicated; a slice
    starts from the state at the end of the slice before it (`RecurrentRelay`), runs chunk by chunk (only the relayed
    state crosses ranks), and the last rank's end state is every rank's; in the reverse pass the state gradients
    travel back rank to rank (`RecurrentRelayExact`)."""

    chunked = True
    sliced = False
    batches_replays = True

    def slice_state(self, layer, config, i: int, s: int, e: int, compressed):
        return layer

    def capture_branch(self, state, g: Group, bounds, i: int, chunk: int):
        # the first rank starts from nothing, the others from what the relay brings
        return RecurrentBranchLayer({}, {}, state.number_of_states, state.conv_trim)

    def capture_relay(self, state, g: Group, cache, i: int, device):
        return RecurrentRelay(g, cache, i, state, device)

    def finish_capture(self, state, branch, g: Group, bounds, captured: int, i: int) -> None:
        """The state at the end of the prompt, from the last rank to every rank."""
        mine = RecurrentRelay.pack(branch, state.number_of_states)
        final = g.broadcast(f"capture layer {i}: final linear-attention state", mine, src=g.size - 1)
        conv, rec = RecurrentRelay.unpack(final, state.number_of_states)
        state.commit(RecurrentBranchLayer(conv, rec, state.number_of_states, state.conv_trim), captured)

    def replay_branch(self, state, g: Group, lengths: list[int], start: int, grown, batch: int = 1):
        return state.branch(batch) if grown is None else grown

    def sample_branch(self, state, g: Group, start: int, batch: int):
        return state.branch(batch)

    def reverse_gradient(self, state, g: Group, i: int):
        """The final states' gradient: every rank's replays added theirs to its own copy; summed in rank order (a
        collective)."""
        final = present_states(state.branch(), state.number_of_states)
        mine = [states[k].grad if states[k].grad is not None else torch.zeros_like(states[k]) for states, k in final]
        return rank_sum(g.all_gather(f"reverse pass layer {i}: final linear-attention state gradient", mine))

    def reverse_relay(self, state, g: Group, cache, i: int, device, gathered):
        return RecurrentRelayExact(g, cache, i, state, device, gathered)

    def reverse_roots(self, state, branch, gathered, s: int, e: int, prompt_length: int) -> list:
        return []  # its gradient travels through the relay
