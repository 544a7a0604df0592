"""The planner's verdict, on paper, for the two large configurations of the published system.

- a Qwen3.6-27B-class hybrid (qwen3_5_text layout: 64 layers, 3 gated-DeltaNet : 1 full attention, 4 KV
  heads of 256, hidden 5120, bf16) at P = 2,097,152 on 8 × 96 GB (context parallel 8, FSDP 8, LoRA r 16,
  G = 8 responses of 128 tokens);
- a 78-layer GLM-5-class MLA / DSA MoE (glm_moe_dsa layout: latent 512 + rotary 64, indexer keys 128,
  256 routed experts, hidden 6144, bf16) at P = 2,097,152 on 32 × 96 GB (context parallel 32, FSDP 32).

Config fields are the public shapes of these model classes as far as the planner needs them; no weights
are involved.

    python bench/plan_paper.py      # → bench/results/plan_paper.{json,md}
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import CONFIG_MAPPING

from longstraw.tools.planner import PlanConfig, plan

HERE = Path(__file__).resolve().parent

HYBRID = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256,
    layer_types=[t for _ in range(16) for t in ("linear_attention", "linear_attention", "linear_attention",
                                                "full_attention")],
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, max_position_embeddings=1 << 22)
GLM5 = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_hidden_layers=78, num_attention_heads=64,
    num_key_value_heads=64, head_dim=64, kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64,
    qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
    mlp_layer_types=["dense"] * 3 + ["sparse"] * 75, indexer_types=["full"] * 78, n_group=1, topk_group=1,
    max_position_embeddings=1 << 22)


def main() -> None:
    cases = [
        ("Qwen3.6-27B-class hybrid", CONFIG_MAPPING["qwen3_5_text"](**HYBRID), 8),
        ("GLM-5-class MLA / DSA MoE (78 layers)", CONFIG_MAPPING["glm_moe_dsa"](**GLM5), 32),
    ]
    rows, lines = [], ["| model | ranks | state dtype | durable state / rank | weights / rank | capture transient / rank "
                       "| predicted peak / rank | fits 96 GB |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for name, cfg, ranks in cases:
        for state_dtype in (None, "fp8"):
            p = plan(PlanConfig(cfg, 2_097_152, num_generations=8, completion_length=128, dtype="bf16",
                                state_dtype=state_dtype, lora_rank=16, chunk_size=4096, context_parallel=ranks,
                                fsdp=ranks, checkpoint_layers=True, device_memory_gib=96 * 1e9 / 2**30))
            rows.append(dict(model=name, ranks=ranks, state_dtype=state_dtype, **json.loads(p.to_json())))
            gb = 1e9
            lines.append(f"| {name} | {ranks} | {state_dtype or 'bf16'} | {p.durable_state / gb:.1f} GB | "
                         f"{p.weights / gb:.1f} GB | {p.capture_transient / gb:.1f} GB | {p.peak / gb:.1f} GB | "
                         f"{'yes' if p.fits else 'no'} |")
    out = HERE / "results" / "plan_paper"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
