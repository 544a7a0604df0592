"""Sliding-window attention: the durable state is the K/V of the last W − 1 prompt tokens.

Exact mode also keeps the window each captured chunk read (O(P / chunk · W)).

A query at position p sees keys at positions > p − W (W keys with its own, as transformers counts),
so no later token reads further back than the last W − 1 prompt tokens. Durable bytes do not grow
with P beyond W: 2 · kv_heads · head_dim · dtype size · min(P − 1, W − 1).
"""

from __future__ import annotations

import torch

from .base import head_dim, layer_config, register_layer_kind
from .full_attention import AttentionBranchLayer, KVState


@register_layer_kind
class SlidingKVState(KVState):
    """Last `window − 1` prompt K/V of a sliding-window layer, with their absolute start position."""

    layer_types: tuple[str, ...] = ("sliding_attention",)
    supports_compression = False  # at most W − 1 tokens: nothing to gain
    supports_offload = False  # likewise
    grows_with_prompt = False  # at most W − 1 tokens
    reads_with_blockwise_kernel = True
    # plain tensors only (no compression)
    keys: torch.Tensor | None
    values: torch.Tensor | None

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """The last W − 1 prompt tokens' keys and values (full precision)."""
        c = layer_config(config, layer_idx)
        return 2 * min(tokens, int(config.sliding_window) - 1) * c.num_key_value_heads * head_dim(c) * elem

    def prefix_kv(self, n: int) -> None:
        """Only the prompt's last window is kept."""
        return None

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        self.window = int(config.sliding_window)
        if self.window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.window}")
        #: exact mode: (keys, values, start) of the window each captured chunk read, O(P / chunk · W)
        self.boundaries: list[tuple[torch.Tensor | None, torch.Tensor | None, int]] = []

    @property
    def start(self) -> int:
        return self.length - (0 if self.keys is None else self.keys.shape[-2])

    def stored(self):
        return self.keys, self.values

    def _keep(self) -> int:
        """How many of the last committed K/V later tokens can read."""
        assert self.window is not None  # set in __init__ (`ChunkedKVState` keeps by chunk instead)
        return self.window - 1

    def commit(self, branch_layer: AttentionBranchLayer, n: int) -> None:
        k, v = branch_layer.keys, branch_layer.values
        assert k is not None and v is not None  # the branch ran the chunk
        if self.keys is not None:
            assert self.values is not None  # committed with the keys
            k = torch.cat([self.keys, k], dim=-2)
            v = torch.cat([self.values, v], dim=-2)
        self.length += n
        keep = self._keep()
        # clone: a slice would keep the whole concatenation alive
        self.keys = k[:, :, k.shape[-2] - min(keep, k.shape[-2]) :].clone()
        self.values = v[:, :, v.shape[-2] - min(keep, v.shape[-2]) :].clone()

    def release(self) -> None:
        super().release()
        self.boundaries = []

    # ------------------------------------------------------------------ exact mode
    # The positions a window drops are gone from the durable state, so the reverse pass of chunk c
    # reads the window kept at its boundary; the gradient of a chunk's own K/V is the sum, over every
    # later window holding those positions (and the final one the replays read), of that window's
    # gradient there.
    supports_exact = True

    def mark_boundary(self) -> None:
        self.boundaries.append((self.keys, self.values, self.start))

    def require_grad(self) -> None:
        def leaf(t):
            return None if t is None else t.detach().requires_grad_(True)

        self.boundaries = [(leaf(k), leaf(v), start) for k, v, start in self.boundaries]
        self.keys, self.values = leaf(self.keys), leaf(self.values)

    def reverse_branch(self, chunk: int, start: int) -> AttentionBranchLayer:
        k, v, k_start = self.boundaries[chunk]
        return AttentionBranchLayer(k, v, start, k_start, self.window, self.chunk)

    def chunk_outputs(self, chunk, start, end, branch_layer):
        later = [*self.boundaries[chunk + 1 :], (self.keys, self.values, self.start)]
        out = []
        for which, own in ((0, branch_layer.keys), (1, branch_layer.values)):
            grad = None
            for window in later:
                leaf, w_start = window[which], window[2]
                if leaf is None or leaf.grad is None:
                    continue
                lo, hi = max(start, w_start), min(end, w_start + leaf.shape[-2])
                if lo >= hi:
                    continue
                if grad is None:
                    grad = torch.zeros_like(own, dtype=leaf.grad.dtype)
                grad[:, :, lo - start : hi - start] += leaf.grad[:, :, lo - w_start : hi - w_start]
            if grad is not None:
                out.append((own, grad))
        return out


@register_layer_kind
class ChunkedKVState(SlidingKVState):
    """K/V of the prompt's last, unfinished attention chunk (chunked local attention, Llama 4).

    A query at position p reads only keys at positions ≥ (p // C) · C (C = `attention_chunk_size`), so
    after the prompt the durable state is the keys from the start of the chunk holding the next position:
    (P − 1) mod C of them, fewer than C, whatever P. Exact mode keeps each captured chunk's window as
    sliding layers do.
    """

    layer_types = ("chunked_attention",)
    window = None
    chunk: int  # set in __init__

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """Keys and values of the unfinished chunk: tokens mod C of them."""
        c = layer_config(config, layer_idx)
        return 2 * (tokens % int(config.attention_chunk_size)) * c.num_key_value_heads * head_dim(c) * elem

    def __init__(self, config, layer_idx: int, capacity: int):
        KVState.__init__(self, config, layer_idx, capacity)
        self.chunk = int(config.attention_chunk_size)
        if self.chunk < 1:
            raise ValueError(f"attention_chunk_size must be >= 1, got {self.chunk}")
        self.boundaries = []

    def _keep(self) -> int:
        return self.length % self.chunk
