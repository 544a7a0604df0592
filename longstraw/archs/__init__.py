"""Tested model families: one small spec per family (`Family`), one module per family.

A family spec holds what longstraw knows about a transformers `model_type` beyond what its config
says: how its layer types map to longstraw layer kinds where the name alone does not say what the
layer keeps (MLA layers are called "full_attention"), the rotary function of its latent attention,
and a tiny random config that the tests build it from. Support itself is decided by capability
(`longstraw.model.capability`): a model whose family is not here is served when its layers map to layer kinds
and the self-check (`longstraw.check`) holds; the families here are the ones the test suite covers.

Adding a family: one module here that calls `register(Family(...))`, imported below (the tests build their list
of families from the registry), and its row in the table of docs/models.md; docs/extending.md has the rest.
"""

from __future__ import annotations

from . import (  # noqa: F401,E402  (each module registers its families)
    cohere,
    deepseek,
    deepseek_v4,
    gemma,
    glm,
    gpt_oss,
    granite,
    kimi,
    lfm,
    llama,
    mamba,
    minimax,
    mistral,
    olmo,
    phi,
    qwen,
    smollm,
    stablelm,
    starcoder,
)
from .base import FAMILIES, Family, family, register, tiny_fields

__all__ = ["FAMILIES", "Family", "family", "register", "tiny_fields"]
