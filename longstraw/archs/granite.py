"""Granite and GraniteMoE: embedding, residual, attention and logit multipliers (`logits_scaling` divides)."""

from .base import Family, register

_SCALES = dict(logits_scaling=2.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2)

register(
    Family("granite", "dense, full attention, scaled embeddings / residuals / logits", tiny=_SCALES),
    Family("granitemoe", "full attention, MoE, scaled logits", moe=True, tiny=dict(_SCALES, intermediate_size=32)),
)
