"""What a run records of itself (`config.yaml`'s `record:`), and what resuming or evaluating it checks against that.

`config.yaml` holds the run's `TrainConfig` fields and, under `record:`, what they cannot say:

    record:
      data: {source: data/train.jsonl, rows: 1200, sha256: 3f0c...}     # or "a datasets.Dataset passed to the trainer"
      eval_data: {source: ..., rows: ..., sha256: ...}                    # an eval_dataset, when one was given
      reward_funcs: [mypkg.rewards:score, a callable defined in the calling script (reward_len)]
      prompt_tokens: {min: 1480, median: 1532, max: 1611}
      model: {source: path/to/model, sha256: 9a1e...}
      trl_config: {learning_rate: 1.0e-05, max_steps: 100, ...}           # GRPOTrainer: the fields off their defaults

- the data's `sha256` is over the rows as parsed, each as canonical JSON (keys sorted, no spaces, one row a line) of
  the row's prompt under `prompt` (its chat, for a chat row) and its other columns: the same rows give the same
  fingerprint whether they came as JSONL, parquet or a `datasets.Dataset`;
- a reward function passed as a callable is recorded by its import path `module:qualname` (which `reward_funcs` then
  holds, so that `longstraw eval` calls it again), or as "a callable defined in the calling script" (`__main__`) or
  "a callable with no import path" (a lambda, a local function);
- the model's `sha256` covers its `config.json` and, for each weights file, its name, size and first and last MiB
  (a 16 GB model is not read whole at every start); a built-in tiny model is its name.

Resuming refuses data, a model or `model_overrides` that differ from the record unless `force_resume: true`, and a
run whose schedule is over says so (`resume_problem`, `schedule_over`); `longstraw eval RUN` evaluates the recorded
data with the recorded rewards, or refuses naming the flag that supplies what the record cannot (`eval_refusal`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..tasks import Example

IN_SCRIPT = "a callable defined in the calling script"
NO_PATH = "a callable with no import path"
#: the sources of rows handed to the trainer in memory (no file to read them again from)
IN_MEMORY = ("a datasets.Dataset passed to the trainer", "a list of rows passed to the trainer")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MIB = 1 << 20


def canonical_row(ex: Example) -> str:
    """A row as canonical JSON: its prompt (text, or its chat) under `prompt`, its other columns, keys sorted."""
    row = {"prompt": ex.messages if ex.messages is not None else ex.prompt, **ex.reward_columns()}
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def rows_fingerprint(rows: Sequence[Example]) -> str:
    """SHA-256 of the rows' canonical JSON (`canonical_row`), one row a line."""
    h = hashlib.sha256()
    for ex in rows:
        h.update(canonical_row(ex).encode())
        h.update(b"\n")
    return h.hexdigest()


def data_record(source: str, rows: Sequence[Example]) -> dict:
    return {"source": source, "rows": len(rows), "sha256": rows_fingerprint(rows)}


def callable_path(fn: Callable) -> str | None:
    """`module:qualname` of a function importable by that name (and found there), else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is fn else None


def describe_reward(entry) -> str:
    """A reward function as the record names it: a config entry as it is, a callable by its import path or as a
    callable without one."""
    if not callable(entry):
        return str(entry)
    path = callable_path(entry)
    if path is not None:
        return path
    name = getattr(entry, "__qualname__", None) or getattr(entry, "__name__", None) or type(entry).__name__
    where = IN_SCRIPT if getattr(entry, "__module__", None) == "__main__" else NO_PATH
    return f"{where} ({name})"


def importable(description: str) -> bool:
    """Whether a recorded reward function can be called again from its record."""
    return not description.startswith((IN_SCRIPT, NO_PATH))


def model_fingerprint(model: str) -> str:
    """A model folder's fingerprint (module doc), or `built-in NAME` for a built-in tiny model."""
    path = Path(model)
    if not path.is_dir():
        return f"built-in {model}"
    h = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = f.stat().st_size
        h.update(f"\0{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_MIB))
            fh.seek(max(size - _MIB, 0))
            h.update(fh.read(_MIB))
    return h.hexdigest()


def _plain(value):
    """`value` as YAML's safe dumper takes it (enums by value, other objects as text)."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    return str(value)


def non_default_fields(config) -> dict:
    """The dataclass fields of `config` (a `GRPOConfig`, a `trl.GRPOConfig`) off their declared defaults."""
    out = {}
    for f in dataclasses.fields(config):
        if f.name.startswith("_") or not hasattr(config, f.name):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(config, f.name)
        if value != default:
            out[f.name] = _plain(value)
    return out


def resume_problem(old: dict, new: dict, old_overrides, new_overrides) -> str | None:
    """Why the recorded run (`old`: its record) is not the one being resumed (`new`), or None. Compared: the data's
    and held-out data's fingerprints, the model's, `model_overrides`."""
    for key, what in (("data", "data"), ("eval_data", "held-out data")):
        a, b = old.get(key), new.get(key)
        if a is not None and b is not None and a.get("sha256") != b.get("sha256"):
            return (
                f"its {what} was {a['source']} ({a['rows']} rows, sha256 {a['sha256'][:12]}), this run's is "
                f"{b['source']} ({b['rows']} rows, sha256 {b['sha256'][:12]})"
            )
    a, b = old.get("model"), new.get("model")
    if a is not None and b is not None and a.get("sha256") != b.get("sha256"):
        return (
            f"its model was {a['source']} (sha256 {a['sha256'][:12]}), this run's is {b['source']} "
            f"(sha256 {b['sha256'][:12]})"
        )
    if (old_overrides or {}) != (new_overrides or {}):
        return f"its model_overrides were {old_overrides or {}}, this run's are {new_overrides or {}}"
    return None


def schedule_over(old_cfg: dict, step: int) -> bool:
    """Whether the recorded run's learning-rate schedule (`old_cfg`: its config fields) had decayed to 0 by `step`:
    a linear or cosine schedule past its `num_steps`."""
    return old_cfg.get("lr_scheduler") in ("linear", "cosine") and step >= int(old_cfg.get("num_steps", step + 1))


def eval_refusal(run: Path, record: dict, dataset: str | None, rewards: list[str] | None) -> str | None:
    """Why `longstraw eval RUN` cannot evaluate what the run trained on with the flags given, naming the flag that
    supplies it; None when it can."""
    data = record.get("data") or {}
    if data.get("source") in IN_MEMORY and dataset is None:
        return (
            f"{run} trained on {data['source']} ({data['rows']} rows, sha256 {data['sha256'][:12]}): pass "
            "--dataset FILE holding those rows"
        )
    funcs = list(record.get("reward_funcs") or [])
    if rewards is None and not all(importable(f) for f in funcs):
        bad = [f for f in funcs if not importable(f)]
        return (
            f"{run} trained with reward functions it cannot call again ({'; '.join(bad)}): pass --reward "
            f"module:function (or path/to/file.py:function) for each of its {len(funcs)} reward functions, in order"
        )
    if rewards is not None and funcs and len(rewards) != len(funcs):
        return f"{run} trained with {len(funcs)} reward functions ({', '.join(funcs)}): pass --reward once for each"
    return None
