"""Config fields as command-line flags: every `TrainConfig` field is a flag of `longstraw train` and `longstraw demo`
(`add_config_flags`), read back as the field's type (`parse_value`, `config_overrides`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, cast

import yaml

from ..train.config import TrainConfig


def parse_value(field: dataclasses.Field, text: str):
    """A command-line string as the field's type (YAML syntax for lists and dicts)."""
    kind = str(field.type)
    if text.lower() in ("none", "null") and "None" in kind:
        return None
    if kind.startswith("bool"):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{field.name}: expected true or false, got {text!r}")
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    if kind.startswith(("list", "dict")) or ("list" in kind and text.lstrip().startswith("[")):
        value = yaml.safe_load(text)
        expected = dict if kind.startswith("dict") else list
        if not isinstance(value, expected):
            raise ValueError(f"--{field.name}: expected a YAML {expected.__name__}, got {text!r}")
        return value
    return text


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("config fields (override the file; lists and dicts in YAML syntax)")
    for f in dataclasses.fields(TrainConfig):
        # every field has a default or a default factory (`longstraw.train.config._f`)
        default = f.default if f.default is not dataclasses.MISSING else cast(Callable[[], Any], f.default_factory)()
        group.add_argument(
            f"--{f.name}",
            metavar=str(f.type).replace(" ", ""),
            default=argparse.SUPPRESS,
            help=f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%"),
        )


def config_overrides(args) -> dict:
    out = {}
    for f in dataclasses.fields(TrainConfig):
        if hasattr(args, f.name):
            out[f.name] = parse_value(f, getattr(args, f.name))
    return out
