"""Attention and an SSM in one decoder layer (Falcon-H1's and Zamba2's `hybrid` layers): both states.

Falcon-H1 runs attention and a Mamba-2 mixer side by side on the same input; Zamba2 runs a shared
attention block before the layer's own Mamba-2 mixer. Both talk to the cache under the one layer
index (transformers 5.24: `cache.update` for K/V, `update_conv_state` / `update_recurrent_state` for
the SSM), so the branch layer is both kinds at once. Durable: the prompt K/V (2 · kv_heads · head_dim
per prompt token) plus the conv window and SSM state (O(1) in P).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..hf.cache import snapshot
from .base import LayerState, grown_bytes, register_layer_kind
from .full_attention import AttentionBranchLayer, KVState
from .linear_attention import RecurrentBranchLayer, RecurrentState, mamba2_bytes


# the bases' `lazy_initialization` signatures differ: this is the attention side's; the SSM side calls its own by name
class HybridBranchLayer(AttentionBranchLayer, RecurrentBranchLayer):  # type: ignore[misc]  # see the line above
    """An attention branch layer over the prompt K/V that also carries the SSM's conv and recurrent states."""

    def __init__(self, attention: AttentionBranchLayer, recurrent: RecurrentBranchLayer):
        vars(self).update(vars(recurrent))
        vars(self).update(vars(attention))

    # the SSM side's recurrent states at a segmented replay's boundaries (the attention side's own K/V grow)
    boundary_states = RecurrentBranchLayer.boundary_states
    load_boundary = RecurrentBranchLayer.load_boundary
    stacks_rows = True  # both sides stacked in a ragged batch

    def stack_rows(self, layers: list, rows: Sequence[int], room: int = 0) -> HybridBranchLayer:
        new = snapshot(self)
        self.stack_states(new, layers)
        self.stack_kv(new, layers, rows, room)
        return new

    def take_row(self, j: int, room: int | None = None) -> HybridBranchLayer:
        new = snapshot(self)
        self.take_states(new, j)
        self.take_kv(new, j, room)
        return new

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        AttentionBranchLayer.batch_select_indices(self, indices)
        RecurrentBranchLayer.batch_select_indices(self, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        AttentionBranchLayer.batch_repeat_interleave(self, repeats)
        RecurrentBranchLayer.batch_repeat_interleave(self, repeats)

    def crop(self, tokens_to_remove: int):
        RecurrentBranchLayer.crop(self, tokens_to_remove)


@register_layer_kind
class HybridState(LayerState):
    """Prompt K/V of the attention part and conv + SSM state of the Mamba part of one layer."""

    layer_types = ("hybrid",)

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """The attention part's keys and values (full precision) and the Mamba part's conv + SSM state."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        kv = 2 * grown_bytes(tokens, heads, config.head_dim, elem, None)
        return kv + (mamba2_bytes(config, elem) if tokens else 0)

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        self.kv = KVState(config, layer_idx, capacity)
        self.ssm = RecurrentState(config, layer_idx, capacity)

    def branch(self, batch: int = 1) -> HybridBranchLayer:
        return HybridBranchLayer(self.kv.branch(batch), self.ssm.branch(batch))

    def commit(self, branch_layer: HybridBranchLayer, n: int) -> None:
        self.kv.commit(branch_layer, n)
        self.ssm.commit(branch_layer, n)
        self.length += n

    def tensors(self) -> list[torch.Tensor]:
        return self.kv.tensors() + self.ssm.tensors()

    def release(self) -> None:
        self.kv.release()
        self.ssm.release()

    # ------------------------------------------------------------------ exact mode
    supports_exact = True

    def mark_boundary(self) -> None:
        self.kv.mark_boundary()
        self.ssm.mark_boundary()

    def require_grad(self) -> None:
        self.kv.require_grad()
        self.ssm.require_grad()

    def reverse_branch(self, chunk: int, start: int) -> HybridBranchLayer:
        return HybridBranchLayer(self.kv.reverse_branch(chunk, start), self.ssm.reverse_branch(chunk, start))

    def chunk_outputs(self, chunk, start, end, branch_layer):
        return self.kv.chunk_outputs(chunk, start, end, branch_layer) + self.ssm.chunk_outputs(
            chunk, start, end, branch_layer
        )
