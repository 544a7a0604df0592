"""The bridge to transformers: a cache of branch layers, the active-cache scope, and a registered attention.

transformers models talk to their cache through `cache.update(...)`, `update_conv_state`,
`update_recurrent_state`, and do their attention math through `ALL_ATTENTION_FUNCTIONS`. longstraw
runs the unmodified model code with a `BranchCache` (one branch layer per decoder layer, each reading
the durable prompt state) and the attention implementation "longstraw", registered through
`AttentionInterface.register` together with a mask function under the same name (transformers 5.24
needs both; without the mask function the attention would get `mask=None` from the sdpa path).

Which implementation a model's code sees is decided per forward by `running(cache)`, the scope in
which capture, replay and sampling run the decoder: inside it the configs of the model say
"longstraw" and the attention reads its prompt part from the branch layer of `module.layer_idx`;
outside it they say what they said before, so the model's own code paths (transformers 5.24 branches
on the implementation name, e.g. DeepSeek-V3.2 applies its top-k mask only for "eager"/"sdpa") and
generation, evaluation and saving behave as without longstraw. `longstraw.prepare` checks once that
transformers accepts the switch for the model. (The name lives on the shared config objects: another
thread running the same model outside longstraw during a longstraw forward would see it too.)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers import AttentionInterface, PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..ops.attention import DEFAULT_BLOCK


class Attends(Protocol):
    """A branch layer that attends its prompt part (`longstraw.kinds.full_attention.AttentionBranchLayer` locally;
    context parallel, the attention over the prompt's slices a collective, `longstraw.kinds.base.CollectiveAttention`).
    """

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
        """Attention of the queries `q` `[B, H, R, D]` (positions from `q_start`) over [the prompt's slices | the
        branch's own keys `k` `[B, Hkv, S, D]` and values `v` `[B, Hkv, S, Dv]` (positions from `own_start`)]: the
        output `[B, H, R, Dv]` in q's dtype. `module`: the attention module; `scale` (None: D^−0.5), `window`,
        `softcap`, `sinks` `[H]` and `block` (keys per tile) as `longstraw.ops.attention.split_attention` takes them."""


class AttendedLayer(Attends, Protocol):
    """What `longstraw_attention` reads of the branch layer of an attention layer (`longstraw.kinds` sits above this
    bridge, so its classes are described here, not imported: `AttentionBranchLayer`, which attends its local prompt
    K/V, and the context-parallel layers, which attend across the ranks)."""

    prompt_length: int
    window: int | None

    @property
    def own_length(self) -> int: ...


class _RowSelecting(Protocol):
    def batch_select_indices(self, indices: torch.Tensor) -> None: ...


ATTN_IMPLEMENTATION = "longstraw"


class UpdateDone(Exception):
    """Raised by `BranchCache.update` with `stop_after_update` set: the layer's keys and values are appended, the
    rest of the forward is not wanted."""


@dataclass
class OneLayer:
    """What a decoder forward that runs one layer (`BranchCache.one_layer`) asks of its layers: decoder layer `index`
    runs, on `hidden` `[B, T, hidden]` instead of the input the decoder hands it (None: that input, the embeddings for
    layer 0), its output left in `output`; every other layer hands its input on unchanged
    (`longstraw.model.prepare.CheckpointedLayer`)."""

    index: int
    hidden: torch.Tensor | None = None
    output: torch.Tensor | None = None


class BranchCache(Cache):
    """transformers `Cache` over one branch's layers (`LayerState.branch()` of every decoder layer, each a
    `longstraw.kinds.base.BranchLayer`).

    `block`: key block size of the split attention (memory O(heads · R · block) per block).
    `checkpoint_layers`: run each decoder layer under activation checkpointing (`longstraw.prepare`).
    """

    def __init__(self, layers: list, block: int = DEFAULT_BLOCK, checkpoint_layers: bool = False):
        super().__init__(layers=layers)
        self.block = block
        self.checkpoint_layers = checkpoint_layers
        #: the model's configs (`ModelParts.configs`), for the recomputation of checkpointed layers in backward
        self.configs: Sequence[PreTrainedConfig] = ()
        #: the layer of the latest `update` (the attention that follows reads it)
        self.last_updated = -1
        #: tokens before the current forward (set by `run_decoder`)
        self.past_length = 0
        #: (size, decoder layer indices): those layers run `size` positions at a time (`longstraw.prepare`; the
        #: context-parallel capture sets it for its recurrent layers); None: every layer runs on the whole forward
        self.layer_chunks = None
        #: positions per call of the decoder layers' feed-forward modules
        #: (`longstraw.model.prepare.ChunkedFeedForward`); None: the whole forward at once
        self.ffn_chunk = None
        #: with `ffn_chunk`: how many calls each feed-forward module makes whatever its input's length (the last
        #: ones empty): the context-parallel capture's ranks agree on it when an MoE call is a collective; None: as
        #: many as the input needs
        self.ffn_calls = None
        #: a forward in which one decoder layer runs and the others pass their input on (`longstraw.hf.decoder.
        #: run_layer`, layer-major replay); None: every layer runs
        self.one_layer: OneLayer | None = None
        #: raise `UpdateDone` once `update` has appended a layer's keys and values (`longstraw.hf.decoder.
        #: run_until_update`)
        self.stop_after_update = False
        #: ids of recurrent-state copies handed to the model (and the copies, so the ids stay theirs)
        self._written: set[int] = set()
        self._keep: list = []

    def reserve(self, tokens: int) -> None:
        """Tell the attention layers how many tokens are still to come in this decode or extension (0: none), so that
        their own K/V grow in place instead of by a copy per token (`longstraw.kinds.full_attention.Room`)."""
        for layer in self.layers:
            if hasattr(layer, "reserve"):
                layer.reserve = max(0, int(tokens))

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        """Always None, so that linear-attention layers take their functional conv path
        (`update_conv_state` returns [previous window | new inputs]; the branch layer keeps its window).
        Given a conv state, single-token steps update it in place (Kimi's KDA does regardless of
        `is_recording_past`, transformers 5.24), which would write the shared captured state."""
        return None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """`Cache.update`, remembering the layer: Zamba2's shared attention module is built with `layer_idx=-1`
        and passes the index of the decoder layer it runs in to the cache only (transformers 5.24)."""
        self.last_updated = layer_idx
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.stop_after_update:
            raise UpdateDone(layer_idx)
        return out

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        """A copy of the branch's recurrent state, which becomes the branch's own state.

        Mamba-2 / Mamba layers take a single-token step by updating the state they were given in place
        (transformers 5.24: `mamba2_selective_state_update` / `selective_state_update` do `state.copy_`),
        then never call `update_recurrent_state`. Handing them a copy keeps the captured state (and
        its G-fold views in the sampler) untouched; the copy, updated or not, is what the branch
        continues from. The copy is O(1) in P (one recurrent state). Autograd: the copy is saved for
        backward before it is written; `run_decoder` saves such copies by value (`inplace_safe`).
        """
        # only linear-attention / SSM layers ask: theirs is a `RecurrentBranchLayer`
        layer = cast(LinearAttentionCacheLayerMixin, self.layers[layer_idx])
        if not layer.has_previous_state[state_idx] or (state := layer.recurrent_states[state_idx]) is None:
            return None
        own = state.clone()
        layer.recurrent_states[state_idx] = own
        self._written.add(id(own))
        self._keep.append(own)
        return own

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens before this forward. transformers 5.24 answers it from an attention layer and fails on a layer
        that has none (Nemotron-H's MoE / MLP layers, an all-SSM stack): the positions of the forward say it."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], CacheLayerMixin):
            return super().get_seq_length(layer_idx)
        return self.past_length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """As `get_seq_length`: a layer without attention has seen `past_length` tokens (longstraw attention builds
        its own masks; transformers only asks to build one it then drops)."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], CacheLayerMixin):
            return super().get_mask_sizes(query_length, layer_idx)
        return self.past_length + query_length, 0

    @contextmanager
    def inplace_safe(self):
        """Scope of a forward with autograd: a recurrent-state copy (`get_recurrent_state`) that autograd saves
        is saved as a further copy, so the model's in-place update of it leaves the saved value intact. Without
        autograd, or without a layer that has recurrent states, there is nothing to protect and no hook is set."""
        written = self._written
        recurrent = any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.layers)
        if not torch.is_grad_enabled() or not recurrent:
            try:
                yield
            finally:
                written.clear()
                self._keep.clear()
            return

        def pack(t):
            # Never the tensor itself: a saved output that carries its own grad_fn would make a reference cycle in
            # autograd's C++ graph, which is never freed (every replay's and reverse chunk's graph stayed alive,
            # ~4.5 KB and ~13.5 KB per prompt token on the hybrid benchmark model). A detached alias shares the
            # storage and the version counter, so autograd's in-place checks still apply.
            return t.detach().clone() if id(t) in written else t.detach()

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            written.clear()
            self._keep.clear()

    def batch_select_indices(self, indices) -> None:
        """Keep the branch rows `indices` in every layer (finished sequences leave the batch)."""
        for layer in self.layers:
            cast(_RowSelecting, layer).batch_select_indices(indices)


_ACTIVE: ContextVar[BranchCache | None] = ContextVar("longstraw_active_cache", default=None)


def active_cache() -> BranchCache | None:
    """The branch cache of the longstraw forward running now, or None outside one."""
    return _ACTIVE.get()


@contextmanager
def running(cache: BranchCache, configs=()):
    """Scope of a longstraw forward over `cache`: the model's `configs` (`ModelParts.configs`) name the longstraw
    attention implementation and its attention reads `cache`; both are put back on exit."""
    token = _ACTIVE.set(cache)
    before = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = ATTN_IMPLEMENTATION
    try:
        yield
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation_internal = name
        _ACTIVE.reset(token)


# ----------------------------------------------------------------------------------------- the attention

#: keyword arguments transformers 5.24 models pass to the attention function that longstraw either
#: implements (scaling, sliding_window, softcap, s_aux) or that do not change the math
_PASSIVE = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_attentions",
        "use_cache",
        "is_causal",
        "cache",
        "past_key_values",
        "position_embeddings",
        "layer_idx",
        "attention_mask",
        "head_mask",
        "query_length",
        "target_dtype",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "use_top_left_mask",
        "return_dict",
        "output_hidden_states",
    }
)


class UnsupportedAttentionError(NotImplementedError):
    """An attention argument that changes the math and that longstraw's split attention does not implement."""


def longstraw_attention(
    module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs
) -> tuple[torch.Tensor, None]:
    """Attention of a branch's queries `[B, H, R, D]` over [prompt K/V | its own K/V]: `[B, R, H, Dv]`.

    Reads `scaling`, `dropout`, `sliding_window`, `softcap` and `s_aux` (`[H]` attention sinks of gpt-oss
    and MiMo, merged as a third part by `split_attention`); refuses any other argument that is set and
    not known to leave the math unchanged."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError(
            "the 'longstraw' attention implementation only runs inside longstraw.capture / "
            "PromptState.replay / PromptState.sample"
        )
    scaling, dropout = kwargs.pop("scaling", None), kwargs.pop("dropout", 0.0)
    sliding_window, softcap, sinks = (
        kwargs.pop("sliding_window", None),
        kwargs.pop("softcap", None),
        kwargs.pop("s_aux", None),
    )
    unknown = sorted(k for k, v in kwargs.items() if k not in _PASSIVE and v is not None)
    if unknown:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} passes attention arguments longstraw does not implement: {unknown}"
        )
    if dropout:
        raise NotImplementedError("attention dropout is not supported by longstraw replay; set attention_dropout=0")
    layer_idx = module.layer_idx if module.layer_idx >= 0 else cache.last_updated  # Zamba2: see BranchCache.update
    # a module that dispatches through the attention interface runs in an attention layer
    # (`LayerState.uses_attention_interface`): its branch layer is an `AttentionBranchLayer`
    layer = cast(AttendedLayer, cache.layers[layer_idx])
    if sliding_window is not None and layer.window != sliding_window:
        raise RuntimeError(
            f"layer {module.layer_idx}: the model uses a sliding window of {sliding_window} but the captured state "
            f"was built for {layer.window}; check config.layer_types"
        )
    # `key` is what the branch layer's update returned: the last key.shape[-2] of its own keys so far
    own_start = layer.prompt_length + layer.own_length - key.shape[-2]
    q_start = own_start + key.shape[-2] - query.shape[-2]
    out = layer.attend(
        module, query, key, value, q_start=q_start, own_start=own_start, scale=scaling, window=layer.window,
        softcap=softcap, sinks=sinks, block=cache.block,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs):
    """longstraw attention builds its masks from positions, blockwise; transformers need not build one."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, longstraw_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)


def snapshot(layer):
    """A copy of a branch layer that later appends do not change (branch layers rebind their tensors as they grow and
    write in place only into room after them that the copy does not read and may not write,
    `longstraw.kinds.full_attention.Room`: copying the attribute dicts is enough)."""
    new = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, dict):
            setattr(new, name, dict(value))
    return new
