"""GLM-4.5 (MoE, partial rotary) and GLM-5 (MLA with DSA and shared-index layers)."""

from .base import Family, cos_sin_rotary, register
from .mla import DSA, MLA


def _dsa_rotary(module):
    rotary = cos_sin_rotary("apply_rotary_pos_emb_interleave")(module)
    return rotary, rotary


register(
    Family(
        "glm4_moe",
        "full attention, partial rotary, QK-norm, MoE",
        moe=True,
        tiny=dict(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
        ),
    ),
    Family(
        "glm_moe_dsa",
        "MLA with DSA and shared-index layers, MoE",
        latent_rotary=_dsa_rotary,
        tiny=dict(
            MLA,
            **DSA,
            num_hidden_layers=3,
            mlp_layer_types=["dense", "sparse", "sparse"],
            indexer_types=["full", "shared", "full"],
            n_group=1,
            topk_group=1,
        ),
    ),
)
