"""The planner's per-kind terms come from the kinds' classes (`LayerState` attributes), not from kind names."""

import ast
from pathlib import Path

import pytest

import longstraw
from longstraw.kinds import layer_kind, registered_layer_types
from longstraw.model.capability import layer_plan
from longstraw.model.chunking import GROWING_KINDS, OWN_KV_KINDS, chunk_bytes_per_token
from longstraw.testing.models import tiny_config

ROOT = Path(longstraw.__file__).parent


@pytest.mark.parametrize("module", ["model/chunking.py", "tools/planner.py"])
def test_planner_dispatch_names_no_kind(module):
    """Adding a layer kind touches its module in `longstraw/kinds/`, not the planner's dispatch."""
    names = registered_layer_types()
    tree = ast.parse((ROOT / module).read_text())
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in names}
    assert not named, f"{module} names layer kinds {sorted(named)}"


def test_kind_tuples_follow_the_attributes():
    assert set(GROWING_KINDS) == {"full_attention", "latent_attention", "indexed_attention"}
    assert set(OWN_KV_KINDS) == set(GROWING_KINDS) | {"sliding_attention", "chunked_attention"}
    assert all(layer_kind(k).grows_with_prompt for k in GROWING_KINDS)


def test_per_kind_chunk_terms():
    """The calibrated per-kind extras, as they were before they moved into the kinds: MLA × 5, DSA × 3 (MLA wins in
    a mix), gated DeltaNet's recurrence; none for unregistered or plain kinds."""
    for family, factor in (("deepseek_v3", 5), ("deepseek_v32", 3)):
        cfg = tiny_config(family)
        base = chunk_bytes_per_token(cfg, ["mlp"], 2)[1]
        extra = 2 * cfg.num_attention_heads * factor * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert chunk_bytes_per_token(cfg, layer_plan(cfg), 2)[1] == base + extra
    cfg = tiny_config("deepseek_v32")
    mixed = chunk_bytes_per_token(cfg, ["indexed_attention", "latent_attention", "no_such_kind"], 2)[1]
    assert mixed == chunk_bytes_per_token(cfg, ["latent_attention"], 2)[1]
    cfg = tiny_config("qwen3_next")
    want = 2 * 4 * cfg.linear_num_value_heads * (3 * 64 + 4 * (cfg.linear_key_head_dim + cfg.linear_value_head_dim))
    assert chunk_bytes_per_token(cfg, layer_plan(cfg), 4)[3] == want
    assert chunk_bytes_per_token(cfg, ["full_attention", "conv"], 4)[3] == 0
