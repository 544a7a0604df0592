"""DeepSeek-V4 compressed attention (CSA / HCA): the durable state is the compressed entries plus a window.

Per layer, after the prompt (transformers 5.24's `DeepseekV4CSACache` / `DeepseekV4HCACache` keep the same):
- the last W − 1 sliding-window keys `[1, 1, W−1, D]` (K = V: stored once);
- per compressed stream (the compressor's; for CSA also the indexer's, at `index_head_dim`): the entries
  written so far `[1, 1, ⌊(P−1)/m⌋, D]`, the not-yet-compressed tail of the current window (its raw
  `kv`, `gate` `[1, (P−1) mod m, F]`) and, for CSA, the Ca slice of the last complete window with its
  biased gate `[1, m, D]` (the next entry pools it).
Durable bytes per prompt token and layer: CSA (head_dim + index_head_dim) / m, HCA head_dim / m' (times the
dtype size), plus O(W + m) independent of P.

Inside a longstraw forward `CompressedAttention` (put in front of `DeepseekV4Attention` by `longstraw.prepare`)
runs the module's own projections, norms and RoPE, extends the streams with the branch's tokens (a
response that completes a window creates the entry the full-sequence forward makes: same pooling, same
position), and attends to [sliding window | entries] by log-sum-exp merges (`longstraw.ops.compressed_attention`).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, replace

import torch

from ..hf.cache import active_cache
from ..hf.stand_ins import install
from ..ops.attention import split_attention
from ..ops.compressed_attention import (
    apply_sinks,
    check_rate,
    dense_entry_part,
    entry_part,
    entry_positions,
    gathered_entry_part,
    merge_parts,
    pool_windows,
)
from ..ops.latent_attention import index_scores, select_topk
from . import base
from .base import register_layer_kind
from .full_attention import AttentionBranchLayer
from .sliding_window import SlidingKVState

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def _rope(module):
    """transformers 5.24 `apply_rotary_pos_emb` of DeepSeek-V4 (interleaved, on the trailing rope slice)."""
    cls = getattr(type(module), "longstraw_base", type(module))  # the transformers class behind a prepared module
    return sys.modules[cls.__module__].apply_rotary_pos_emb


@dataclass(frozen=True)
class Stream:
    """One compressed series as a branch sees it (frozen: a branch rebinds, so snapshots stay valid).

    `prompt` `[1, 1, n, D]`: the prompt's entries (read-only; None when n = 0); `tail_kv`, `tail_gate`
    `[1|B, t, F]`: raw source tokens after the last complete window; `prior_kv`, `prior_gate` `[1|B, m, D]`:
    CSA overlap of the last complete window (None before the first); `own` `[B, 1, k, D]`: entries the branch
    completed (None: none yet)."""

    rate: int
    count: int
    prompt: torch.Tensor | None = None
    tail_kv: torch.Tensor | None = None
    tail_gate: torch.Tensor | None = None
    prior_kv: torch.Tensor | None = None
    prior_gate: torch.Tensor | None = None
    own: torch.Tensor | None = None

    @property
    def own_count(self) -> int:
        return 0 if self.own is None else self.own.shape[-2]

    def push(self, module, kv: torch.Tensor, gate: torch.Tensor, overlap: bool) -> Stream:
        """The stream after source tokens `kv`, `gate` `[B, S, F]` of `module` (a transformers V4 compressor or
        indexer: `position_bias`, `kv_norm`, `rotary_emb`, `head_dim`)."""
        b = kv.shape[0]
        if self.tail_kv is not None and self.tail_kv.shape[1]:
            assert self.tail_gate is not None  # kept with tail_kv
            kv = torch.cat([self.tail_kv.expand(b, -1, -1), kv], dim=1)
            gate = torch.cat([self.tail_gate.expand(b, -1, -1), gate], dim=1)
        usable = (kv.shape[1] // self.rate) * self.rate
        new = replace(self, tail_kv=kv[:, usable:], tail_gate=gate[:, usable:])
        if not usable:
            return new
        prior_kv, prior_gate = self.prior_kv, self.prior_gate
        if prior_kv is not None:
            assert prior_gate is not None  # kept with prior_kv
            prior_kv, prior_gate = prior_kv.expand(b, -1, -1), prior_gate.expand(b, -1, -1)
        pooled, (p_kv, p_gate) = pool_windows(
            kv[:, :usable], gate[:, :usable], module.position_bias, prior_kv, prior_gate, module.head_dim, overlap
        )
        entries = module.kv_norm(pooled)
        first = self.count + self.own_count
        positions = (torch.arange(entries.shape[1], device=entries.device) + first) * self.rate
        cos, sin = module.rotary_emb(entries, position_ids=positions[None].expand(b, -1), layer_type="compress")
        entries = _rope(module)(entries.unsqueeze(1), cos, sin)  # [B, 1, n, D]
        own = entries if self.own is None else torch.cat([self.own, entries], dim=-2)
        return replace(new, prior_kv=p_kv, prior_gate=p_gate, own=own)

    def own_positions(self, device) -> torch.Tensor:
        return entry_positions(self.count, self.own_count, self.rate, device)

    def repeat_rows(self, repeats: int) -> Stream:
        """Each row's tensors `repeats` times in a row (`base.repeat_rows`; `Branch` → G sequences)."""
        return replace(
            self,
            tail_kv=base.repeat_rows(self.tail_kv, repeats),
            tail_gate=base.repeat_rows(self.tail_gate, repeats),
            prior_kv=base.repeat_rows(self.prior_kv, repeats),
            prior_gate=base.repeat_rows(self.prior_gate, repeats),
            own=base.repeat_rows(self.own, repeats),
        )

    def select_rows(self, indices: torch.Tensor) -> Stream:
        def rows(t):
            return t if t is None or t.shape[0] == 1 else t[indices]

        return replace(
            self,
            tail_kv=rows(self.tail_kv),
            tail_gate=rows(self.tail_gate),
            prior_kv=rows(self.prior_kv),
            prior_gate=rows(self.prior_gate),
            own=None if self.own is None else self.own[indices],
        )


class CompressedBranchLayer(AttentionBranchLayer):
    """Branch cache layer of a CSA / HCA layer: the sliding part of `AttentionBranchLayer` (K = V) plus the
    compressed `streams` (name → `Stream`: "compressor", and "indexer" for CSA). A segmented replay does not carry
    the streams: a trajectory through it is replayed whole."""

    carries_segments = False

    def __init__(self, prompt_k, prompt_length: int, prompt_start: int, window: int, streams: dict):
        super().__init__(prompt_k, prompt_k, prompt_length, prompt_start, window)
        self.streams = dict(streams)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.streams = {name: st.select_rows(indices) for name, st in self.streams.items()}

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.streams = {name: st.repeat_rows(repeats) for name, st in self.streams.items()}


@register_layer_kind
class CompressedKVState(SlidingKVState):
    """Sliding-window keys plus the compressed streams of a DeepSeek-V4 CSA / HCA layer (module docstring)."""

    layer_types = (CSA, HCA)
    uses_attention_interface = False  # its own attention over the compressed entries (`CompressedAttention`)
    # the planner's capture terms count neither its own entries nor score tiles (`CompressedAttention`'s own kernels)
    appends_own_kv = False
    reads_with_blockwise_kernel = False
    window: int  # the sliding window (`SlidingKVState.__init__`)

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        """Window keys (K = V, once) + per compressed stream (CSA: entries and indexer keys; HCA: entries) the entries
        written so far, the raw tail's kv + gate, and CSA's overlap kv + gate of the last window."""
        kind = CSA if layer_idx is not None and config.layer_types[layer_idx] == CSA else HCA
        m, d = config.compress_rates[kind], config.head_dim
        total = elem * d * min(tokens, config.sliding_window - 1)
        sparse = kind == CSA
        streams = [(d, 2 * d), (config.index_head_dim, 2 * config.index_head_dim)] if sparse else [(d, d)]
        for dim, width in streams:
            total += elem * (tokens // m * dim + 2 * (tokens % m) * width)
            if sparse and tokens >= m:
                total += elem * 2 * m * dim
        return total

    @classmethod
    def install(cls, block, family) -> None:
        install(block.self_attn, CompressedAttention)

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        self.layer_type = config.layer_types[layer_idx]
        rates = getattr(config, "compress_rates", None) or {}
        self.rate = check_rate(self.layer_type, rates.get(self.layer_type))
        self.names = ("compressor", "indexer") if self.layer_type == CSA else ("compressor",)
        #: per stream: entries `[1, 1, capacity // rate, D]` (filled as windows close), tail and overlap
        self.entries: dict[str, torch.Tensor | None] = {name: None for name in self.names}
        self.tails: dict[str, tuple] = {name: (None, None) for name in self.names}
        self.priors: dict[str, tuple] = {name: (None, None) for name in self.names}
        #: exact mode: (tails, priors) of every stream at each captured chunk's start
        self.stream_boundaries: list[tuple[dict, dict]] = []

    @property
    def count(self) -> int:
        return self.length // self.rate

    def _streams(self) -> dict[str, Stream]:
        n = self.count
        return {
            name: Stream(
                self.rate,
                n,
                None if (e := self.entries[name]) is None else e[:, :, :n],
                *self.tails[name],
                *self.priors[name],
            )
            for name in self.names
        }

    def branch(self, batch: int = 1) -> CompressedBranchLayer:
        return CompressedBranchLayer(self.keys, self.length, self.start, self.window, self._streams())

    def commit(self, branch_layer: AttentionBranchLayer, n: int) -> None:
        assert isinstance(branch_layer, CompressedBranchLayer)  # the layer `branch` made
        before = self.count
        super().commit(branch_layer, n)
        self.values = self.keys  # K = V in DeepSeek-V4: one copy
        for name, st in branch_layer.streams.items():
            if st.own is not None:
                entries = self.entries[name]
                if entries is None:
                    entries = self.entries[name] = base.empty_state(
                        st.own, (1, 1, self.capacity // self.rate, st.own.shape[-1])
                    )
                entries[:, :, before : before + st.own_count] = st.own
            # clones: slices would keep the chunk's projections alive
            self.tails[name] = (st.tail_kv.clone(), st.tail_gate.clone())
            if st.prior_kv is not None:
                self.priors[name] = (st.prior_kv.clone(), st.prior_gate.clone())
        if self.count != before + branch_layer.streams["compressor"].own_count:
            raise RuntimeError(f"layer {self.layer_idx}: entries out of step with the captured length")

    def tensors(self) -> list[torch.Tensor]:
        out = [] if self.keys is None else [self.keys]
        for name in self.names:
            out += [t for t in (self.entries[name], *self.tails[name], *self.priors[name]) if t is not None]
        return out

    # ------------------------------------------------------------------ exact mode
    # The entries are leaves whose gradient (from replays and from later chunks' recomputation) flows back, in
    # the reverse pass, into the tokens they pool; the compressor's tail and overlap at each chunk boundary are
    # leaves too (like a recurrent state at the boundary): a window that spans two chunks passes its gradient
    # from the chunk that closes it to the chunk that began it. The indexer's state gets no gradient (its
    # choice is discrete). The window keys follow `SlidingKVState` (one leaf: K = V).
    supports_exact = True

    def mark_boundary(self) -> None:
        super().mark_boundary()
        self.stream_boundaries.append((dict(self.tails), dict(self.priors)))

    def require_grad(self) -> None:
        def leaf(t):
            return None if t is None else t.detach().requires_grad_(True)

        self.boundaries = [(k, k, start) for k, start in ((leaf(k), start) for k, _, start in self.boundaries)]
        self.keys = self.values = leaf(self.keys)
        if self.entries["compressor"] is not None:
            self.entries["compressor"].requires_grad_(True)

        def leaves(tails, priors):
            tails, priors = dict(tails), dict(priors)
            tails["compressor"] = tuple(leaf(t) for t in tails["compressor"])
            priors["compressor"] = tuple(leaf(t) for t in priors["compressor"])
            return tails, priors

        self.stream_boundaries = [leaves(*b) for b in self.stream_boundaries]
        self.tails, self.priors = leaves(self.tails, self.priors)

    def reverse_branch(self, chunk: int, start: int) -> CompressedBranchLayer:
        k, _, k_start = self.boundaries[chunk]
        tails, priors = self.stream_boundaries[chunk]
        n = start // self.rate
        streams = {
            name: Stream(
                self.rate, n, None if (e := self.entries[name]) is None else e[:, :, :n], *tails[name], *priors[name]
            )
            for name in self.names
        }
        return CompressedBranchLayer(k, start, k_start, self.window, streams)

    def chunk_outputs(self, chunk, start, end, branch_layer):
        out = super().chunk_outputs(chunk, start, end, branch_layer)[:1]  # window keys (K = V: one leaf)
        st = branch_layer.streams["compressor"]
        entries = self.entries["compressor"]
        if st.own is not None and entries is not None and entries.grad is not None:
            out.append((st.own, entries.grad[:, :, st.count : st.count + st.own_count]))
        tails, priors = (
            self.stream_boundaries[chunk + 1] if chunk + 1 < len(self.stream_boundaries) else (self.tails, self.priors)
        )
        mine = (st.tail_kv, st.tail_gate, st.prior_kv, st.prior_gate)
        for t, leaf in zip(mine, (*tails["compressor"], *priors["compressor"])):
            if t is not None and leaf is not None and leaf.grad is not None:
                out.append((t, leaf.grad))
        return out

    def release(self) -> None:
        super().release()
        self.entries = {name: None for name in self.names}
        self.tails = {name: (None, None) for name in self.names}
        self.priors = {name: (None, None) for name in self.names}
        self.stream_boundaries = []


class CompressedAttention:
    """Mixin that `longstraw.prepare` puts in front of transformers' `DeepseekV4Attention` on CSA / HCA layers (a
    subclass per class: parameters, adapters and the state dict stay the module's own).

    Outside a longstraw forward it is the module's own `forward`. Inside one, same inputs and outputs; the
    attention reads the branch layer of `layer_idx`: sliding part by `split_attention` (prompt window | own
    keys), compressed part over [prompt entries | entries the branch completed] — HCA: every visible entry
    (prompt entries blockwise, own entries dense); CSA: the indexer's top-k, selected blockwise
    (`select_topk`, no queries × P scores) and gathered per block of queries — all merged by log-sum-exp with
    the sinks applied last. Memory beyond the projections: O(H · S · block) tiles, O(B · S · top-k) indices
    and one block of gathered entries.
    """

    longstraw_base: type = object

    def forward(self, hidden_states, *args, **kwargs):
        cache = active_cache()
        if cache is None:
            return super().forward(hidden_states, *args, **kwargs)
        if args:
            bound = inspect.signature(self.longstraw_base.forward).bind(self, hidden_states, *args, **kwargs)
            kwargs = {**bound.arguments, **bound.arguments.pop("kwargs", {})}
        m = self
        if m.training and m.attention_dropout:
            raise NotImplementedError("attention dropout is not supported by longstraw replay; set attention_dropout=0")
        rope = _rope(m)
        position_embeddings = kwargs["position_embeddings"]
        cos, sin = position_embeddings[m.rope_layer_type]
        b, s, _ = hidden_states.shape
        layer: CompressedBranchLayer = cache.layers[m.layer_idx]

        q_residual = m.q_a_norm(m.q_a_proj(hidden_states))
        q = m.q_b_norm(m.q_b_proj(q_residual).view(b, s, -1, m.head_dim).transpose(1, 2))
        q = rope(q, cos, sin)
        kv = rope(m.kv_norm(m.kv_proj(hidden_states)).view(b, s, -1, m.head_dim).transpose(1, 2), cos, sin)
        own_k, _ = layer.update(kv, kv)
        own_start = layer.prompt_length + layer.own_length - own_k.shape[-2]
        q_start = own_start + own_k.shape[-2] - s
        sliding = split_attention(
            q,
            own_k,
            own_k,
            layer.prompt_k,
            layer.prompt_k,
            q_start=q_start,
            own_start=own_start,
            prompt_start=layer.prompt_start,
            scale=m.scaling,
            window=layer.window,
            block=cache.block,
            with_lse=True,
        )

        comp = m.compressor
        overlap = hasattr(comp, "indexer")  # CSA pools overlapping windows (and has an indexer); HCA does not
        st = layer.streams["compressor"].push(comp, comp.kv_proj(hidden_states), comp.gate_proj(hidden_states), overlap)
        layer.streams["compressor"] = st
        parts = []
        selection = None
        if "indexer" in layer.streams:
            selection = self._select(
                comp.indexer, hidden_states, q_residual, position_embeddings, layer, q_start, cache.block
            )
        if selection is not None and selection.indices is not None:
            parts.append(gathered_entry_part(q, st.prompt, st.own, selection, m.scaling))
        else:
            if st.prompt is not None and st.count:
                parts.append(entry_part(q, st.prompt, m.scaling, cache.block))
            if st.own is not None:
                parts.append(dense_entry_part(q, st.own, st.own_positions(q.device), q_start, m.scaling))
        out, lse = merge_parts(sliding, *parts)
        out = apply_sinks(out, lse, m.sinks)  # [B, H, S, D]
        out = rope(out, cos, -sin).transpose(1, 2)  # undo the values' RoPE at the query position (K = V)
        grouped = m.o_a_proj(out.reshape(b, s, m.config.o_groups, -1)).flatten(2)
        return m.o_b_proj(grouped), None

    @torch.no_grad()
    def _select(self, indexer, hidden_states, q_residual, position_embeddings, layer, q_start, block):
        """CSA selection with the indexer's own projections (its choice is discrete: no gradient, as in
        transformers)."""
        b, s, _ = hidden_states.shape
        st = layer.streams["indexer"].push(
            indexer, indexer.kv_proj(hidden_states), indexer.gate_proj(hidden_states), True
        )
        layer.streams["indexer"] = st
        positions = torch.arange(q_start, q_start + s, device=hidden_states.device)[None].expand(b, -1)
        cos, sin = indexer.rotary_emb(hidden_states, position_ids=positions, layer_type="compress")
        q = indexer.q_b_proj(q_residual).view(b, s, -1, indexer.head_dim).transpose(1, 2)
        q = _rope(indexer)(q, cos, sin).transpose(1, 2)  # [B, S, Hi, Di]
        weights = indexer.scorer.weights_proj(hidden_states).float() * indexer.scorer.weights_scaling
        prompt = None if st.prompt is None or not st.count else st.prompt[:, 0]
        own = st.own[:, 0] if st.own is not None else hidden_states.new_zeros((b, 0, indexer.head_dim))
        return select_topk(
            q,
            weights,
            indexer.scorer.softmax_scale,
            prompt,
            own,
            indexer.index_topk,
            q_start=q_start,
            own_start=st.count,
            block=block,
            own_positions=st.own_positions(hidden_states.device),
        )


@torch.no_grad()
def full_indexer_scores(indexer, hidden_states, q_residual) -> torch.Tensor:
    """Indexer scores `[B, S, n]` of a whole sequence from position 0 (future entries −inf), computed with the
    stream and scoring code above: what the tie-free checks of the tests compare the top-k boundary on."""
    b, s, _ = hidden_states.shape
    rate = indexer.compress_rate
    st = Stream(rate, 0).push(indexer, indexer.kv_proj(hidden_states), indexer.gate_proj(hidden_states), True)
    positions = torch.arange(s, device=hidden_states.device)
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=positions[None].expand(b, -1), layer_type="compress")
    q = indexer.q_b_proj(q_residual).view(b, s, -1, indexer.head_dim).transpose(1, 2)
    q = _rope(indexer)(q, cos, sin).transpose(1, 2)
    weights = indexer.scorer.weights_proj(hidden_states).float() * indexer.scorer.weights_scaling
    if st.own is None:
        return hidden_states.new_zeros((b, s, 0), dtype=torch.float32)
    scores = index_scores(q, weights, st.own[:, 0], indexer.scorer.softmax_scale)
    visible = st.own_positions(hidden_states.device)[None, :] <= positions[:, None]
    return scores.masked_fill(~visible[None], float("-inf"))
