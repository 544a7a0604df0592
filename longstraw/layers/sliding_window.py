"""Sliding-window attention: the durable state is the K/V of the last W − 1 prompt tokens.

A query at position p sees keys at positions > p − W (W keys with its own, as transformers counts),
so no later token reads further back than the last W − 1 prompt tokens. Durable bytes do not grow
with P beyond W: 2 · kv_heads · head_dim · dtype size · min(P − 1, W − 1).
"""

from __future__ import annotations

import torch

from .base import register_layer_kind
from .full_attention import AttentionBranchLayer, KVState


@register_layer_kind
class SlidingKVState(KVState):
    """Last `window − 1` prompt K/V of a sliding-window layer, with their absolute start position."""

    layer_types = ("sliding_attention",)
    # exact mode would also need the window before every chunk boundary (the earlier positions are
    # dropped here): not implemented yet
    supports_exact = False

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        self.window = int(config.sliding_window)
        if self.window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.window}")

    @property
    def start(self) -> int:
        return self.length - (0 if self.keys is None else self.keys.shape[-2])

    def stored(self):
        return self.keys, self.values

    def commit(self, branch_layer: AttentionBranchLayer, n: int) -> None:
        keep = self.window - 1
        k, v = branch_layer.keys, branch_layer.values
        if self.keys is not None:
            k = torch.cat([self.keys, k], dim=-2)
            v = torch.cat([self.values, v], dim=-2)
        self.length += n
        # clone: a slice would keep the whole concatenation alive
        self.keys = k[:, :, k.shape[-2] - min(keep, k.shape[-2]) :].clone()
        self.values = v[:, :, v.shape[-2] - min(keep, v.shape[-2]) :].clone()
