"""What every layer kind provides: a durable state and a branch view of it.

A `LayerState` holds what later tokens of one decoder layer can still read after the prompt
(the table in docs/design.md). `branch()` returns a transformers cache layer that a replayed branch runs
against: it reads the durable state and keeps everything the branch adds to itself, so the durable
state is never written by a replay. During capture, `commit(branch_layer, n)` folds one prompt chunk's
branch into the durable state.

Adding a layer kind (MLA, DSA, ...) means one new module with a `LayerState` subclass registered
under the transformers `layer_types` name it serves (`register_layer_kind`).

What a branch layer offers is written down as protocols, so that readers call members instead of probing for them:
`BranchLayer` (every branch layer), `LatentBranch` (what latent attention reads and appends), and the context-parallel
capabilities `CollectiveAttention` / `CollectiveSparseAttention`. A K/V attention layer's branch layer attends its
prompt part itself (`attend`), a latent one selects and attends its own (`select_keys`, `attend_latent`): locally, or
across the ranks in the context-parallel layers, which override them (no flags, no `isinstance` on the hot path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol, cast, runtime_checkable

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin

from ..hf.cache import Attends
from ..ops.latent_attention import Selection
from ..ops.quant import QUANT_BLOCK, QuantizedTokens


def repeat_rows(t: torch.Tensor | None, repeats: int) -> torch.Tensor | None:
    """`t` `[B, ...]` → `[B · repeats, ...]`, each row `repeats` times in a row (a view of `t` when B = 1: branch layers
    never change what they hold, they rebind their tensors as they grow and write in place only into room after them,
    `longstraw.kinds.full_attention.Room`); None stays None."""
    if t is None:
        return None
    return t.expand(repeats, *t.shape[1:]) if t.shape[0] == 1 else t.repeat_interleave(repeats, dim=0)


def empty_state(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised durable-state buffer of `shape` with `like`'s dtype and device (filled chunk by chunk
    during capture). Tests replace this function with one that fills the buffer with NaN, so that a slot
    capture never writes cannot go unnoticed."""
    return like.new_empty(shape)


@runtime_checkable
class BranchLayer(Protocol):
    """What every branch layer is: one decoder layer's entry in a branch's `longstraw.hf.cache.BranchCache`, made by
    `LayerState.branch()` (or `reverse_branch()` in exact mode). It reads the durable state and never writes it; what
    the branch adds (its own K/V, latents, newer recurrent states) it keeps itself, with batch B (the branch's rows)
    where the prompt part has batch 1 (shared by the rows).

    These members are what `BranchCache` and transformers' `Cache` ask of every layer. Beyond them a branch layer
    answers the cache calls of the modules its decoder layer runs: `update` (K/V attention: `PromptBranchLayer`, a
    transformers `CacheLayerMixin`) or `update_conv_state` / `update_recurrent_state` (linear attention, SSM, short
    convolutions: `RecurrentBranchLayer`, a transformers `LinearAttentionCacheLayerMixin`), or none
    (`MixerlessBranchLayer`). Implementations: `AttentionBranchLayer` (full, sliding, chunked attention) and its
    subclasses `CompressedBranchLayer` and `HybridBranchLayer` (attention + SSM), `LatentBranchLayer` (MLA, DSA),
    `RecurrentBranchLayer`, `MixerlessBranchLayer`, and the context-parallel layers of
    `longstraw.distributed.context_parallel`.
    """

    #: transformers' `Cache.is_sliding`: whether the layer keeps a sliding window of keys (longstraw attention builds
    #: its masks from positions; this only describes the layer)
    is_sliding: bool

    @property
    def carries_segments(self) -> bool:
        """Whether a segmented replay (`longstraw.replay.segments`) carries this layer from one segment to the next:
        through its `grown_tensors`, its `boundary_states` and `enter_segment`; False: a trajectory through it is
        replayed whole."""

    @property
    def grown_tensors(self) -> tuple[tuple[str, int], ...]:
        """The branch's own tensors that grow along a trajectory, (attribute, token dimension): what a segmented
        replay carries from segment to segment in one buffer each (`PromptBranchLayer.enter_segment` sets them); ()
        for a layer whose own state does not grow."""

    def boundary_states(self) -> dict[tuple[str, int], torch.Tensor] | None:
        """The layer's recurrent states now, by ("conv" | "recurrent", state index) (a segmented replay keeps them at
        each segment boundary); None: a layer without recurrent states."""

    def load_boundary(self, states: dict[tuple[str, int], torch.Tensor], *, reset: bool = False) -> None:
        """Continue from recurrent `states` (as `boundary_states` gave them): the start of a later segment; `reset`:
        the states not in `states` unset (the start of the trajectory)."""

    def start_decoding(self) -> None:
        """Decoding (sampling) from here on: a sliding-window layer keeps only the own K/V later tokens can read."""

    def stackable(self) -> bool:
        """Whether a ragged decode batch (`longstraw.ragged`) can stack this layer with the same layer of other
        branches (`stack_rows`); False: those branches decode one after another."""

    def stack_rows(self, layers: list, rows: Sequence[int], room: int = 0) -> BranchLayer:
        """One branch layer over the rows of `layers` (this one first: the same decoder layer of several branch
        caches, `rows[i]` rows each), with `room` more columns where it grows (a ragged decode batch)."""

    def take_row(self, j: int, room: int | None = None) -> BranchLayer:
        """Row `j` of a stacked layer as a branch layer of its own (batch 1): the inverse of `stack_rows`; `room`:
        columns to grow into in place (None: views of the batch's tensors)."""

    def split_rows(self, rows: Sequence[int]) -> list:
        """Rows `rows` of a stacked layer as branch layers of their own, each growing on in its row of the batch's
        buffers where the layer has any (`take_row` otherwise)."""

    @property
    def is_compileable(self) -> bool:
        """transformers' `Cache.is_compileable`: False for a branch layer (its tensors are rebound as it grows)."""

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the branch rows `indices` `[B']` (of the B rows so far) of the branch's own tensors, e.g. own keys
        `[B, Hkv, T, D]` → `[B', Hkv, T, D]`: finished sequences leave the batch. What the rows share (the prompt part,
        batch 1 or expanded views of it) stays as it is."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        """transformers' `Cache.batch_repeat_interleave`: each branch row's own tensors `repeats` times in a row, e.g.
        own keys `[1, Hkv, T, D]` → `[repeats, Hkv, T, D]` (`repeat_rows`): one trajectory grown by `Branch.extend` (a
        row's question after a shared document) becomes the start of G sampled sequences. The prompt part stays."""

    def get_max_length(self) -> int:
        """-1: no maximum length (transformers' `CacheLayerMixin.get_max_length`)."""


def branch_layers(cache) -> list[BranchLayer]:
    """The layers of a `longstraw.hf.cache.BranchCache`, as what they are: `BranchLayer`s (`LayerState.branch()`;
    transformers types them as its own cache layers)."""
    return cast(list[BranchLayer], cache.layers)


@runtime_checkable
class LatentBranch(BranchLayer, Protocol):
    """What `longstraw.kinds.latent_attention.LatentAttention` (MLA, DSA) reads and appends of its branch layer:
    `LatentBranchLayer`, and the context-parallel latent layers (which read the prompt through
    `CollectiveAttention` / `CollectiveSparseAttention` and have no local prompt part). r: `kv_lora_rank`, dr:
    `qk_rope_head_dim`, Di: `index_head_dim`; P prompt tokens, T own tokens so far, S tokens of the forward."""

    #: prompt tokens before the branch's own: the absolute position of its first own latent
    prompt_length: int
    #: prompt latents `[1, 1, P, r + dr]` (`[c | k_rot]`), 8-bit `QuantizedTokens`, or None (no prompt here)
    prompt: torch.Tensor | QuantizedTokens | None
    #: DSA indexer keys of the prompt `[1, P, Di]`, or None (MLA, "shared" DSA layers, context parallel)
    prompt_index: torch.Tensor | None
    #: (W_k, W_v): the absorbed up-projections, read once per branch when running without grad; None until then
    absorbed: tuple[torch.Tensor, torch.Tensor] | None

    def append(self, latent: torch.Tensor) -> torch.Tensor:
        """Append the forward's latents `[B, 1, S, r + dr]` to the branch's own; return all own latents
        `[B, 1, T, r + dr]`."""

    def append_index(self, keys: torch.Tensor) -> torch.Tensor:
        """Append the forward's DSA indexer keys `[B, S, Di]` to the branch's own; return all of them `[B, T, Di]`."""

    def select_keys(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        scale: float,
        own_keys: torch.Tensor,
        topk: int,
        *,
        q_start: int,
        own_start: int,
        block: int,
    ) -> Selection:
        """DSA's selection: each query's `topk` keys over [the prompt | the own indexer keys `own_keys` `[B, T, Di]`],
        from the indexer queries `q` `[B, S, Hi, Di]` and head weights `weights` `[B, S, Hi]`."""

    def attend_latent(
        self,
        module,
        query: torch.Tensor,
        own: torch.Tensor,
        selection: Selection | None,
        rank: int,
        *,
        q_start: int,
        own_start: int,
        scale: float,
        block: int,
    ) -> torch.Tensor:
        """Latent attention `[B, H, S, r]` (r = `rank`) of the absorbed queries `query` `[B, H, S, r + dr]` over [the
        prompt | the own latents `own` `[B, 1, T, r + dr]`]: dense (`selection` None) or over DSA's `selection`."""


@runtime_checkable
class CollectiveAttention(BranchLayer, Attends, Protocol):
    """A branch layer that attends its prompt part itself: context parallel (`longstraw.distributed.context_parallel`),
    where each rank holds a slice of the prompt's K/V or latents and the attention over them is a collective. The
    longstraw attention (`longstraw.hf.cache.longstraw_attention`, K/V) calls
    its `attend` as it calls every attention branch layer's; a context-parallel latent layer's `attend_latent` calls it
    with the latents as the one key head and as the values."""


@runtime_checkable
class CollectiveSparseAttention(CollectiveAttention, Protocol):
    """A `CollectiveAttention` of a DSA layer: the indexer's top-k selection and the sparse attention over the selected
    latents run across the ranks too (`longstraw.distributed.context_parallel.sparse_attention`): its `select_keys`
    selects over the prompt's slices, its `attend_latent` calls `attend_sparse`. Shapes as `LatentBranch`'s; Hi:
    indexer heads, H: attention heads, K: top-k."""

    def attend_sparse(
        self,
        query: torch.Tensor,
        own: torch.Tensor,
        selection: Selection,
        *,
        q_start: int,
        own_start: int,
        scale: float,
        block: int,
    ) -> torch.Tensor:
        """Latent attention of the absorbed queries `query` `[B, H, S, r + dr]` over the keys `selection` chose, in
        the prompt's slices and the own latents `own` `[B, 1, T, r + dr]`: `[B, H, S, r + dr]` in query's dtype (the
        caller keeps the first r)."""


class PromptBranchLayer(CacheLayerMixin):
    """What every attention-like branch layer reports to transformers: `prompt_length` prompt tokens read from
    the durable state, then `own_length` tokens of the branch's own (longstraw attention builds its masks from
    positions; these sizes only describe the layout). A `BranchLayer`; the defaults below are what a layer without
    the capability declares."""

    prompt_length: int = 0
    is_sliding: bool = False
    #: whether `values` names the own keys too (one tensor read as keys and as values: context-parallel latents)
    values_alias: bool = False
    #: `BranchLayer.carries_segments`, `grown_tensors`: what a segmented replay carries (`longstraw.replay.segments`)
    carries_segments: bool = False
    grown_tensors: tuple[tuple[str, int], ...] = ()
    #: whether a segmented replay's earlier own tensors are read in place as a part before the own
    #: (`AttentionBranchLayer.carried_k`) rather than set as the own tensors
    reads_carried_in_place: bool = False
    #: whether the cache `update` call appends every grown tensor, before the layer reads anything: a layer-major
    #: replay then collects them by running the layer up to that call (`longstraw.hf.decoder.run_until_update`)
    own_from_update: bool = False

    def boundary_states(self) -> dict[tuple[str, int], torch.Tensor] | None:
        return None

    def load_boundary(self, states: dict[tuple[str, int], torch.Tensor], *, reset: bool = False) -> None:
        pass

    def start_decoding(self) -> None:
        pass

    def stackable(self) -> bool:
        return False

    def stack_rows(self, layers: list, rows: Sequence[int], room: int = 0) -> BranchLayer:
        raise NotImplementedError(f"{type(self).__name__} is not stacked in a ragged batch")

    def take_row(self, j: int, room: int | None = None) -> BranchLayer:
        raise NotImplementedError(f"{type(self).__name__} is not stacked in a ragged batch")

    def split_rows(self, rows: Sequence[int]) -> list:
        return [self.take_row(j) for j in rows]

    def segment_offset(self) -> int:
        """Own positions before the first of the own tensors a segmented replay carries (trimmed ones), when it
        starts carrying them."""
        return 0

    def enter_segment(self, before: dict[str, torch.Tensor | None], offset: int) -> None:
        """Set the layer up to run a segment of a trajectory whose earlier own tensors are `before` (each of
        `grown_tensors` → the carried positions so far, None: none), `offset` (`segment_offset`) own positions before
        them."""
        for name, t in before.items():
            setattr(self, name, t)
        if self.values_alias:
            self.values = self.keys

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

    # ------------------------------------------------------------------ memory terms
    # what `longstraw.model.chunking` (the capture's automatic chunk) and `longstraw.tools.planner` read of a kind
    #: whether the durable state grows with P: split over the context-parallel ranks, 8-bit when the planner is given
    #: a `state_dtype`, and no exact-mode boundary state kept per chunk
    grows_with_prompt: bool = False
    #: whether the layer's branch appends its own K/V (or latents) per token: what a capture chunk or a branch adds
    appends_own_kv: bool = False
    #: whether the layer's attention runs the blockwise kernel (windows, DSA scoring), which holds a few score tiles
    reads_with_blockwise_kernel: bool = False

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """Bytes one decoder layer `layer_idx` of this kind keeps after `tokens` captured prompt tokens, from the config
        alone (what `longstraw.tools.planner` predicts and the tests hold equal to a captured `PromptState.nbytes`);
        `elem`: bytes per value of the model's dtype; `state_dtype`: an 8-bit dtype for the kinds that grow with P
        (`longstraw.ops.quant`: 1 byte per value + a float32 scale per 64 tokens × head, the unfinished last block in
        the model's dtype)."""
        raise NotImplementedError(f"no durable-state formula for layer kind {cls.__name__}")

    @classmethod
    def capture_activation_bytes(cls, config, elem: int) -> int:
        """Bytes per prompt token this kind's layer adds to one layer's live activations in a capture chunk (no
        autograd), beyond the residual, normed input, q / k / v and the MLP's gate / up every layer has; `elem`: bytes
        per value of the model's dtype. A model mixing kinds counts the largest."""
        return 0

    @classmethod
    def recurrence_bytes(cls, config) -> int:
        """Bytes per prompt token of the chunked recurrence's intermediates a capture chunk holds in this kind's
        layer (one layer at a time; a model mixing kinds counts the largest)."""
        return 0

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
    def branch(self, batch: int = 1) -> BranchLayer:
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

    def prefix_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of the prompt's positions [0, n) in full precision, `[1, Hkv, n, D]` each, where this layer
        keeps every position that way; None otherwise (windows, recurrent or latent states, 8-bit storage). Read by
        `longstraw.train.staleness`'s drift probe."""
        return None

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

    def reverse_branch(self, chunk: int, start: int) -> BranchLayer:
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


def layer_config(config, layer_idx: int):
    """The config that sizes decoder layer `layer_idx` (Gemma 4: per-layer head sizes)."""
    per_layer = getattr(config, "per_layer_config", None)
    return per_layer[layer_idx] if per_layer is not None else config


def head_dim(config) -> int:
    """A (layer's) config's attention head width: `head_dim`, or `hidden_size / num_attention_heads` where the config
    sets none, as transformers' attention modules read it (transformers 5.24's `Qwen2Config` has no `head_dim`: a
    Qwen2 / Qwen2.5 checkpoint's config.json names none)."""
    d = getattr(config, "head_dim", None)
    return int(d) if d else config.hidden_size // config.num_attention_heads


def grown_bytes(tokens: int, heads: int, width: int, elem: int, state_dtype) -> int:
    """Bytes of `tokens` × `heads` rows of `width` values, full precision or 8-bit with block scales."""
    if state_dtype is None:
        return tokens * heads * width * elem
    full = tokens - tokens % QUANT_BLOCK
    return heads * (full * width + full // QUANT_BLOCK * 4 + (tokens - full) * width * elem)


def state_bytes(layer_type: str, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
    """Durable-state bytes of decoder layer `layer_idx` of `layer_type` after `tokens` prompt tokens
    (`LayerState.durable_bytes` of the kind serving it); a layer type no kind serves raises `KeyError` naming it (the
    planner then says it cannot predict that model)."""
    if layer_type not in _KINDS:
        raise KeyError(f"no durable-state formula for layer kind {layer_type!r}")
    return int(_KINDS[layer_type].durable_bytes(config, layer_idx, tokens, elem, state_dtype))


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
