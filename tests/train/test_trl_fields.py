"""Every field of TRL's `GRPOConfig` is mapped, refused by name when set off its default, or moot (documented in
docs/training.md, "TRL's fields"): a walk over `dataclasses.fields(trl.GRPOConfig)` sets each to a value no default
equals, so that no field, now or in a later TRL, goes unclassified."""

import copy
import dataclasses
import re
from pathlib import Path

import pytest

from longstraw import GRPOConfig
from longstraw.train.trl_shape import MOOT

trl = pytest.importorskip("trl")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


class _Set:
    """A value no default equals."""

    def __eq__(self, other):
        return isinstance(other, _Set)

    __hash__ = object.__hash__

    def __repr__(self):
        return "<set>"


def _default():
    return trl.GRPOConfig(output_dir="out", use_cpu=True, bf16=False, report_to="none")


def test_every_trl_field_is_mapped_refused_by_name_or_moot():
    base = _default()
    GRPOConfig.from_trl(base)  # TRL's defaults (and what its __post_init__ fills in) are read
    mapped = {f.name for f in dataclasses.fields(GRPOConfig)}
    refused, moot = [], []
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.name in mapped:
            continue
        args = copy.copy(base)
        setattr(args, f.name, _Set())
        if f.name in MOOT:
            GRPOConfig.from_trl(args)
            moot.append(f.name)
            continue
        with pytest.raises(ValueError) as err:
            GRPOConfig.from_trl(args)
        message = str(err.value)
        assert "\n" not in message and re.search(rf"\b{f.name}'?[=:]", message), (f.name, message)
        assert "not done by longstraw" in message, (f.name, message)
        refused.append(f.name)
    assert len(mapped & {f.name for f in dataclasses.fields(trl.GRPOConfig)}) + len(refused) + len(moot) == len(
        dataclasses.fields(trl.GRPOConfig)
    )
    assert {"push_to_hub", "save_total_limit", "optim", "eval_strategy", "lr_scheduler_kwargs",
            "chat_template_kwargs"} <= set(refused)
    assert {"logging_strategy", "dataloader_num_workers", "hub_model_id"} <= set(moot)


def test_the_moot_fields_are_documented():
    text = DOCS.read_text()
    missing = [name for name in MOOT if f"`{name}`" not in text]
    assert not missing, f"docs/training.md does not list {missing}"


def test_options_users_set_are_read_or_refused_as_trl_has_them():
    with pytest.raises(ValueError, match=r"trl\.GRPOConfig: save_total_limit=2, push_to_hub=True: not done by "
                                         r"longstraw .*; leave save_total_limit=None, push_to_hub=False$"):
        GRPOConfig.from_trl(trl.GRPOConfig(output_dir="out", use_cpu=True, bf16=False, push_to_hub=True,
                                           save_total_limit=2))
    # what longstraw does anyway, and logging cadence, are read
    cfg = GRPOConfig.from_trl(trl.GRPOConfig(output_dir="out", use_cpu=True, bf16=False, optim="adamw_torch",
                                             logging_steps=1, logging_first_step=True, dataloader_num_workers=2,
                                             gradient_checkpointing_kwargs={"use_reentrant": False}))
    assert cfg.logging_steps == 1
