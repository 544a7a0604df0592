"""The `Family` spec and its registry."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import CONFIG_MAPPING
from transformers.utils import logging

#: Fields of every tiny config (only those the family's config class knows are passed, see `tiny_fields`).
TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
)

#: Mixture-of-experts fields under the names the MoE families use (4 experts, 2 per token, width 32).
TINY_MOE = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

#: A rotary function of an MLA module: (q_rot, k_rot, position_embeddings, **kw) → (q_rot, k_rot).
Rotary = Callable[..., tuple]


@dataclass(frozen=True)
class Family:
    """What longstraw knows about one transformers `model_type` (of the text config).

    `layers`: what its decoder layers are (the table in docs/models.md). `tiny`: config fields of the tiny random
    model the tests build (over `TINY_COMMON`/`TINY_MOE`, which apply where the config class has the
    field). `layer_kinds`: transformers layer type → longstraw layer kind, where they differ.
    `latent_rotary(module)`: for MLA families, the rotary functions of the attention and of the DSA
    indexer (None: no rotation). `attn_implementation`: what the tiny model is built with (families
    without an SDPA path use "eager"). `wrapper`: a multimodal model_type served through this text
    model, with the fields that complete its tiny config. `stand_ins`: decoder-layer attribute → mixin installed in
    front of that module's class where a layer has it (`longstraw.hf.stand_ins`), for a family whose own module
    needs one inside longstraw (Jamba's Mamba mixer).
    """

    model_type: str
    layers: str
    tiny: dict = field(default_factory=dict)
    layer_kinds: dict = field(default_factory=dict)
    latent_rotary: Callable[[object], tuple[Rotary | None, Rotary | None]] | None = None
    attn_implementation: str = "sdpa"
    moe: bool = False
    wrapper: tuple[str, dict] | None = None
    stand_ins: dict[str, type] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {}


def register(*families: Family) -> None:
    for fam in families:
        if fam.model_type in FAMILIES:
            raise ValueError(f"family {fam.model_type!r} registered twice")
        FAMILIES[fam.model_type] = fam


def family(model_type: str) -> Family | None:
    return FAMILIES.get(model_type)


def _has(cfg, name: str) -> bool:
    try:
        return hasattr(cfg, name)
    except Exception:  # noqa: BLE001 - per-layer attributes (Gemma 4) raise on global access: they exist
        return True


def tiny_fields(fam: Family) -> dict:
    """Config fields of `fam`'s tiny model: the common ones its config class knows, then its own."""
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the default config's full-size token ids may not fit its vocabulary: noise here
    try:
        defaults = CONFIG_MAPPING[fam.model_type]()
    finally:
        logging.set_verbosity(verbosity)
    common = {**TINY_COMMON, **(TINY_MOE if fam.moe else {})}
    known = {k: v for k, v in common.items() if _has(defaults, k) or k in ("head_dim",)}
    fields = {**known, **fam.tiny}
    vocab = fields["vocab_size"]
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # defaults outside the tiny vocabulary
        value = getattr(defaults, name, None) if _has(defaults, name) else None
        if name not in fields and isinstance(value, int) and value >= vocab:
            fields[name] = None
    return fields


# ------------------------------------------------------------------------------------- rotary helpers


def _modeling_function(module, name: str):
    """A function of the modeling module that defines `module`'s class (transformers 5.24 names)."""
    return getattr(sys.modules[type(module).__module__], name)


def cos_sin_rotary(name: str | None):
    """A rotary of the form `fn(q, k, cos, sin, **kw)` reading `position_embeddings = (cos, sin)`."""
    if name is None:
        return lambda module: None

    def resolve(module):
        fn = _modeling_function(module, name)
        return lambda q, k, pe, **kw: fn(q, k, *pe, **kw)

    return resolve


def complex_rotary(name: str):
    """A rotary of the form `fn(q, k, freqs_cis)` reading complex `position_embeddings` (DeepSeek-V2)."""

    def resolve(module):
        fn = _modeling_function(module, name)
        return lambda q, k, pe, **kw: fn(q, k, pe.to(q.device))

    return resolve
