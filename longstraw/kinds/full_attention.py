"""Full attention: the durable state is the post-RoPE K and V of every prompt token.

Durable bytes per prompt token: 2 · kv_heads · head_dim · dtype size. The K/V buffers are allocated
once at their final length (P − 1) and filled chunk by chunk, so capture never concatenates or copies
what it already holds. A branch keeps its own K/V apart and attention merges the two parts
(`longstraw.ops.attention.split_attention`), so the prompt K/V is never copied into a branch.

Growth without a copy per token: while decoding or extending a branch (no autograd), a branch layer told how many
tokens are still to come (`reserve`) copies its own K/V once into a buffer with room for them (`Room`) and then writes
each new token in place; with autograd (replay) or nothing reserved it concatenates as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..hf.cache import snapshot
from ..ops.attention import split_attention
from ..ops.quant import QuantizedTokens, host_or_device
from ..ops.ragged_attention import ragged_attention
from . import base
from .base import (
    LayerState,
    PromptBranchLayer,
    grown_bytes,
    head_dim,
    layer_config,
    register_layer_kind,
    repeat_rows,
)

#: the least room a copy makes (tokens), however few it has yet
ROOM_MIN = 256


def room_for(used: int, wanted: int) -> int:
    """Columns of room to make after `used` own tokens for `wanted` more: all of them, but at most as many again as
    the layer holds (at least `ROOM_MIN`), so that a long cap that is rarely reached (a response stopping early)
    is not held in full from the first token; growing past it copies again, each copy at least doubling the room
    (a token is copied O(1) times on average)."""
    return max(0, min(wanted, max(ROOM_MIN, used)))


@dataclass(eq=False)
class Room:
    """Own K/V buffers `[B, Hkv, capacity, D]` whose first `used` columns hold keys (and values) and whose rest is
    room for more. Only `writer` (the layer that made it, held weakly) writes into it, and only while its keys are a
    view of it that ends at `used` (its first rows, from some column): copies of the layer (`snapshot`, a fork) and
    views handed out earlier never see columns written after them. A ragged batch's rows can each get a room of their
    own over the batch's buffer (`AttentionBranchLayer.split_rows`: disjoint rows, one writer each)."""

    keys: torch.Tensor
    values: torch.Tensor
    used: int
    writer: weakref.ref

    @classmethod
    def allocate(cls, k: torch.Tensor, v: torch.Tensor, rows: int, capacity: int, used: int, writer) -> Room:
        """Empty buffers of `rows` rows and `capacity` columns shaped like `k` / `v` `[B, Hkv, T, D]` (heads, head
        dims, dtype, device), whose first `used` columns the caller fills, written by `writer`."""
        keys = k.new_empty(rows, k.shape[1], capacity, k.shape[3])
        values = v.new_empty(rows, v.shape[1], capacity, v.shape[3])
        return cls(keys, values, used, weakref.ref(writer))

    def start(self, layer, keys: torch.Tensor, values: torch.Tensor) -> int | None:
        """The column where `layer`'s own `keys` / `values` start when `layer` writes this room and they are its
        latest view (the first rows, up to `used`); else None."""
        if self.writer() is not layer:
            return None
        start = _column(self.keys, keys)
        if start is None or start + keys.shape[-2] != self.used or _column(self.values, values) != start:
            return None
        return start

    def takes(self, layer, keys: torch.Tensor, values: torch.Tensor, new: torch.Tensor) -> int | None:
        """`start`, when `new` `[B, Hkv, n, D]` also fits in the room after the keys; else None."""
        if self.used + new.shape[-2] > self.keys.shape[-2] or new.shape[:2] != keys.shape[:2]:
            return None
        if new.dtype != keys.dtype:
            return None
        return self.start(layer, keys, values)


def _same_part(a, b) -> bool:
    """Whether two prompt parts are the same keys (views of one state's buffer are made per branch)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    return a is b


def _own_width(layer) -> int:
    return 0 if layer.keys is None else layer.keys.shape[-2]


def _column(buffer: torch.Tensor, view: torch.Tensor) -> int | None:
    """Where `view` `[b ≤ B, H, c, D]` starts in `buffer` `[B, H, C, D]`, when it is `buffer[:b, :, s:s+c]`: s."""
    if view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        return None
    if view.shape[0] > buffer.shape[0] or view.shape[1] != buffer.shape[1] or view.shape[3] != buffer.shape[3]:
        return None
    if view.stride() != buffer.stride():
        return None
    offset = view.storage_offset() - buffer.storage_offset()
    step = buffer.stride(2)
    if offset < 0 or offset % step or offset // step + view.shape[2] > buffer.shape[2]:
        return None
    return offset // step


class AttentionBranchLayer(PromptBranchLayer):
    """transformers cache layer of one branch over a read-only prompt K/V.

    `update` appends the branch's new K/V to its own part only and returns that own part
    `[B, Hkv, R_seen, D]`; the registered longstraw attention reads the prompt part from `prompt_k` /
    `prompt_v`. Positions: prompt keys start at `prompt_start`, own keys at `prompt_length`.
    """

    is_sliding = False
    is_croppable = False
    carries_segments = True
    #: a ragged decode batch stacks this class and the subclasses that say so in their own body (`stackable`: the
    #: hybrid layer); the others (compressed, context parallel) hold more than the own K/V it stacks
    stacks_rows = True
    grown_tensors = (("keys", -2), ("values", -2))
    #: sliding-window attention: keys after (query position − window) only; None: every earlier key
    window: int | None = None
    #: chunked local attention: the attention chunk size (keys of the query's own chunk only); None: none
    chunk: int | None = None
    #: segmented replay (`longstraw.replay.segments`): the trajectory's own K/V before this forward `[1, Hkv, C, D]`,
    #: read in place as a part of their own from position `carried_start` (`keys` then holds this forward's only); None:
    #: the own K/V are all in `keys`
    carried_k: torch.Tensor | None = None
    carried_v: torch.Tensor | None = None
    carried_start: int = 0
    #: a ragged decode batch (`longstraw.ragged`): rows of different own lengths right-aligned in `keys` / `values`;
    #: per row the leading columns that are padding and the own tokens trimming dropped before its first key (as
    #: `own_offset` counts them for all rows otherwise); None: every row's own keys are all of `keys`
    row_pad: list[int] | None = None
    row_offset: list[int] | None = None
    #: the layout (`row_pad`, `row_offset`) of the keys the latest `update` returned, before trimming: what the
    #: attention of that forward reads
    row_layout: tuple[list[int], list[int]] | None = None
    #: tokens still to come while decoding or extending (set through `BranchCache.reserve`): an append that copies the
    #: own K/V makes room for them (`Room`), so that the next appends write in place
    reserve: int = 0
    #: the buffer the own K/V are a view of, with room after them; None: none
    room: Room | None = None

    def __init__(
        self,
        prompt_k,
        prompt_v,
        prompt_length: int,
        prompt_start: int = 0,
        window: int | None = None,
        chunk: int | None = None,
    ):
        super().__init__()
        self.chunk = chunk
        self.prompt_k, self.prompt_v = prompt_k, prompt_v
        self.prompt_length = prompt_length
        self.prompt_start = prompt_start
        self.window = window
        self.is_sliding = window is not None
        self.is_initialized = True
        #: decoding only (set by the sampler): keep just the last window − 1 own K/V of a sliding layer
        self.trim = False
        #: own positions dropped by trimming before `keys`
        self.own_offset = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device

    def start_decoding(self) -> None:
        self.trim = True

    def stackable(self) -> bool:
        return bool(vars(type(self)).get("stacks_rows", False)) and self.carried_k is None

    def stack_rows(self, layers: list, rows: Sequence[int], room: int = 0) -> AttentionBranchLayer:
        """`BranchLayer.stack_rows`: the own K/V right-aligned and padded (`row_pad`, `row_offset`) in one buffer with
        `room` more columns (at most `room_for`) that the batch's decoding writes in place (`Room`)."""
        new = snapshot(self)
        self.stack_kv(new, layers, rows, room)
        return new

    def stack_kv(self, new: AttentionBranchLayer, layers: list, rows: Sequence[int], room: int) -> None:
        """Set `new` (a copy of this layer) to the stacked own K/V of `layers` (see `stack_rows`)."""
        if any(not _same_part(layer.prompt_k, self.prompt_k) for layer in layers):
            raise ValueError("stack_rows: the branches read different prompt states")
        width = max(_own_width(layer) for layer in layers)
        like = next((layer for layer in layers if layer.keys is not None), None)
        pads, offsets = [], []
        for layer, n in zip(layers, rows):
            pads += [width - _own_width(layer)] * n
            offsets += [layer.own_offset] * n
        new.keys = new.values = new.room = None
        if like is not None:
            buffer = Room.allocate(like.keys, like.values, sum(rows), width + room_for(width, room), width, new)
            keys, values = buffer.keys, buffer.values
            r = 0
            for layer, n in zip(layers, rows):  # each branch's own K/V copied once, into its rows
                own = _own_width(layer)
                keys[r : r + n, :, : width - own].zero_()  # padding: masked, but finite
                values[r : r + n, :, : width - own].zero_()
                if own:
                    keys[r : r + n, :, width - own : width].copy_(layer.keys)  # batch 1 or n rows
                    values[r : r + n, :, width - own : width].copy_(layer.values)
                r += n
            new.keys, new.values = keys[:, :, :width], values[:, :, :width]
            new.room = buffer
        new.row_pad, new.row_offset, new.row_layout = pads, offsets, None

    def take_row(self, j: int, room: int | None = None) -> AttentionBranchLayer:
        """`BranchLayer.take_row`: row j's own K/V, views of the batch's (`room` None) or a copy with `room` columns
        to grow into in place."""
        new = snapshot(self)
        self.take_kv(new, j, room)
        return new

    def take_kv(self, new: AttentionBranchLayer, j: int, room: int | None) -> None:
        """Set `new` (a copy of this stacked layer) to row j's own K/V (see `take_row`)."""
        new.room = None
        if self.row_pad is not None and self.row_offset is not None:
            p = self.row_pad[j]
            if self.keys is not None and self.values is not None:
                new.keys, new.values = self.keys[j : j + 1, :, p:], self.values[j : j + 1, :, p:]
                if new.keys.shape[-2] == 0:
                    new.keys = new.values = None
            new.own_offset = self.row_offset[j]
        elif self.keys is not None and self.values is not None:
            new.keys, new.values = self.keys[j : j + 1], self.values[j : j + 1]
        new.row_pad = new.row_offset = new.row_layout = None
        if room is not None and new.keys is not None and new.values is not None:
            n = new.keys.shape[-2]
            own = Room.allocate(new.keys, new.values, 1, n + room, n, new)
            own.keys[:, :, :n].copy_(new.keys)
            own.values[:, :, :n].copy_(new.values)
            new.keys, new.values, new.room = own.keys[:, :, :n], own.values[:, :, :n], own

    def split_rows(self, rows: Sequence[int]) -> list:
        """`BranchLayer.split_rows`: views of the batch's buffer, each the only writer of its row's room after its keys
        (`Room`): when the batch is done (every row leaves at once), each branch grows on in place in its row. This
        layer stops writing its room."""
        out = [self.take_row(j) for j in rows]
        room = self.room
        if room is None or self.keys is None or self.values is None:
            return out
        if room.start(self, self.keys, self.values) is None:
            return out
        self.room = None
        for j, row in zip(rows, out):
            if row.keys is not None:
                row.room = Room(room.keys[j : j + 1], room.values[j : j + 1], room.used, weakref.ref(row))
        return out

    @property
    def reads_carried_in_place(self) -> bool:  # type: ignore[override]  # a class attribute on the base
        """This class reads a segmented replay's earlier own K/V in place (`carried_k`); its subclasses (hybrid,
        compressed, context parallel) hold them as their own `keys` / `values`."""
        return type(self) is AttentionBranchLayer

    @property
    def own_from_update(self) -> bool:  # type: ignore[override]  # a class attribute on the base
        """This class's own K/V are what `update` appends; its subclasses add states or entries elsewhere (hybrid
        layers' recurrent states, compressed entries) or attend across ranks."""
        return type(self) is AttentionBranchLayer

    def segment_offset(self) -> int:
        return self.own_offset

    def enter_segment(self, before: dict[str, torch.Tensor | None], offset: int) -> None:
        self.trim = False
        if not self.reads_carried_in_place:
            self.own_offset = offset
            return super().enter_segment(before, offset)
        # the earlier own K/V read in place, from position `carried_start`: this segment's forward appends its own only
        self.carried_k, self.carried_v = before["keys"], before["values"]
        self.carried_start = self.prompt_length + offset
        self.keys = self.values = None
        self.own_offset = offset + (0 if self.carried_k is None else self.carried_k.shape[-2])

    def attend(
        self,
        module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        q_start: int,
        own_start: int,
        scale: float | None,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        block: int,
    ) -> torch.Tensor:
        """The attention of queries `q` `[B, H, R, D]` (positions from `q_start`) over [the prompt part | the branch's
        own keys `k` `[B, Hkv, S, D]` and values `v` (positions from `own_start`)]: `[B, H, R, Dv]`
        (`longstraw.hf.cache.Attends`; what the longstraw attention calls). The split attention over the local prompt
        K/V, the earlier own K/V a segmented replay carries and these; in a ragged decode batch, per row
        (`longstraw.ops.ragged_attention`). The context-parallel layers attend across the ranks instead."""
        if self.row_layout is not None:  # a ragged decode batch (`longstraw.ragged`): rows of different own lengths
            pads, offsets = self.row_layout
            own_starts = [self.prompt_length + o for o in offsets]
            return ragged_attention(
                q, k, v, self.prompt_k, self.prompt_v, pads=pads, own_starts=own_starts,
                prompt_start=self.prompt_start, chunk=self.chunk, scale=scale, window=window, softcap=softcap,
                sinks=sinks, block=block,
            )  # fmt: skip
        carried = None
        if self.carried_k is not None and self.carried_v is not None:  # a segmented replay's earlier own K/V
            carried = (self.carried_k, self.carried_v, self.carried_start)
        return split_attention(
            q, k, v, self.prompt_k, self.prompt_v, q_start=q_start, own_start=own_start,
            prompt_start=self.prompt_start, chunk=self.chunk, carried=carried, scale=scale, window=window,
            softcap=softcap, sinks=sinks, block=block,
        )  # fmt: skip

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = self._append(key_states, value_states)
        self.keys, self.values = keys, values
        if self.row_pad is not None:
            assert self.row_offset is not None  # set together (`stack_rows`)
            self.row_layout = (self.row_pad, self.row_offset)
        if self.trim and self.window is not None:
            # later queries see keys after (their position − window): the last window − 1 are all they read
            drop = max(0, keys.shape[-2] - (self.window - 1))
            self.keys, self.values = keys[:, :, drop:], values[:, :, drop:]
            self.own_offset += drop
            if self.row_pad is not None and self.row_offset is not None:  # padding goes first, then own keys
                self.row_offset = [o + max(0, drop - p) for p, o in zip(self.row_pad, self.row_offset)]
                self.row_pad = [max(0, p - drop) for p in self.row_pad]
        return keys, values

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The own K/V after appending `k`, `v` `[B, Hkv, n, D]`: written into the room in place where this layer
        may (`Room.takes`), else concatenated; without autograd and with tokens reserved, concatenation goes into a
        new room for them (one copy of the own K/V instead of one per token)."""
        old_k, old_v = self.keys, self.values
        graph = torch.is_grad_enabled() and (
            k.requires_grad or v.requires_grad or (old_k is not None and old_k.requires_grad)
        )
        if old_k is not None and old_v is not None and self.room is not None and not graph:
            start = self.room.takes(self, old_k, old_v, k)
            if start is not None:
                room, n, b = self.room, k.shape[-2], old_k.shape[0]  # the buffer's first b rows
                room.keys[:b, :, room.used : room.used + n].copy_(k)
                room.values[:b, :, room.used : room.used + n].copy_(v)
                room.used += n
                return room.keys[:b, :, start : room.used], room.values[:b, :, start : room.used]
        if graph or self.reserve <= 0:
            if old_k is None or old_v is None:
                return k, v
            return torch.cat([old_k, k], dim=-2), torch.cat([old_v, v], dim=-2)
        old = 0 if old_k is None else old_k.shape[-2]
        used = old + k.shape[-2]
        room = Room.allocate(k, v, k.shape[0], used + room_for(used, self.reserve), used, self)
        if old_k is not None and old_v is not None:
            room.keys[:, :, :old].copy_(old_k)
            room.values[:, :, :old].copy_(old_v)
        room.keys[:, :, old:used].copy_(k)
        room.values[:, :, old:used].copy_(v)
        self.room = room
        return room.keys[:, :, :used], room.values[:, :, :used]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the branch rows `indices` (sequences still decoding); the shared prompt part is untouched. A ragged
        batch also drops the padding columns no remaining row needs. A layer writing a room (`Room`) moves the rows
        it keeps to its first rows in place (no copy of the batch); rows that leave must be taken out before
        (`take_row`)."""
        if self.keys is not None:
            assert self.values is not None  # appended with the keys
            start = (
                None if self.room is None or torch.is_grad_enabled() else self.room.start(self, self.keys, self.values)
            )
            if start is not None and self.room is not None:
                room, rows = self.room, indices.tolist()
                if rows != sorted(rows) or len(set(rows)) != len(rows):
                    raise ValueError(f"batch_select_indices: rows must be distinct and ascending; got {rows}")
                for i, r in enumerate(rows):  # r >= i: each row moves down onto a row already moved or left
                    if r != i:
                        room.keys[i, :, start : room.used].copy_(room.keys[r, :, start : room.used])
                        room.values[i, :, start : room.used].copy_(room.values[r, :, start : room.used])
                n = len(rows)
                self.keys, self.values = room.keys[:n, :, start : room.used], room.values[:n, :, start : room.used]
            else:
                self.keys, self.values = self.keys[indices], self.values[indices]
        if self.row_pad is not None and self.row_offset is not None:
            rows = indices.tolist()
            pad, self.row_offset = [self.row_pad[i] for i in rows], [self.row_offset[i] for i in rows]
            cut = min(pad, default=0)
            if cut and self.keys is not None and self.values is not None:
                self.keys, self.values = self.keys[:, :, cut:], self.values[:, :, cut:]
            self.row_pad = [p - cut for p in pad]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys, self.values = repeat_rows(self.keys, repeats), repeat_rows(self.values, repeats)

    @property
    def own_length(self) -> int:
        return self.own_offset + super().own_length


@register_layer_kind
class KVState(LayerState):
    """Prompt K/V of a full-attention layer: keys `[1, Hkv, P−1, D]`, values `[1, Hkv, P−1, Dv]`."""

    layer_types: tuple[str, ...] = ("full_attention",)
    uses_attention_interface = True
    grows_with_prompt = True
    appends_own_kv = True
    window: int | None = None
    chunk: int | None = None

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """Keys and values of every prompt token: 2 × tokens × Hkv × D."""
        c = layer_config(config, layer_idx)
        return 2 * grown_bytes(tokens, c.num_key_value_heads, head_dim(c), elem, state_dtype)

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        #: plain tensors, or 8-bit `QuantizedTokens` when `state_dtype` is set (keys and values alike)
        self.keys: torch.Tensor | QuantizedTokens | None = None
        self.values: torch.Tensor | QuantizedTokens | None = None

    @property
    def start(self) -> int:
        """Absolute position of the first stored key."""
        return 0

    def stored(self):
        if self.keys is None:
            return None, None
        if isinstance(self.keys, QuantizedTokens):
            return self.keys, self.values
        n = self.length - self.start
        assert isinstance(self.values, torch.Tensor)  # stored as the keys are
        return self.keys[:, :, :n], self.values[:, :, :n]

    def prefix_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every prompt position's keys and values are kept, in full precision unless stored in 8 bits."""
        if not isinstance(self.keys, torch.Tensor):
            return None
        k, v = self.stored()
        return k[:, :, :n], v[:, :, :n]

    def branch(self, batch: int = 1) -> AttentionBranchLayer:
        k, v = self.stored()  # batch 1, shared by all `batch` sequences (split attention folds them)
        return AttentionBranchLayer(k, v, self.length, self.start, self.window, self.chunk)

    supports_compression = True
    supports_offload = True

    def commit(self, branch_layer: AttentionBranchLayer, n: int) -> None:
        k, v = branch_layer.keys, branch_layer.values
        assert k is not None and v is not None  # the branch ran the chunk
        if k.shape[-2] != n:
            raise RuntimeError(f"layer {self.layer_idx}: chunk of {n} tokens produced {k.shape[-2]} keys")
        if self.state_dtype is not None:  # 8-bit keys and values with per-block scales
            if self.keys is None:
                self.keys = QuantizedTokens(k, self.capacity, self.state_dtype, device=self.state_device)
                self.values = QuantizedTokens(v, self.capacity, self.state_dtype, device=self.state_device)
            assert isinstance(self.keys, QuantizedTokens) and isinstance(self.values, QuantizedTokens)
            self.keys.append(k)
            self.values.append(v)
            self.length += n
            return
        if self.keys is None and self.state_device is not None:  # host memory, pinned for a GPU model
            self.keys = host_or_device((*k.shape[:2], self.capacity, k.shape[3]), k.dtype, self.state_device, k.device)
            self.values = host_or_device(
                (*v.shape[:2], self.capacity, v.shape[3]), v.dtype, self.state_device, v.device
            )
        if self.keys is None:
            self.keys = base.empty_state(k, (*k.shape[:2], self.capacity, k.shape[3]))
            self.values = base.empty_state(v, (*v.shape[:2], self.capacity, v.shape[3]))
        if self.length + n > self.capacity:
            raise RuntimeError(f"layer {self.layer_idx}: committing past the captured length {self.capacity}")
        assert isinstance(self.keys, torch.Tensor) and isinstance(self.values, torch.Tensor)  # state_dtype is None
        self.keys[:, :, self.length : self.length + n] = k
        self.values[:, :, self.length : self.length + n] = v
        self.length += n

    def tensors(self) -> list[torch.Tensor]:
        if isinstance(self.keys, QuantizedTokens):
            assert isinstance(self.values, QuantizedTokens)  # quantized as the keys are
            return self.keys.tensors() + self.values.tensors()
        assert not isinstance(self.values, QuantizedTokens)
        return [t for t in (self.keys, self.values) if t is not None]

    def release(self) -> None:
        self.keys = self.values = None

    # ------------------------------------------------------------------ exact mode
    supports_exact = True

    def require_grad(self) -> None:
        if self.keys is not None:
            # exact mode refuses a quantized state
            assert isinstance(self.keys, torch.Tensor) and isinstance(self.values, torch.Tensor)
            self.keys.requires_grad_(True)
            self.values.requires_grad_(True)

    def reverse_branch(self, chunk: int, start: int) -> AttentionBranchLayer:
        # positions before `start` as views of the leaves: their gradient lands in keys.grad / values.grad
        assert not isinstance(self.keys, QuantizedTokens) and not isinstance(self.values, QuantizedTokens)  # exact mode
        k = None if self.keys is None else self.keys[:, :, :start]
        v = None if self.values is None else self.values[:, :, :start]
        return AttentionBranchLayer(k, v, start, 0, self.window, self.chunk)

    def chunk_outputs(self, chunk, start, end, branch_layer):
        out = []
        for own, leaf in ((branch_layer.keys, self.keys), (branch_layer.values, self.values)):
            if leaf.grad is not None:
                out.append((own, leaf.grad[:, :, start:end]))
        return out
