"""What prompt length a model's position settings cover (its RoPE and `max_position_embeddings`).

Long-context RL serves prompts longer than a model was pretrained on by scaling its rotary embedding (YaRN, linear,
dynamic NTK, Llama 3's, LongRoPE: transformers' `config.rope_parameters`); past what the settings cover, the model
sees positions it never learned and its outputs degrade without any error. `coverage(cfg)` reads the settings;
`position_note(cfg, P)` says, in a sentence, when P goes past them or relies on scaling — `longstraw plan` and
`longstraw check --P` print it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coverage:
    """A model's positions: `native` (pretrained, before any scaling), `covered` (with the scaling it is set to
    use), the rope type and scaling factor (1.0 without scaling). None fields: the config does not say."""

    native: int | None
    covered: int | None
    rope_type: str
    factor: float


def coverage(cfg) -> Coverage:
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = next(iter(rope.values()))  # per-layer-type parameters (Gemma 3): the first type's
    rope_type = str(rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else "default"
    factor = float(rope.get("factor") or 1.0) if isinstance(rope, dict) else 1.0
    max_pos = getattr(cfg, "max_position_embeddings", None)
    native = (rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None) or max_pos
    if rope_type == "default" or factor == 1.0:
        return Coverage(native, max_pos, rope_type, 1.0)
    covered = max(max_pos or 0, int(factor * native)) if native else max_pos
    return Coverage(native, covered, rope_type, factor)


def position_note(cfg, prompt_length: int) -> str | None:
    """None when `prompt_length` is within the model's pretrained positions; else what covers it, or a warning that
    nothing does and how to set RoPE scaling."""
    c = coverage(cfg)
    if c.native is None or prompt_length <= c.native:
        return None
    times = prompt_length / c.native
    if c.covered is not None and prompt_length <= c.covered and c.factor > 1.0:
        return (
            f"P = {prompt_length:,} is {times:.1f}× the model's pretrained {c.native:,} positions, served by its "
            f"RoPE scaling ({c.rope_type}, factor {c.factor:g}, covering {c.covered:,})"
        )
    need = 2 ** max(1, (prompt_length - 1) // c.native).bit_length()
    return (
        f"P = {prompt_length:,} is {times:.1f}× the {c.covered or c.native:,} positions the model's settings cover "
        f"(max_position_embeddings {c.native:,}, rope type {c.rope_type}): it would read positions it never "
        "learned. "
        f"Set RoPE scaling, e.g. model_overrides: {{rope_parameters: {{rope_type: yarn, factor: {need}, "
        f"original_max_position_embeddings: {c.native}, rope_theta: ...}}, max_position_embeddings: "
        f"{need * c.native}}}"
    )


def position_limit(cfg) -> int | None:
    """The positions the model reads (`max_position_embeddings` of its text config), or None: unbounded."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)


def check_positions(cfg, total: int, what: str = "prompt + response") -> None:
    """Refuse a sequence of `total` positions past the model's (`what` names it in the error)."""
    limit = position_limit(cfg)
    if limit is not None and total > limit:
        raise ValueError(
            f"{what} is {total} tokens but the model supports max_position_embeddings={limit}; "
            "use a model (or RoPE scaling) made for this length"
        )


def positions_left(cfg, length: int, max_new_tokens: int, what: str = "the trajectory") -> int:
    """`max_new_tokens` cut to the positions the model has left after `length`; ValueError when none are left."""
    limit = position_limit(cfg)
    if limit is None:
        return max_new_tokens
    if length >= limit:
        raise ValueError(
            f"{what} holds {length} positions, the model's limit (max_position_embeddings={limit}): nothing more can "
            "be sampled"
        )
    return min(max_new_tokens, limit - length)
