"""Layers without a token mixer (Nemotron-H's `moe` and `mlp` layers): nothing is durable.

Such a layer maps each position on its own, so a later token reads nothing of the prompt through it:
no durable state, 0 bytes per prompt token. Its branch layer only answers the cache's bookkeeping calls.
"""

from __future__ import annotations

import torch

from .base import LayerState, register_layer_kind


class MixerlessBranchLayer:
    """Branch layer of a layer that never touches the cache (neither attention nor linear attention)."""

    is_compileable = False
    is_sliding = False
    carries_segments = True  # nothing to carry
    grown_tensors = ()

    def boundary_states(self) -> None:
        return None

    def load_boundary(self, states, *, reset: bool = False) -> None:
        pass

    def start_decoding(self) -> None:
        pass

    def stackable(self) -> bool:
        return True

    def stack_rows(self, layers: list, rows, room: int = 0) -> MixerlessBranchLayer:
        return self  # nothing per row

    def take_row(self, j: int, room: int | None = None) -> MixerlessBranchLayer:
        return self

    def split_rows(self, rows) -> list:
        return [self for _ in rows]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("longstraw branch layers are not croppable; start a new branch instead")


@register_layer_kind
class MixerlessState(LayerState):
    """No durable state."""

    layer_types = ("moe", "mlp")

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        return 0

    def branch(self, batch: int = 1) -> MixerlessBranchLayer:
        return MixerlessBranchLayer()

    def commit(self, branch_layer, n: int) -> None:
        self.length += n

    def tensors(self) -> list[torch.Tensor]:
        return []

    def release(self) -> None:
        pass

    # ------------------------------------------------------------------ exact mode: nothing flows through it
    supports_exact = True

    def require_grad(self) -> None:
        pass

    def reverse_branch(self, chunk: int, start: int) -> MixerlessBranchLayer:
        return MixerlessBranchLayer()

    def chunk_outputs(self, chunk, start, end, branch_layer):
        return []
