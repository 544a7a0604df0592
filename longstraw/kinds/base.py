"""What every layer kind provides: a durable state and a branch view of it.

A `LayerState` holds what later tokens of one decoder layer can still read after the prompt
(the table in docs/design.md). `branch()` returns a transformers cache layer that a replayed branch runs
against: it reads the durable state and keeps everything the branch adds to itself, so the durable
state is never written by a replay. During capture, `commit(branch_layer, n)` folds one prompt chunk's
branch into the durable state.

Adding a layer kind (MLA, DSA, ...) means one new module with a `LayerState` subclass registered
under the transformers `layer_types` name it serves (`register_layer_kind`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin


def empty_state(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised durable-state buffer of `shape` with `like`'s dtype and device (filled chunk by chunk
    during capture). Tests replace this function with one that fills the buffer with NaN, so that a slot
    capture never writes cannot go unnoticed."""
    return like.new_empty(shape)


class PromptBranchLayer(CacheLayerMixin):
    """What every attention-like branch layer reports to transformers: `prompt_length` prompt tokens read from
    the durable state, then `own_length` tokens of the branch's own (longstraw attention builds its masks from
    positions; these sizes only describe the layout)."""

    prompt_length: int = 0

    @property
    def own_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.prompt_length + self.own_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class LayerState(ABC):
    """Durable prompt state of one decoder layer."""

    #: transformers `config.layer_types` names this kind serves.
    layer_types: tuple[str, ...] = ()
    #: whether the layer's attention math goes through transformers' attention interface (`ALL_ATTENTION_FUNCTIONS`),
    #: where longstraw's attention takes its place; `longstraw.model.capability` refuses a module of such a layer that
    #: does not
    uses_attention_interface: bool = False

    @classmethod
    def check_layer(cls, config, index: int, block, family) -> str | None:
        """Why decoder layer `index` (`block`, of a model of `config` and `family`, a `longstraw.archs.Family` or
        None) cannot be served by this kind, or None: what the kind needs beyond its layer type."""
        return None

    @classmethod  # noqa: B027  (a no-op unless the kind has a stand-in)
    def install(cls, block, family) -> None:
        """Install what this kind needs in decoder layer `block` (stand-ins in front of its modules' classes,
        `longstraw.hf.stand_ins`), once, at `longstraw.prepare`; `family`: the model's `longstraw.archs.Family` or
        None."""

    def __init__(self, config: PreTrainedConfig, layer_idx: int, capacity: int):
        """`capacity`: the number of prompt tokens the capture will commit (P − 1)."""
        self.layer_idx = layer_idx
        self.capacity = capacity
        #: prompt tokens committed so far (absolute count, whatever the layer keeps of them).
        self.length = 0

    @abstractmethod
    def branch(self, batch: int = 1):
        """A fresh transformers cache layer reading this state, for `batch` sequences that share it;
        the state itself is never written."""

    @abstractmethod
    def commit(self, branch_layer, n: int) -> None:
        """Fold the branch layer of a captured chunk of `n` prompt tokens into the durable state."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The durable tensors (for `.nbytes`, moving and release)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @abstractmethod
    def release(self) -> None:
        """Drop the durable tensors."""

    #: 8-bit storage of the state (`longstraw.ops.quant`) when set by `capture(state_dtype=...)`; kinds whose state
    #: grows with P support it (`supports_compression`), the O(1) states stay in the model's dtype
    state_dtype: torch.dtype | None = None
    supports_compression: bool = False
    #: where the state lives when set by `capture(state_device="cpu")` for a model on a GPU (pinned host
    #: memory, streamed to the GPU tile by tile by the attention kernels); kinds that support it say so
    state_device: torch.device | None = None
    supports_offload: bool = False

    # ------------------------------------------------------------------ exact mode
    #: whether this kind supports `prompt_grad="exact"`
    supports_exact: bool = False

    def mark_boundary(self) -> None:  # noqa: B027  (a no-op unless the kind keeps boundary states)
        """Exact mode, during capture, before each chunk: keep what the reverse pass of that chunk
        will start from beyond the durable state itself (e.g. the recurrent state at the boundary)."""

    def require_grad(self) -> None:
        """Exact mode, after capture: make the durable tensors leaves that accumulate the gradient
        of every replay (one buffer the size of the state)."""
        raise NotImplementedError(f"{type(self).__name__} does not support prompt_grad='exact'")

    def reverse_branch(self, chunk: int, start: int):
        """Exact mode: a branch layer that recomputes chunk `chunk` (first token at `start`) with grad,
        reading everything before `start` from leaves that collect the gradients flowing there."""
        raise NotImplementedError

    def chunk_outputs(self, chunk: int, start: int, end: int, branch_layer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Exact mode: (tensor the recomputed chunk produced, accumulated gradient of it) pairs."""
        raise NotImplementedError


_KINDS: dict[str, type[LayerState]] = {}


def register_layer_kind(cls: type[LayerState]) -> type[LayerState]:
    """Class decorator: serve `cls.layer_types` with `cls`."""
    for name in cls.layer_types:
        _KINDS[name] = cls
    return cls


def registered_layer_types() -> frozenset[str]:
    """The layer types some layer kind serves."""
    return frozenset(_KINDS)


def layer_kind(layer_type: str) -> type[LayerState]:
    """The `LayerState` class for a transformers layer type, with a clear error if none serves it."""
    try:
        return _KINDS[layer_type]
    except KeyError:
        raise NotImplementedError(
            f"longstraw has no durable state for layer type {layer_type!r}; supported layer types: {sorted(_KINDS)}"
        ) from None
