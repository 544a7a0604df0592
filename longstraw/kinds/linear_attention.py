"""Linear attention / SSM (gated DeltaNet, Mamba-style): the durable state is conv + recurrent state.

After the prompt, a linear-attention layer is fully described by its causal-conv window (the last
`conv_kernel_size` inputs, `[1, conv_dim, K]`) and its recurrent state (gated DeltaNet:
`[1, v_heads, k_head_dim, v_head_dim]`). Durable bytes are O(1) in P.

transformers' `LinearAttentionLayer` writes both in place (`copy_`), which would corrupt a captured
state shared by branches and breaks autograd. The branch layer here rebinds instead: it keeps the
captured tensors untouched and holds the branch's own newer states. It reports `record_past = True`
(transformers 5.24: `Cache.is_recording_past`), which makes the model take its functional
conv path (`update_conv_state` + `causal_conv1d_fn`) instead of the in-place single-token update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..hf.cache import snapshot
from .base import LayerState, register_layer_kind, repeat_rows


class RecurrentBranchLayer(LinearAttentionCacheLayerMixin):
    """transformers linear-attention cache layer of one branch, starting from captured states (a `BranchLayer`)."""

    is_sliding = False
    #: a segmented replay carries the states at each segment boundary (`boundary_states`); nothing grows
    carries_segments = True
    grown_tensors: tuple[tuple[str, int], ...] = ()
    #: a ragged decode batch stacks this class's states (`stackable`: subclasses say so in their own body)
    stacks_rows = True

    def __init__(self, conv_states: dict, recurrent_states: dict, number_of_states: int, conv_trim: int = 0):
        LinearAttentionCacheLayerMixin.__init__(self, number_of_states=number_of_states)
        self.record_past = True
        #: how many of the oldest `conv_kernel_size` inputs the window drops (short convolutions keep K − 1)
        self.conv_trim = conv_trim
        for i in range(number_of_states):
            c, r = conv_states.get(i), recurrent_states.get(i)
            self.conv_states[i], self.recurrent_states[i] = c, r
            self.is_conv_states_initialized[i] = c is not None
            self.is_recurrent_states_initialized[i] = r is not None
            self.has_previous_state[i] = c is not None or r is not None
            self.conv_kernel_size[i] = None if c is None else c.shape[-1] + conv_trim

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, conv_kernel_size=None):
        ref = conv_states if conv_states is not None else recurrent_states
        if ref is not None and self.device is None:
            self.device, self.dtype = ref.device, ref.dtype
        if conv_states is not None:
            self.conv_kernel_size[state_idx] = conv_kernel_size or conv_states.shape[-1]
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            self.is_recurrent_states_initialized[state_idx] = True

    def update_conv_state(self, conv_states, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs):
        """Return [previous window | new inputs] for the causal conv; keep the last K inputs (rebinding)."""
        if not self.is_conv_states_initialized[state_idx]:
            RecurrentBranchLayer.lazy_initialization(
                self, conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size
            )
        prev = self.conv_states[state_idx] if self.has_previous_state[state_idx] else None
        full = conv_states if prev is None else torch.cat([prev, conv_states], dim=-1)
        kernel = self.conv_kernel_size[state_idx]
        assert kernel is not None  # set with the conv state (captured window or `lazy_initialization`)
        k = kernel - self.conv_trim
        # a copy, not a view: a view would keep the whole chunk's conv inputs alive with the state (exact mode's
        # boundary states: one chunk's worth per chunk, O(P))
        window = full[..., full.shape[-1] - min(k, full.shape[-1]) :].clone()
        if window.shape[-1] < k:
            window = F.pad(window, (k - window.shape[-1], 0))
        self.conv_states[state_idx] = window
        self.has_previous_state[state_idx] = True
        return full

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        if not self.is_recurrent_states_initialized[state_idx]:
            RecurrentBranchLayer.lazy_initialization(self, recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx] = recurrent_states
        self.has_previous_state[state_idx] = True
        return recurrent_states

    def boundary_states(self) -> dict[tuple[str, int], torch.Tensor]:
        """The conv and recurrent states now, by ("conv" | "recurrent", state index) (those set only)."""
        out = {}
        for which, states in (("conv", self.conv_states), ("recurrent", self.recurrent_states)):
            for idx, t in states.items():
                if t is not None:
                    out[(which, idx)] = t
        return out

    def load_boundary(self, states: dict[tuple[str, int], torch.Tensor], *, reset: bool = False) -> None:
        """Continue from `states` (as `boundary_states` gave them, e.g. leaves of a segmented replay's boundary);
        `reset`: the states not in `states` are unset (the layer as it was when `boundary_states` gave them)."""
        if reset:
            for idx in self.has_previous_state:
                self.conv_states[idx] = self.recurrent_states[idx] = None
                self.has_previous_state[idx] = False
        for (which, idx), t in states.items():
            (self.conv_states if which == "conv" else self.recurrent_states)[idx] = t
            self.has_previous_state[idx] = True

    def start_decoding(self) -> None:
        pass

    def stackable(self) -> bool:
        return bool(vars(type(self)).get("stacks_rows", False))

    def stack_rows(self, layers: list, rows: Sequence[int], room: int = 0) -> RecurrentBranchLayer:
        """`BranchLayer.stack_rows`: the rows' states concatenated along the batch."""
        new = snapshot(self)
        self.stack_states(new, layers)
        return new

    def stack_states(self, new: RecurrentBranchLayer, layers: list) -> None:
        """Set `new` (a copy of this layer) to the states of `layers` concatenated (see `stack_rows`)."""
        for name in ("conv_states", "recurrent_states"):
            setattr(new, name, _cat_states([getattr(layer, name) for layer in layers], name))
        new.has_previous_state = dict(self.has_previous_state)

    def take_row(self, j: int, room: int | None = None) -> RecurrentBranchLayer:
        """`BranchLayer.take_row`: row j's states (views)."""
        new = snapshot(self)
        self.take_states(new, j)
        return new

    def take_states(self, new: RecurrentBranchLayer, j: int) -> None:
        """Set `new` (a copy of this stacked layer) to row j's states."""
        for name in ("conv_states", "recurrent_states"):
            states = getattr(self, name)
            setattr(new, name, {i: None if t is None else t[j : j + 1] for i, t in states.items()})
        new.has_previous_state = dict(self.has_previous_state)

    def split_rows(self, rows: Sequence[int]) -> list:
        return [self.take_row(j) for j in rows]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the branch rows `indices`; states still of batch 1 (shared, expanded) stay as they are."""
        for states in (self.conv_states, self.recurrent_states):
            for i, t in states.items():
                if t is not None and t.shape[0] > 1:
                    states[i] = t[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        for states in (self.conv_states, self.recurrent_states):
            for i, t in states.items():
                states[i] = repeat_rows(t, repeats)

    def expand(self, batch: int) -> RecurrentBranchLayer:
        """View the captured states for `batch` sequences (no copy: branches never write them)."""
        for states in (self.conv_states, self.recurrent_states):
            for i, t in states.items():
                if t is not None:
                    states[i] = t.expand(batch, *t.shape[1:])
        return self

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("longstraw branch layers are not croppable; start a new branch instead")


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


def _first(config, *names):
    return next(getattr(config, n) for n in names if getattr(config, n, None) is not None)


def mamba2_bytes(config, elem: int) -> int:
    """Mamba-2: conv window of K inputs over [x | B | C] + SSM state heads × head_dim × state (field names per
    family, transformers 5.24); Jamba's Mamba-1: conv window over d_inner + SSM state d_inner × d_state."""
    if config.model_type == "jamba":
        d_inner = config.mamba_expand * config.hidden_size
        return elem * d_inner * (config.mamba_d_conv + config.mamba_d_state)
    heads = _first(config, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads")
    head_dim = _first(config, "mamba_head_dim", "mamba_d_head", "mamba_headdim")
    state = _first(config, "ssm_state_size", "mamba_d_state")
    groups = _first(config, "n_groups", "mamba_n_groups", "mamba_ngroups")
    kernel = _first(config, "conv_kernel", "mamba_d_conv")
    return elem * ((heads * head_dim + 2 * groups * state) * kernel + heads * head_dim * state)


@register_layer_kind
class RecurrentState(LayerState):
    """Conv window and recurrent state of a linear-attention layer after the captured prompt."""

    layer_types = ("linear_attention",)
    #: oldest conv inputs the window drops (`RecurrentBranchLayer.conv_trim`)
    conv_trim = 0

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """The conv window and the recurrent state (0 before the first token): gated DeltaNet, Kimi delta attention,
        or Mamba-2 (`mamba2_bytes`)."""
        if tokens == 0:
            return 0
        if not hasattr(config, "linear_num_key_heads") and config.model_type != "kimi_linear":
            return mamba2_bytes(config, elem)
        if config.model_type == "kimi_linear":  # Kimi delta attention: conv over q, k, v + a d × d state per head
            d = config.linear_num_heads * config.linear_head_dim
            return elem * (3 * d * config.linear_conv_kernel_dim + config.linear_num_heads * config.linear_head_dim**2)
        # gated DeltaNet (Qwen3-Next, Qwen3.5): conv window over [q | k | v], recurrent state per value head
        conv_dim = (
            2 * config.linear_num_key_heads * config.linear_key_head_dim
            + config.linear_num_value_heads * config.linear_value_head_dim
        )
        rec = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        return elem * (conv_dim * config.linear_conv_kernel_dim + rec)

    @classmethod
    def recurrence_bytes(cls, config) -> int:
        if not getattr(config, "linear_num_value_heads", None):  # Mamba: no gated DeltaNet term
            return 0
        # gated DeltaNet's chunked recurrence (64-token chunks, float32): per value head, the intra-chunk
        # scores and decay mask (3 × 64) and the key / value corrections (4 × (dk + dv)), about twice over
        # live in transformers 5.24's torch path
        return (
            2
            * 4
            * config.linear_num_value_heads
            * (3 * 64 + 4 * (config.linear_key_head_dim + config.linear_value_head_dim))
        )

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        self.number_of_states = int(getattr(config, "number_of_conv_states", 1))
        self.conv_states: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}
        #: exact mode: (conv_states, recurrent_states) before each captured chunk, O(P / chunk) small states
        self.boundaries: list[tuple[dict, dict]] = []

    def branch(self, batch: int = 1) -> RecurrentBranchLayer:
        layer = RecurrentBranchLayer(self.conv_states, self.recurrent_states, self.number_of_states, self.conv_trim)
        return layer.expand(batch) if batch > 1 else layer

    def commit(self, branch_layer: RecurrentBranchLayer, n: int) -> None:
        for i in range(self.number_of_states):
            if branch_layer.is_conv_states_initialized[i]:
                conv = branch_layer.conv_states[i]
                assert conv is not None  # initialized: written
                self.conv_states[i] = conv.detach()
            if branch_layer.is_recurrent_states_initialized[i]:
                rec = branch_layer.recurrent_states[i]
                assert rec is not None  # initialized: written
                self.recurrent_states[i] = rec.detach()
        self.length += n

    def tensors(self) -> list[torch.Tensor]:
        return [*self.conv_states.values(), *self.recurrent_states.values()]

    def release(self) -> None:
        self.conv_states, self.recurrent_states = {}, {}
        self.boundaries = []

    # ------------------------------------------------------------------ exact mode
    supports_exact = True

    def mark_boundary(self) -> None:
        self.boundaries.append((dict(self.conv_states), dict(self.recurrent_states)))

    def require_grad(self) -> None:
        """The final states and every boundary state become leaves collecting their gradient."""
        for states in (self.conv_states, self.recurrent_states, *[d for b in self.boundaries for d in b]):
            for i, t in states.items():
                states[i] = t.detach().requires_grad_(True)

    def reverse_branch(self, chunk: int, start: int) -> RecurrentBranchLayer:
        conv, rec = self.boundaries[chunk]
        return RecurrentBranchLayer(conv, rec, self.number_of_states, self.conv_trim)

    def chunk_outputs(self, chunk, start, end, branch_layer):
        # the states this chunk ends in are what the next chunk (or the replays) started from
        last = (self.conv_states, self.recurrent_states)
        nxt = self.boundaries[chunk + 1] if chunk + 1 < len(self.boundaries) else last
        out = []
        for produced, leaves in ((branch_layer.conv_states, nxt[0]), (branch_layer.recurrent_states, nxt[1])):
            for i, leaf in leaves.items():
                if leaf.grad is not None and produced.get(i) is not None:
                    out.append((produced[i], leaf.grad))
        return out
