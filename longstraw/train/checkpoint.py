"""Resumable checkpoints: written atomically, read without running any pickled code.

    checkpoints/
      latest                 the name of the newest complete checkpoint ("step-12")
      step-12/
        weights/             the trainable weights: a PEFT adapter folder, or model.safetensors
        optimizer.pt         optimizer and scheduler state, torch RNG state, float32 master weights of trainable
                             bf16 parameters (`longstraw.train.precision`): tensors and plain containers
        trainer_state.json   step, data position, Python RNG state, the run's config

A checkpoint is written into a temporary folder and renamed, then `latest` is replaced: an interrupted
write leaves the previous checkpoint intact. The last two are kept. `optimizer.pt` is read with
`torch.load(weights_only=True)`: a file holding anything but tensors and plain containers (a pickled
callable, say) is refused instead of executed.

On N processes rank 0 writes (the ranks hold the same weights, optimizer and RNG states; `trainer_state.json`
records `world_size`), and every rank loads the checkpoint rank 0 names (`latest_name`, then `load_checkpoint(...,
name=)`).

With the decoder layers sharded over the ranks (FSDP2, `fsdp: true`; `save_sharded_checkpoint`):

      step-12/
        weights/trainable.safetensors   every trainable parameter whole, by its name in the model (gathered)
        optimizer.pt                    scheduler, RNG, master weights of replicated bf16 parameters (rank 0's)
        optimizer-rank0.pt, ...         each rank's optimizer state: the moments of its shards (plain tensors)
        trainer_state.json              ... "fsdp": true, "world_size": N

Every rank writes its optimizer file into the temporary folder before rank 0 renames it, so a checkpoint is whole
or absent. It resumes on the same number of processes with `fsdp: true` (the optimizer's shards are per rank).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, load_model, save_file, save_model

from ..distributed.fsdp import sharded_optimizer_state

KEEP = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be read safely or completely."""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def save_weights(model, path: Path) -> None:
    """The trainable weights: an adapter folder (PEFT) or `model.safetensors` (full fine-tuning)."""
    if is_peft(model):
        model.save_pretrained(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        save_model(model, str(path / "model.safetensors"))  # shared (tied) tensors stored once


def load_weights(model, path: Path) -> None:
    if is_peft(model):
        set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    else:
        load_model(model, str(path / "model.safetensors"))


def save_checkpoint(root: Path, step: int, model, optimizer, scheduler, trainer_state: dict, masters=None) -> Path:
    """Write `root/step-{step}` atomically and point `latest` at it; keeps the last `KEEP` checkpoints.
    `masters`: the run's `MasterWeights`, whose float32 values the bf16 weights alone would round."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_weights(model, tmp / "weights")
    return _finish(root, tmp, final, step, {"optimizer": optimizer.state_dict()}, scheduler, trainer_state, masters)


def _finish(root: Path, tmp: Path, final: Path, step: int, blob: dict, scheduler, trainer_state: dict, masters) -> Path:
    """Write `optimizer.pt` (`blob` + scheduler, torch RNG, masters) and `trainer_state.json` (+ Python RNG) into
    `tmp`, rename it to `final`, point `latest` at it, keep the last `KEEP`."""
    blob = {**blob, "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()}
    if masters is not None and masters.pairs:
        blob["master_weights"] = masters.state()
    torch.save(blob, tmp / "optimizer.pt")
    version, internal, gauss = random.getstate()
    state = {"step": step, **trainer_state, "python_rng": [version, list(internal), gauss]}
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write(root / "latest", final.name)
    for old in sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _restore(blob: dict, state: dict, scheduler, masters) -> None:
    """The scheduler, RNGs and master weights from a checkpoint's `optimizer.pt` and trainer state."""
    if masters is not None:
        masters.load_state(blob.get("master_weights"))
    scheduler.load_state_dict(blob["scheduler"])
    torch.set_rng_state(blob["torch_rng"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))


def latest_name(root: Path) -> str | None:
    """The folder name of the newest complete checkpoint under `root` ("step-12"), or None."""
    latest = root / "latest"
    return latest.read_text().strip() if latest.exists() else None


def load_checkpoint(root: Path, model, optimizer, scheduler, masters=None, name: str | None = None) -> dict | None:
    """Restore the newest checkpoint under `root` (or `root/name`) into model, optimizer, scheduler, the RNGs and
    `masters` (`MasterWeights`; from the bf16 weights when the checkpoint holds none); returns its trainer state
    (`step`, ...), or None when there is none."""
    name = name or latest_name(root)
    if name is None:
        return None
    ckpt = root / name
    if not ckpt.is_dir():
        raise CheckpointError(
            f"checkpoint {ckpt} is not there (on N processes every rank reads rank 0's checkpoint: "
            "the output folder must be on a file system every rank sees)"
        )
    blob = _load_tensors(ckpt / "optimizer.pt")
    state = read_trainer_state(ckpt)
    if state.get("fsdp") or (state.get("expert_parallel") or 1) > 1:
        raise CheckpointError(
            f"checkpoint {ckpt} was written with {_spread_of(state)} (weights spread over "
            f"{state.get('world_size')} processes): resume it alike on as many"
        )
    load_weights(model, ckpt / "weights")
    optimizer.load_state_dict(blob["optimizer"])
    _restore(blob, state, scheduler, masters)
    return state


SHARDED_WEIGHTS = "trainable.safetensors"


def save_sharded_checkpoint(
    root: Path,
    step: int,
    ranks,
    weights: dict,
    optimizer_local: dict,
    scheduler,
    trainer_state: dict,
    masters=None,
    sharding: dict | None = None,
) -> Path | None:
    """Write `root/step-{step}` of a run whose weights are spread over the ranks (a collective of `ranks`): `weights`
    {name: whole tensor} (rank 0's is written), `optimizer_local` this rank's optimizer state with plain tensors
    (`longstraw.distributed.fsdp.local_optimizer_state`). `sharding`: how (recorded in the trainer state, and what
    `load_sharded_checkpoint` requires): `{"fsdp": True}` (the default: the decoder layers sharded) or
    `{"expert_parallel": N}` (the experts spread). Returns the folder on rank 0, None elsewhere."""
    sharding = {"fsdp": True} if sharding is None else sharding
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"

    def start():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    ranks.from_main("checkpoint: temporary folder", start)
    ranks.run_alike(
        "checkpoint: optimizer shards", lambda: torch.save(optimizer_local, tmp / f"optimizer-rank{ranks.rank}.pt")
    )

    def finish():
        (tmp / "weights").mkdir()
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "weights" / SHARDED_WEIGHTS))
        return _finish(
            root, tmp, final, step, {}, scheduler, {**trainer_state, **sharding, "world_size": ranks.size}, masters
        )

    final = ranks.from_main("checkpoint: write", finish)
    return final if ranks.main else None


class LazyTensors:
    """The tensors of a safetensors file by name, each read when asked for (a context manager): loading a sharded
    checkpoint holds one whole tensor at a time, not the whole model, on every rank."""

    def __init__(self, path: Path):
        file = safe_open(str(path), framework="pt")
        self._file: safe_open | None = file  # None once closed
        self._names = set(file.keys())

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __getitem__(self, name: str):
        assert self._file is not None  # read inside the `with` only
        return self._file.get_tensor(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file = None


def read_trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


def load_sharded_checkpoint(
    ckpt: Path, ranks, load_weights_fn, optimizer, scheduler, masters=None, sharding: dict | None = None
) -> dict:
    """Restore a checkpoint of `save_sharded_checkpoint` on this rank: `load_weights_fn({name: whole tensor})` puts
    the weights into the (sharded) model, this rank's optimizer file into `optimizer` (shards wrapped as the
    parameters' `DTensor`s again), the rest as `load_checkpoint`. `sharding`: as the run that wrote it (refused
    otherwise, as on another number of processes). Returns the trainer state."""
    sharding = {"fsdp": True} if sharding is None else sharding
    state = read_trainer_state(ckpt)
    written = {"fsdp": bool(state.get("fsdp")), "expert_parallel": state.get("expert_parallel") or 1}
    wanted = {"fsdp": False, "expert_parallel": 1, **sharding}
    if written != wanted or state.get("world_size") != ranks.size:
        raise CheckpointError(
            f"checkpoint {ckpt} was written by a run of {state.get('world_size', 1)} process(es) with "
            f"{_spread_of(state)}; this run has {ranks.size} with {_spread_of(sharding)}: a run whose weights are "
            "spread over its ranks resumes only from its own kind of checkpoint on as many processes"
        )
    with LazyTensors(ckpt / "weights" / SHARDED_WEIGHTS) as weights:
        load_weights_fn(weights)
    blob = _load_tensors(ckpt / "optimizer.pt")
    local = _load_tensors(ckpt / f"optimizer-rank{ranks.rank}.pt")
    optimizer.load_state_dict(sharded_optimizer_state(optimizer, local))
    _restore(blob, state, scheduler, masters)
    return state


def _spread_of(fields: dict) -> str:
    """How a run's weights were spread, in words."""
    parts = ["fsdp"] if fields.get("fsdp") else []
    if (fields.get("expert_parallel") or 1) > 1:
        parts.append(f"expert_parallel {fields['expert_parallel']}")
    return " and ".join(parts) or "the weights whole on every rank"


def _load_tensors(path: Path):
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain containers: refused (it could run "
            f"code when loaded). {str(e).splitlines()[0]}"
        ) from None
