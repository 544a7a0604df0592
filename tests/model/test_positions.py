"""Prompt lengths against the model's position settings: `plan` and `check` say when P goes past them, and a local
model takes RoPE scaling from `model_overrides`."""

import pytest
from transformers import AutoConfig

from longstraw.testing.models import tiny_model
from longstraw.tools.planner import PlanConfig, plan
from longstraw.model.positions import coverage, position_note
from longstraw.train.config import TrainConfig

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": 100000.0}


def _llama(**kw):
    return AutoConfig.for_model("llama", max_position_embeddings=8192, **kw)


def test_a_prompt_past_the_pretrained_positions_is_named():
    cfg = _llama()
    assert coverage(cfg).native == coverage(cfg).covered == 8192
    assert position_note(cfg, 8192) is None
    note = position_note(cfg, 131072)
    assert "16.0×" in note and "factor: 16" in note and "max_position_embeddings: 131072" in note


def test_rope_scaling_covers_what_its_factor_says():
    cfg = _llama(rope_parameters=YARN)
    c = coverage(cfg)
    assert (c.native, c.covered, c.rope_type, c.factor) == (8192, 32768, "yarn", 4.0)
    assert "served by its RoPE scaling (yarn, factor 4" in position_note(cfg, 20000)
    assert "never learned" in position_note(cfg, 40000)


def test_plan_notes_the_positions(tmp_path):
    _llama(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path)
    assert any("16.0×" in n for n in plan(PlanConfig(str(tmp_path), 131072)).notes)
    assert not any("positions" in n for n in plan(PlanConfig(str(tmp_path), 4096)).notes)


def test_a_local_model_takes_rope_scaling_from_model_overrides(tmp_path):
    from longstraw.tasks import build_tokenizer
    from longstraw.train.trainer import build_model_and_tokenizer

    tiny_model("llama").save_pretrained(tmp_path)
    build_tokenizer(num_keys=8, num_values=4).save_pretrained(tmp_path)
    model, _ = build_model_and_tokenizer(TrainConfig(model=str(tmp_path), lora=False, model_overrides=dict(
        rope_parameters=YARN, max_position_embeddings=32768)))
    assert model.model.rotary_emb.rope_type == "yarn" and model.config.max_position_embeddings == 32768
    with pytest.raises(ValueError, match=r"model_overrides \['sliding_windw'\]: not fields"):
        build_model_and_tokenizer(TrainConfig(model=str(tmp_path), lora=False, model_overrides={"sliding_windw": 7}))
