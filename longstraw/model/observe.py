"""What each layer's attention module passes to transformers' attention interface, observed in one short forward.

A config says what a model *might* do; the attention module's call says what it does. Converted and merged
checkpoints carry fields their architecture never reads (a `sliding_window` on a Llama, whose attention ignores
it), so a layer's window read from the config can be wrong where the call is not; and some models apply their
window only through the mask they build (Phi-3.5-MoE in transformers 5.24 passes no `sliding_window`).
`observe_attention(model)` runs the unmodified model once, under no_grad, with a recording attention implementation
(`longstraw_probe`, registered through transformers' `AttentionInterface` and `AttentionMaskInterface`: it records
the call's keyword arguments and the mask it was given, and returns zeros of the output's shape, computing no
attention), and returns per decoder layer what its attention module was handed: the `sliding_window` argument, the
window or attention chunk its mask shows, `scaling`, `softcap`, whether it passed attention sinks (`s_aux`), and any
other argument that is set. `longstraw.model.capability.layer_plan` reconciles the config's layer plan with it.

The probe is 2 tokens longer than the longest window or attention chunk the config declares (at least 8 tokens, at
most `MAX_PROBE`), so a window in the mask shows; its cost is one forward of that many tokens without attention,
once per model configuration (cached on the model, keyed by its attention implementation).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import cast

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..hf.parts import attention_module, base_model, decoder_of, model_configs, model_device

PROBE_IMPLEMENTATION = "longstraw_probe"
#: shortest probe forward
PROBE_TOKENS = 8
#: longest probe forward: a declared window or chunk beyond it is read from the call's argument only
MAX_PROBE = 16386

#: arguments a call may carry without changing the math (`longstraw.hf.cache` reads the others it implements)
_READ = ("sliding_window", "scaling", "softcap", "s_aux", "dropout")


@dataclass(frozen=True)
class AttentionCall:
    """What one attention module passed to the attention interface."""

    sliding_window: int | None
    scaling: float | None
    softcap: float | None
    sinks: bool
    #: other keyword arguments that were set (not None), by name
    others: tuple[str, ...] = ()
    #: what the mask shows: "causal" (every earlier key), "window" (the last `mask_span` keys), "chunk" (keys of
    #: the query's own `mask_span`-token chunk), "other" (none of these), or None (no mask was passed)
    mask: str | None = None
    mask_span: int | None = None


def mask_pattern(mask: torch.Tensor | None) -> tuple[str | None, int | None]:
    """(pattern, span) of a probe's attention mask `[B, 1, Q, K]` (bool: True attends; float: 0 attends) over Q
    consecutive queries that end at the last key (see `AttentionCall.mask`)."""
    if mask is None or not torch.is_tensor(mask) or mask.dim() != 4:
        return None, None
    m = mask[0, 0]
    visible = m if m.dtype == torch.bool else m == 0
    q, k = visible.shape
    pos = torch.arange(k - q, k, device=visible.device)
    counts = visible.sum(-1)
    seen = [int(c) for c in counts.tolist()]
    full = [int(p) + 1 for p in pos.tolist()]
    if seen == full:
        return "causal", None
    span = max(seen)
    if seen == [min(f, span) for f in full]:
        return "window", span
    for size in sorted(set(seen)):
        if seen == [int(p) % size + 1 for p in pos.tolist()]:
            return "chunk", size
    return "other", None


_calls: contextvars.ContextVar[dict | None] = contextvars.ContextVar("longstraw_probe_calls", default=None)


def _record(module, query, key, value, attention_mask, **kwargs):
    calls = _calls.get()
    if calls is None:
        raise RuntimeError("the 'longstraw_probe' attention implementation only runs inside observe_attention")
    window = kwargs.get("sliding_window")
    scaling, softcap = kwargs.get("scaling"), kwargs.get("softcap")
    pattern, span = mask_pattern(attention_mask)
    calls[id(module)] = AttentionCall(
        None if window is None else int(window),
        None if scaling is None else float(scaling),
        None if softcap is None else float(softcap),
        kwargs.get("s_aux") is not None,
        tuple(sorted(k for k, v in kwargs.items() if k not in _READ and v is not None and not isinstance(v, bool))),
        pattern,
        span,
    )
    b, _, r, _ = query.shape
    return query.new_zeros(b, r, query.shape[1], value.shape[-1]), None


def _probe_mask(*args, **kwargs):
    """sdpa's boolean mask, always built (never skipped for a plain causal mask): the probe reads it, and DSA's
    indexer needs one (transformers 5.24 `masking_utils.sdpa_mask`)."""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


AttentionInterface.register(PROBE_IMPLEMENTATION, _record)
AttentionMaskInterface.register(PROBE_IMPLEMENTATION, _probe_mask)


def observe_attention(model) -> dict[int, AttentionCall]:
    """Decoder layer index → what its attention module passed in one short forward of `model` (layers whose mixer
    does not call the attention interface — linear attention, SSMs — are absent). Cached on the model."""

    base = base_model(model)
    configs = model_configs(base)
    key = tuple(c._attn_implementation for c in configs)
    cached = base.__dict__.get("_longstraw_observed")
    if cached is not None and cached[0] == key:
        return cached[1]

    device = model_device(base)  # a clear error for a model on the meta device or split over several
    decoder = decoder_of(base)
    cfg = base.config.get_text_config()
    declared = max([int(getattr(cfg, name, 0) or 0) for name in ("sliding_window", "attention_chunk_size")] + [0])
    length = max(PROBE_TOKENS, min(declared + 2, MAX_PROBE))
    calls: dict = {}
    token = _calls.set(calls)
    before = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = PROBE_IMPLEMENTATION
    training = base.training
    try:
        base.eval()
        ids = torch.arange(length, device=device)[None] % max(2, cfg.vocab_size)
        with torch.no_grad():
            decoder(input_ids=ids, use_cache=False)
    finally:
        for c, name in zip(configs, before):
            c._attn_implementation_internal = name
        _calls.reset(token)
        base.train(training)
    seen = {}
    for i, block in enumerate(cast(torch.nn.ModuleList, decoder.layers)):  # the decoder's blocks
        module = attention_module(block)
        if module is not None and id(module) in calls:
            seen[i] = calls[id(module)]
    base.__dict__["_longstraw_observed"] = (key, seen)
    return seen
