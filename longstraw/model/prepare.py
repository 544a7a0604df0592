"""Prepare a model for longstraw once: its attention implementation, and stand-ins installed by subclassing.

`prepare(model)` (called by `capture`) checks that longstraw can represent every decoder layer
(`longstraw.model.capability.check_capability`), then installs, once per model:
- nothing for attention itself: each longstraw forward names the "longstraw" implementation on the
  model's configs for its duration (`longstraw.hf.cache.running`); `prepare` asks transformers
  once to switch and verifies the switch on every config the model's modules read (a refused switch
  would otherwise only log a warning and replays would silently ignore the prompt), then switches back;
- on MLA attention modules, `LatentAttention` in front of their class (attends in latent space
  inside a longstraw forward, the module's own forward outside); on DeepSeek-V4 CSA / HCA attention
  modules, `CompressedAttention` likewise (attends to compressed entries, `longstraw.kinds.compressed_attention`);
- on every decoder layer, `CheckpointedLayer` in front of its class: inside a longstraw forward it runs
  the layer under longstraw's activation checkpointing when the branch asks for it (or when
  transformers' own checkpointing is on, which would drop the cache), and the plain layer otherwise;
  it also runs a recurrent layer a chunk of positions at a time when the cache asks (`BranchCache.layer_chunks`);
- on every decoder layer's feed-forward module (`block.mlp`), `ChunkedFeedForward`: a chunk of positions at a
  time when the cache asks (`BranchCache.ffn_chunk`; the context-parallel capture does both).

The stand-ins are subclasses made per class, the way `torch.distributed.fsdp.fully_shard` extends a
module's class: parameters, adapters, hooks and the state dict stay the module's own, so the prepared
model trains, generates and saves as before. `unprepare(model)` puts everything back.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..archs import family
from ..errors import UnsupportedArchitectureError
from ..hf.cache import ATTN_IMPLEMENTATION, active_cache, running, snapshot
from ..hf.parts import base_model, decoder_of, model_configs
from ..hf.stand_ins import install, is_stand_in
from ..kinds import layer_kind
from .capability import check_capability, model_plan


@contextmanager
def _hf_checkpointing_off(layer: nn.Module):
    """transformers' own checkpointing of a layer (`GradientCheckpointingLayer`, 5.24) replaces the cache by
    None, which would restart linear-attention layers from a zero state: off for a longstraw call."""
    on = getattr(layer, "gradient_checkpointing", False)
    if on:
        layer.gradient_checkpointing = False  # type: ignore[assignment]  # a plain bool transformers sets on the layer
    try:
        yield
    finally:
        if on:
            layer.gradient_checkpointing = True  # type: ignore[assignment]  # as above


class CheckpointedLayer:
    """Mixin in front of a decoder layer class (see the module docstring).

    Checkpointed call: the branch cache layer is stateful (the forward appended the branch's K/V or
    latents, or advanced its recurrent state); the recomputation in backward runs against a snapshot
    taken before the forward, so it sees exactly what the forward saw and leaves the branch as the
    forward left it. Memory of a replay: O(layers · R · hidden) saved inputs plus one layer's graph,
    instead of every layer's graph (attention projections, MoE expert activations, ...); time: one more
    forward per layer.
    """

    longstraw_base: type = object
    #: index of this decoder layer (set by `prepare`)
    longstraw_index: int = -1

    def __call__(self, *args, **kwargs):
        cache = active_cache()
        if cache is None:
            return super().__call__(*args, **kwargs)
        one = getattr(cache, "one_layer", None)
        if one is None:
            return self._longstraw_call(cache, args, kwargs)
        # a forward that runs one layer (`longstraw.hf.decoder.run_layer`): the others hand their input on
        hidden = args[0] if args else kwargs["hidden_states"]
        if self.longstraw_index != one.index:
            return hidden
        if one.hidden is not None:
            if args:
                args = (one.hidden, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": one.hidden}
        one.output = self._longstraw_call(cache, args, kwargs)
        return one.output

    def _longstraw_call(self, cache, args, kwargs):
        hf = getattr(self, "gradient_checkpointing", False)
        if not hf and not cache.checkpoint_layers:  # the common case (decode steps): nothing to arrange
            return nn.Module.__call__(self, *args, **kwargs)
        with _hf_checkpointing_off(self):
            if torch.is_grad_enabled() and (cache.checkpoint_layers or (hf and self.training)):
                return self._longstraw_checkpointed(cache, args, kwargs)
            return nn.Module.__call__(self, *args, **kwargs)

    def forward(self, *args, **kwargs):
        cache = active_cache()
        chunks = getattr(cache, "layer_chunks", None) if cache is not None else None
        if chunks is not None and self.longstraw_index in chunks[1]:
            out = _forward_in_chunks(super().forward, chunks[0], cache, args, kwargs)
            if out is not None:
                return out
        return super().forward(*args, **kwargs)

    def _longstraw_checkpointed(self, cache, args, kwargs):
        i = self.longstraw_index
        before = snapshot(cache.layers[i])

        @contextmanager
        def recompute():
            after = cache.layers[i]
            cache.layers[i] = snapshot(before)
            try:
                with running(cache, cache.configs), _hf_checkpointing_off(self):
                    yield
            finally:
                cache.layers[i] = after

        return checkpoint(
            partial(nn.Module.__call__, self),
            *args,
            use_reentrant=False,
            context_fn=lambda: (nullcontext(), recompute()),
            **kwargs,
        )


#: the per-position keyword arguments of a decoder layer that `_forward_in_chunks` slices
_PER_POSITION = ("position_embeddings", "position_ids", "cache_position", "attention_mask")


class _NotPerPosition(Exception):
    """An argument holds the forward's positions in a way `_forward_in_chunks` does not slice."""


def _positions(x, a: int, b: int, t: int):
    """Positions [a, b) of `x`, a per-position argument of a `t`-position forward: `[B, t, ...]` (sliced on dim 1),
    `[t]`, a tuple / list of those (RoPE's cos, sin), None, or a non-tensor."""
    if isinstance(x, (tuple, list)):
        return type(x)(_positions(v, a, b, t) for v in x)
    if not isinstance(x, torch.Tensor):
        return x
    if x.dim() >= 2 and x.shape[1] == t:
        return x[:, a:b]
    if x.dim() == 1 and x.shape[0] == t:
        return x[a:b]
    raise _NotPerPosition


def _forward_in_chunks(forward, size: int, cache, args, kwargs):
    """`forward(*args, **kwargs)` of a decoder layer whose state is recurrent (no position attends to another rank's
    positions: its only input from before is the state in `cache`), run on `size` positions at a time: the same
    result, with the layer's intermediates (gated DeltaNet's chunked recurrence in transformers' torch path: ~470 KB
    per position at Qwen3.5-27B's width) held for `size` positions instead of all. Returns None, and nothing runs,
    when an argument holds the positions in a way this does not slice (a 4-D attention mask, say)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[1] <= size:
        return None
    t = hidden.shape[1]
    rest = dict(kwargs)
    rest.pop("hidden_states", None)
    others = [v for k, v in rest.items() if k not in _PER_POSITION and isinstance(v, torch.Tensor) and t in v.shape]
    if others or len(args) > 1:
        return None
    try:
        pieces = [
            (
                a,
                min(a + size, t),
                {k: _positions(v, a, min(a + size, t), t) if k in _PER_POSITION else v for k, v in rest.items()},
            )
            for a in range(0, t, size)
        ]
    except _NotPerPosition:
        return None
    start, outs, out = cache.past_length, [], None
    try:
        for a, b, kw in pieces:
            cache.past_length = start + a
            out = forward(hidden[:, a:b], **kw)
            outs.append(out[0] if isinstance(out, tuple) else out)
    finally:
        cache.past_length = start
    joined = torch.cat(outs, dim=1)
    return (joined, *out[1:]) if isinstance(out, tuple) else joined


class ChunkedFeedForward:
    """Mixin in front of a decoder layer's feed-forward class (`block.mlp`: dense MLP or a mixture of experts
    routing each position on its own): when the active cache asks for it (`BranchCache.ffn_chunk`, set by the
    context-parallel capture, whose attention layers run a rank's whole slice at once), the module runs on that many
    positions at a time. Same result (a position-wise function), with the gate / up intermediates of a chunk
    instead of the slice's. Its output: a tensor of the input's shape, or a tuple of that and per-position tensors
    (`[B·T, ...]`, e.g. gpt-oss's router scores) joined on their position dimension; another output runs the module
    whole (and is remembered as such)."""

    longstraw_base: type = object
    #: False once a forward showed that this class's output cannot be joined chunk by chunk
    longstraw_chunkable: bool = True

    def forward(self, *args, **kwargs):
        cache = active_cache()
        size = getattr(cache, "ffn_chunk", None) if cache is not None else None
        calls = getattr(cache, "ffn_calls", None) if cache is not None else None
        x = args[0] if len(args) == 1 and not kwargs else None
        if (
            size is None
            or not type(self).longstraw_chunkable
            or not isinstance(x, torch.Tensor)
            or x.dim() != 3
            or (x.shape[1] <= size and calls is None)
        ):
            return super().forward(*args, **kwargs)
        outs = []
        starts = list(range(0, x.shape[1], size))
        if calls is not None:  # an agreed number of calls (collective MoE calls): the last ones empty
            starts += [x.shape[1]] * (calls - len(starts))
        for a in starts:
            piece = x[:, a : a + size]
            out = super().forward(piece)
            parts = out if isinstance(out, tuple) else (out,)
            rows = piece.shape[0] * piece.shape[1]
            dims = [
                1
                if k == 0 and isinstance(t, torch.Tensor) and t.shape == piece.shape
                else 0
                if k > 0 and isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows
                else None
                for k, t in enumerate(parts)
            ]
            if None in dims:
                type(self).longstraw_chunkable = False
                return super().forward(*args, **kwargs)
            outs.append(parts)
        joined = tuple(torch.cat([o[k] for o in outs], dim=d) for k, d in enumerate(dims))
        return joined if isinstance(out, tuple) else joined[0]


def is_prepared(model) -> bool:
    return getattr(base_model(model), "_longstraw_prepared", False)


def prepare(model: nn.Module) -> nn.Module:
    """Install what longstraw needs in `model` (a transformers causal LM, optionally PEFT-wrapped), once.

    Raises `UnsupportedArchitectureError` naming the layer type or class longstraw cannot represent, before
    changing anything. Returns `model`.
    """
    base = base_model(model)
    if getattr(base, "_longstraw_prepared", False):
        return model
    cfg = check_capability(model)
    configs = model_configs(base)
    before = [c._attn_implementation_internal for c in configs]
    if ATTN_IMPLEMENTATION in before:
        raise UnsupportedArchitectureError(
            "the model's attention implementation is 'longstraw' outside a longstraw "
            "forward; load it with its own implementation (sdpa or eager)"
        )
    try:
        base.set_attn_implementation(ATTN_IMPLEMENTATION)
        refused = [type(c).__name__ for c in configs if c._attn_implementation != ATTN_IMPLEMENTATION]
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation_internal = name
    if refused:
        raise UnsupportedArchitectureError(
            f"transformers did not switch {', '.join(refused)} to longstraw's attention implementation"
        )
    decoder = decoder_of(base)
    fam = family(cfg.model_type)
    layers = cast(nn.ModuleList, decoder.layers)
    for i, (kind, block) in enumerate(zip(model_plan(model), layers)):
        install(block, CheckpointedLayer)
        cast(Any, block).longstraw_index = i  # a plain attribute on the module (CheckpointedLayer reads it)
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, nn.Module):  # (a module shared by layers: once)
            install(mlp, ChunkedFeedForward)
        layer_kind(kind).install(block, fam)  # the kind's stand-ins (MLA, DeepSeek-V4 compressed attention)
        for name, mixin in (fam.stand_ins if fam is not None else {}).items():  # the family's (Jamba's Mamba mixer)
            module = getattr(block, name, None)
            if isinstance(module, nn.Module):
                install(module, mixin)
    cast(Any, base)._longstraw_prepared = True  # a plain attribute on the module, not a submodule
    return model


def unprepare(model: nn.Module) -> nn.Module:
    """Undo `prepare`: the model's own classes and attention implementation. Returns `model`."""
    base = base_model(model)
    if not getattr(base, "_longstraw_prepared", False):
        return model
    for module in base.modules():
        original = getattr(type(module), "longstraw_base", None)
        if original is not None and is_stand_in(type(module)):
            module.__class__ = original
            for name in ("longstraw_index", "longstraw_rotary"):
                module.__dict__.pop(name, None)
    del base._longstraw_prepared
    return model
