"""Full attention: the durable state is the post-RoPE K and V of every prompt token.

Durable bytes per prompt token: 2 · kv_heads · head_dim · dtype size. The K/V buffers are allocated
once at their final length (P − 1) and filled chunk by chunk, so capture never concatenates or copies
what it already holds. A branch keeps its own K/V apart and attention merges the two parts
(`longstraw.ops.attention.split_attention`), so the prompt K/V is never copied into a branch.
"""

from __future__ import annotations

import torch

from ..ops.quant import QuantizedTokens, host_or_device
from . import base
from .base import LayerState, PromptBranchLayer, register_layer_kind, repeat_rows


class AttentionBranchLayer(PromptBranchLayer):
    """transformers cache layer of one branch over a read-only prompt K/V.

    `update` appends the branch's new K/V to its own part only and returns that own part
    `[B, Hkv, R_seen, D]`; the registered longstraw attention reads the prompt part from `prompt_k` /
    `prompt_v`. Positions: prompt keys start at `prompt_start`, own keys at `prompt_length`.
    """

    is_sliding = False
    is_croppable = False
    #: sliding-window attention: keys after (query position − window) only; None: every earlier key
    window: int | None = None
    #: chunked local attention: the attention chunk size (keys of the query's own chunk only); None: none
    chunk: int | None = None
    #: segmented replay (`longstraw.trajectory`): the trajectory's own K/V before this forward `[1, Hkv, C, D]`, read
    #: in place as a part of their own from position `carried_start` (`keys` then holds this forward's only); None:
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

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is None:
            keys, values = key_states, value_states
        else:
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = keys, values
        if self.row_pad is not None:
            assert self.row_offset is not None  # set together (`longstraw.ragged.stack_layers`)
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

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the branch rows `indices` (sequences still decoding); the shared prompt part is untouched. A ragged
        batch also drops the padding columns no remaining row needs."""
        if self.keys is not None:
            assert self.values is not None  # appended with the keys
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
