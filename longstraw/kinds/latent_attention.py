"""Multi-head latent attention (MLA) and DeepSeek sparse attention (DSA): the durable state is the latent.

Per prompt token an MLA layer keeps what transformers itself caches: the normalised compressed latent
`c` (`kv_lora_rank`) and the rotary key `k_rot` (`qk_rope_head_dim`), stored as one row
`[c | k_rot]`. A DSA layer (`indexed_attention`) also keeps its indexer key (`index_head_dim`);
layers that reuse an earlier layer's selection (`config.indexer_types[i] == "shared"`, GLM-5) keep
none. Durable bytes per prompt token and layer: (kv_lora_rank + qk_rope_head_dim [+ index_head_dim]) ·
dtype size — never the expanded per-head K/V.

transformers' MLA modules expand the cached latents per head (`expand_kv`) before attention, which would materialise
heads × P × head_dim for the prompt. Inside a longstraw forward `LatentAttention` (a mixin `longstraw.prepare` puts in
front of the module's class) takes over the module's forward: it calls the module's own projections, norms and rotary
function, and attends in latent space (`longstraw.ops.latent_attention`: absorbed up-projections, blockwise split
attention; DSA: blockwise indexer top-k, gathered sparse attention).
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..hf.cache import active_cache
from ..hf.stand_ins import install
from ..ops.latent_attention import (
    Selection,
    absorb_query,
    absorbed_weights,
    expand_output,
    latent_attention,
    select_topk,
    sparse_latent_attention,
)
from ..ops.quant import QuantizedTokens
from . import base
from .base import (
    LatentBranch,
    LayerState,
    PromptBranchLayer,
    grown_bytes,
    register_layer_kind,
)


@functools.cache
def _returns_selection(cls) -> bool:
    """Whether an attention module class hands its DSA selection to the next layer (GLM-5's `prev_topk_indices`)."""
    return "prev_topk_indices" in inspect.signature(cls.forward).parameters


class LatentOwn:
    """The latent side of a branch layer (`LatentBranch`): the branch's own latents `[B, 1, T, r + dr]` (`keys`) and
    DSA indexer keys `[B, T, Di]` (`index_keys`), appended as the branch runs; the prompt part it reads locally
    (`prompt`, `prompt_index`: none unless a subclass sets them) and the absorbed up-projections cached per branch."""

    #: whether `values` names the own latents too (the context-parallel layers read them as keys and as values)
    values_alias = False
    keys: torch.Tensor | None
    values: torch.Tensor | None
    index_keys: torch.Tensor | None = None
    prompt: torch.Tensor | QuantizedTokens | None = None
    prompt_index: torch.Tensor | None = None
    absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, latent: torch.Tensor) -> torch.Tensor:
        self.keys = latent if self.keys is None else torch.cat([self.keys, latent], dim=-2)
        if self.values_alias:
            self.values = self.keys
        return self.keys

    def append_index(self, keys: torch.Tensor) -> torch.Tensor:
        self.index_keys = keys if self.index_keys is None else torch.cat([self.index_keys, keys], dim=-2)
        return self.index_keys

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys = self.keys[indices]
            if self.values_alias:
                self.values = self.keys
        if self.index_keys is not None:
            self.index_keys = self.index_keys[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys, self.index_keys = base.repeat_rows(self.keys, repeats), base.repeat_rows(self.index_keys, repeats)
        if self.values_alias:
            self.values = self.keys

    def select_keys(self, q, weights, scale, own_keys, topk, *, q_start, own_start, block) -> Selection:
        """DSA's selection: each query's `topk` keys over [the prompt's indexer keys `prompt_index` | the own ones
        `own_keys` `[B, T, Di]`] (`longstraw.ops.latent_attention.select_topk`), from the indexer queries `q`
        `[B, S, Hi, Di]` and head weights `weights` `[B, S, Hi]`. Context-parallel layers select across the ranks."""
        return select_topk(
            q,
            weights,
            scale,
            self.prompt_index,
            own_keys,
            topk,
            q_start=q_start,
            own_start=own_start,
            block=block,
        )

    def attend_latent(
        self, module, query, own, selection: Selection | None, rank: int, *, q_start, own_start, scale, block
    ) -> torch.Tensor:
        """Latent attention `[B, H, S, r]` (r = `rank`) of the absorbed queries `query` `[B, H, S, r + dr]` over [the
        prompt's latents `prompt` | the own latents `own` `[B, 1, T, r + dr]`]: dense (`selection` None) or over the
        keys DSA's `selection` chose. Context-parallel layers read the prompt's slices across the ranks."""
        if selection is None:
            return latent_attention(
                query, own, self.prompt, rank, q_start=q_start, own_start=own_start, scale=scale, block=block
            )
        return sparse_latent_attention(
            query, own, self.prompt, selection, rank, q_start=q_start, own_start=own_start, scale=scale, block=block
        )


class LatentBranchLayer(LatentOwn, PromptBranchLayer):
    """transformers cache layer of one branch over a read-only prompt latent (and indexer keys).

    `prompt` `[1, 1, P, r + dr]` (or None), `prompt_index` `[1, P, Di]` (DSA, or None); the branch's own
    latents `[B, 1, T, r + dr]` and indexer keys `[B, T, Di]` are appended by `append` / `append_index`.
    """

    is_sliding = False
    is_croppable = False
    window = None
    carries_segments = True
    grown_tensors = (("keys", -2), ("index_keys", 1))  # own latents `[B, 1, T, r + dr]`, indexer keys `[B, T, Di]`

    def __init__(self, prompt, prompt_index, prompt_length: int):
        super().__init__()
        self.prompt, self.prompt_index = prompt, prompt_index
        self.prompt_length = prompt_length
        self.index_keys = None
        #: (W_k, W_v) read once per branch when running without grad (decode steps of the sampler)
        self.absorbed = None
        self.is_initialized = True

    def lazy_initialization(self, *args) -> None:
        pass

    def update(self, *args, **kwargs):
        raise RuntimeError("latent-attention layers run through longstraw's LatentAttention, not cache.update")


class LatentAttention:
    """Mixin that `longstraw.prepare` puts in front of a transformers MLA attention class (a subclass is made
    per class, so parameters, adapters and the state dict stay those of the module).

    Outside a longstraw forward it is the module's own `forward`. Inside one, same inputs and outputs (DSA
    modules of GLM-5 also return their selection, which the next `"shared"` layer receives as
    `prev_topk_indices`), but the math runs in latent space against the branch layer of `layer_idx`, with
    the module's own projections, norms and the rotary functions its family spec names
    (`longstraw.archs`; set by `prepare` as `longstraw_rotary`). Memory beyond the projections:
    O(B · H · S · (r + dr)) for the latent queries, the split attention's O(H · S · block) tiles, and for
    DSA O(B · S · top-k) indices plus one block of gathered latents.
    """

    #: (attention rotary, indexer rotary) from the family spec, each `fn(q, k, position_embeddings, **kw)` or None
    longstraw_rotary: tuple = (None, None)

    #: the transformers class this mixin was put in front of (set by `longstraw.prepare`)
    longstraw_base: type = object

    def forward(self, hidden_states, *args, **kwargs):
        cache = active_cache()
        if cache is None:
            return super().forward(hidden_states, *args, **kwargs)
        if args:  # name the positional arguments as the module's own forward does
            bound = inspect.signature(self.longstraw_base.forward).bind(self, hidden_states, *args, **kwargs)
            kwargs = {**bound.arguments, **bound.arguments.pop("kwargs", {})}
        position_embeddings = kwargs.get("position_embeddings")
        prev_topk_indices = kwargs.get("prev_topk_indices")
        m = self
        if m.training and m.attention_dropout:
            raise NotImplementedError("attention dropout is not supported by longstraw replay; set attention_dropout=0")
        layer: LatentBranch = cache.layers[m.layer_idx]
        b, s, _ = hidden_states.shape
        h, dn, dr, r = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        if m.q_lora_rank is None:
            q_resid, q = None, m.q_proj(hidden_states)
        else:
            q_resid = m.q_a_layernorm(m.q_a_proj(hidden_states))
            q = m.q_b_proj(q_resid)
        q = q.view(b, s, h, dn + dr).transpose(1, 2)
        q_nope, q_rot = q[..., :dn], q[..., dn:]
        c, k_rot = torch.split(m.kv_a_proj_with_mqa(hidden_states), [r, dr], dim=-1)
        c = m.kv_a_layernorm(c).view(b, 1, s, r)
        k_rot = k_rot.view(b, 1, s, dr)
        rotary, index_rotary = self.longstraw_rotary
        if rotary is not None:
            q_rot, k_rot = rotary(q_rot, k_rot, position_embeddings)
        own = layer.append(torch.cat([c, k_rot], dim=-1))
        own_start = layer.prompt_length
        q_start = own_start + own.shape[-2] - s

        if torch.is_grad_enabled():
            w_k, w_v = absorbed_weights(m.kv_b_proj, h, dn, m.v_head_dim)
        else:  # capture chunk / sampling: the weights are constant for the branch, read them once
            if layer.absorbed is None:
                layer.absorbed = absorbed_weights(m.kv_b_proj, h, dn, m.v_head_dim)
            w_k, w_v = layer.absorbed
        query = absorb_query(q_nope, q_rot, w_k)
        indexer = getattr(m, "indexer", None)
        selection = prev_topk_indices
        if indexer is not None:
            selection = self._select(
                indexer,
                hidden_states,
                q_resid,
                position_embeddings,
                layer,
                q_start,
                own_start,
                cache.block,
                index_rotary,
            )
        elif getattr(m, "skip_topk", False) and selection is None:
            raise ValueError("shared DSA layers need the selection of an earlier indexer layer")
        out = layer.attend_latent(
            m, query, own, selection, r, q_start=q_start, own_start=own_start, scale=m.scaling, block=cache.block
        )
        out = m.o_proj(expand_output(out, w_v))
        return (out, None, selection) if _returns_selection(self.longstraw_base) else (out, None)

    @torch.no_grad()
    def _select(
        self,
        indexer,
        hidden_states,
        q_resid,
        position_embeddings,
        layer: LatentBranch,
        q_start: int,
        own_start: int,
        block: int,
        rotary,
    ) -> Selection:
        """DSA selection with the indexer's own projections (transformers runs the indexer without grad)."""
        q, k, weights = indexer_inputs(indexer, hidden_states, q_resid, position_embeddings, rotary)
        own_keys = layer.append_index(k)
        return layer.select_keys(
            q,
            weights,
            indexer.softmax_scale,
            own_keys,
            indexer.index_topk,
            q_start=q_start,
            own_start=own_start,
            block=block,
        )


def indexer_inputs(indexer, hidden_states, q_resid, position_embeddings, rotary):
    """(queries `[B, S, Hi, Di]`, keys `[B, S, Di]`, head weights `[B, S, Hi]`) of a transformers DSA indexer
    (`GlmMoeDsaIndexer` / `DeepseekV32Indexer`, 5.24), computed as its forward does; `rotary` its RoPE function."""
    b, s, _ = hidden_states.shape
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    dr = indexer.qk_rope_head_dim
    q_rot, q_pass = q[..., :dr], q[..., dr:]
    k_rot, k_pass = k[..., :dr], k[..., dr:]
    if rotary is not None:
        q_rot, k_rot = rotary(q_rot, k_rot, position_embeddings, unsqueeze_dim=2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return (
        torch.cat([q_rot, q_pass], dim=-1),
        torch.cat([k_rot, k_pass], dim=-1).squeeze(2),
        weights * indexer.n_heads**-0.5,
    )


@register_layer_kind
class LatentState(LayerState):
    """Prompt latents of an MLA layer: `[1, 1, P−1, kv_lora_rank + qk_rope_head_dim]`."""

    layer_types = ("latent_attention",)
    grows_with_prompt = True
    appends_own_kv = True  # its own latents

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """The latents `[c | k_rot]` of every prompt token, and DSA's indexer keys where the layer keeps its own
        (model dtype: they are not quantized)."""
        total = grown_bytes(tokens, 1, config.kv_lora_rank + config.qk_rope_head_dim, elem, state_dtype)
        types = getattr(config, "indexer_types", None)
        if getattr(config, "index_head_dim", None) and (types is None or types[layer_idx] != "shared"):
            total += tokens * config.index_head_dim * elem
        return total

    #: latent-width activations per head in a capture chunk (`capture_activation_bytes`); calibrated on
    #: bench/plan_accuracy.py's models
    capture_activation_factor = 5

    @classmethod
    def capture_activation_bytes(cls, config, elem: int) -> int:
        # MLA: absorbed queries, latent-space output and per-head expansion (dense MLA also its latent-width
        # attention output; DSA gathers top-k latents instead)
        return (
            elem
            * config.num_attention_heads
            * cls.capture_activation_factor
            * (config.kv_lora_rank + config.qk_rope_head_dim)
        )

    @classmethod
    def check_layer(cls, config, index: int, block, family) -> str | None:
        if family is None or family.latent_rotary is None:  # the rotary functions are the family's (`longstraw.archs`)
            return "latent attention without a family spec"
        return None

    @classmethod
    def install(cls, block, family) -> None:
        """`LatentAttention` in front of the attention module's class, with the family's rotary functions, looked up
        in the module of the attention's own class."""
        attn = block.self_attn
        attn.longstraw_rotary = family.latent_rotary(attn)
        install(attn, LatentAttention)

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        #: a plain tensor, or 8-bit `QuantizedTokens` when `state_dtype` is set
        self.latent: torch.Tensor | QuantizedTokens | None = None

    supports_compression = True

    def _prompt(self, n: int):
        if isinstance(self.latent, QuantizedTokens):
            return self.latent
        return None if self.latent is None else self.latent[:, :, :n]

    def branch(self, batch: int = 1) -> LatentBranchLayer:
        return LatentBranchLayer(self._prompt(self.length), None, self.length)

    def commit(self, branch_layer: LatentBranchLayer, n: int) -> None:
        own = branch_layer.keys
        assert own is not None  # the branch ran the chunk
        if own.shape[-2] != n:
            raise RuntimeError(f"layer {self.layer_idx}: chunk of {n} tokens produced {own.shape[-2]} latents")
        if self.length + n > self.capacity:
            raise RuntimeError(f"layer {self.layer_idx}: committing past the captured length {self.capacity}")
        if self.state_dtype is not None:  # 8-bit latents with per-block scales
            if self.latent is None:
                self.latent = QuantizedTokens(own, self.capacity, self.state_dtype)
            assert isinstance(self.latent, QuantizedTokens)  # quantized from the first chunk
            self.latent.append(own)
            self.length += n
            return
        if self.latent is None:
            self.latent = base.empty_state(own, (1, 1, self.capacity, own.shape[-1]))
        assert isinstance(self.latent, torch.Tensor)  # state_dtype is None
        self.latent[:, :, self.length : self.length + n] = own
        self.length += n

    def tensors(self) -> list[torch.Tensor]:
        if isinstance(self.latent, QuantizedTokens):
            return self.latent.tensors()
        return [] if self.latent is None else [self.latent]

    def release(self) -> None:
        self.latent = None

    # ------------------------------------------------------------------ exact mode
    supports_exact = True

    def require_grad(self) -> None:
        if self.latent is not None:
            assert isinstance(self.latent, torch.Tensor)  # exact mode refuses a quantized state
            self.latent.requires_grad_(True)

    def reverse_branch(self, chunk: int, start: int) -> LatentBranchLayer:
        return LatentBranchLayer(self._prompt(start), None, start)

    def chunk_outputs(self, chunk, start, end, branch_layer):
        if self.latent is None or self.latent.grad is None:
            return []
        return [(branch_layer.keys, self.latent.grad[:, :, start:end])]


@register_layer_kind
class IndexedLatentState(LatentState):
    """MLA latents plus the DSA indexer keys `[1, P−1, index_head_dim]` (none on `"shared"` GLM-5 layers,
    which reuse the selection of the layer before)."""

    layer_types = ("indexed_attention",)
    reads_with_blockwise_kernel = True  # DSA scoring
    capture_activation_factor = 3  # gathers the top-k latents instead of the latent-width attention output

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        types = getattr(config, "indexer_types", None)
        self.has_indexer = types is None or types[layer_idx] != "shared"
        self.index_keys: torch.Tensor | None = None

    def _index(self, n: int):
        return None if self.index_keys is None else self.index_keys[:, :n]

    def branch(self, batch: int = 1) -> LatentBranchLayer:
        return LatentBranchLayer(self._prompt(self.length), self._index(self.length), self.length)

    def commit(self, branch_layer: LatentBranchLayer, n: int) -> None:
        start = self.length
        super().commit(branch_layer, n)
        keys = branch_layer.index_keys
        if self.has_indexer:
            if keys is None or keys.shape[-2] != n:
                raise RuntimeError(f"layer {self.layer_idx}: the indexer produced no keys for a chunk of {n} tokens")
            if self.index_keys is None:
                self.index_keys = base.empty_state(keys, (1, self.capacity, keys.shape[-1]))
            self.index_keys[:, start : start + n] = keys

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + ([] if self.index_keys is None else [self.index_keys])

    def release(self) -> None:
        super().release()
        self.index_keys = None

    def reverse_branch(self, chunk: int, start: int) -> LatentBranchLayer:
        return LatentBranchLayer(self._prompt(start), self._index(start), start)
