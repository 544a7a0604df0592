"""DeepSeek-V2, V3 (MLA, MoE) and V3.2 (MLA with DeepSeek sparse attention)."""

from .base import Family, complex_rotary, cos_sin_rotary, register
from .mla import DSA, LATENT, MLA


def _v3_rotary(module):
    name = "apply_rotary_pos_emb_interleave" if module.config.rope_interleave else "apply_rotary_pos_emb"
    return cos_sin_rotary(name)(module), None


def _v32_rotary(module):
    return cos_sin_rotary("apply_rotary_pos_emb_interleave")(module), cos_sin_rotary("apply_rotary_pos_emb")(module)


_MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1)

register(
    # V2's rotary takes complex frequencies (`freqs_cis`) as its position embeddings
    Family(
        "deepseek_v2",
        "multi-head latent attention (MLA), MoE",
        layer_kinds=LATENT,
        latent_rotary=lambda m: (complex_rotary("apply_rotary_emb")(m), None),
        tiny=dict(MLA, **_MOE, topk_method="group_limited_greedy"),
    ),
    Family(
        "deepseek_v3",
        "multi-head latent attention (MLA), MoE",
        layer_kinds=LATENT,
        latent_rotary=_v3_rotary,
        tiny=dict(MLA, **_MOE),
    ),
    Family(
        "deepseek_v32",
        "MLA with DeepSeek sparse attention (DSA), MoE",
        latent_rotary=_v32_rotary,
        tiny=dict(MLA, **DSA, **_MOE),
    ),
)
