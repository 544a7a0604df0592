"""A run's checkpoints and its final model, on 1 or N processes.

    files = RunCheckpoints(cfg, out, model, tokenizer, optimizer, scheduler, masters, parallel)
    files.save(step)            # atomic; rank 0 writes (partitioned weights: whole, one optimizer file per rank)
    step = files.load()         # the step the latest checkpoint resumes at, or None
    files.export(step)          # the final model folders (`longstraw.train.export`)

On N ranks every call is a collective: `save` first checks that every rank holds the same replicated weights (a
checksum all-gather), `load` has every rank load the checkpoint rank 0 names and compares the weights after it. With
partitioned weights (sharded layers, spread experts: `longstraw.distributed.parallelize.Parallel.partitioned`) a
checkpoint holds the weights whole (`save_sharded_checkpoint`) and records how they were spread, so it resumes only
alike; `export` then builds a model of its own on rank 0 from the last checkpoint (a second copy of the model, at the
end). The low-level formats are `longstraw.train.checkpoint`'s.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed.fsdp import load_full_tensors, local_optimizer_state
from ..distributed.parallelize import Parallel
from ..distributed.ranks import Ranks
from ..testing.models import TINY_CONFIGS
from .build import build_model_and_tokenizer, tiny_base
from .checkpoint import (
    SHARDED_WEIGHTS,
    LazyTensors,
    latest_name,
    load_checkpoint,
    load_sharded_checkpoint,
    read_trainer_state,
    save_checkpoint,
    save_sharded_checkpoint,
)
from .config import TrainConfig
from .export import export_model, save_model_folder
from .precision import MasterWeights


@dataclass
class RunCheckpoints:
    """Where a run's checkpoints go (`out / "checkpoints"`) and what they hold: the trainable weights (whole), the
    optimizer and scheduler, the float32 masters of bf16 weights, the data position and the config."""

    cfg: TrainConfig
    out: Path
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    masters: MasterWeights
    parallel: Parallel
    #: the PEFT config the run was given (an adapter saved as such at export), or None
    peft_config: Any = None

    @property
    def ranks(self) -> Ranks:
        return self.parallel.ranks

    @property
    def root(self) -> Path:
        return self.out / "checkpoints"

    def trainable(self) -> list[tuple[str, torch.Tensor]]:
        """The model's trainable parameters by name."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _sharding(self) -> dict:
        """How the weights were spread (a checkpoint resumes only alike)."""
        return {"fsdp": self.parallel.sharded, "expert_parallel": self.cfg.expert_parallel}

    def save(self, step: int) -> Path | None:
        """Write the checkpoint of `step` (rank 0's path; None on the other ranks)."""
        self.ranks.check_same(
            self.parallel.replicated(self.trainable()), "checkpoint: weights compared", f"at step {step}"
        )
        extra = {"world_size": self.ranks.size} if self.ranks.size > 1 else {}
        state = {"data_position": step * self.cfg.prompts_per_step, "config": self.cfg.to_dict(), **extra}
        if self.parallel.partitioned:
            return save_sharded_checkpoint(
                self.root,
                step,
                self.ranks,
                self.parallel.whole(self.trainable(), keep=self.ranks.main),
                local_optimizer_state(self.optimizer.state_dict()),
                self.scheduler,
                state,
                masters=self.masters,
                sharding=self._sharding(),
            )
        if not self.ranks.main:
            return None
        return save_checkpoint(self.root, step, self.model, self.optimizer, self.scheduler, state, masters=self.masters)

    def exists(self) -> bool:
        """Whether the output folder holds a checkpoint to resume from."""
        return latest_name(self.root) is not None

    def load(self, name: str | None = None) -> int | None:
        """Load the checkpoint `name` ("step-12"; default: the latest, if there is one); returns the step it resumes
        at (None: no checkpoint)."""
        root = self.root
        if name is None:
            name = self.ranks.from_main("resume: the latest checkpoint", lambda: latest_name(root))

        def load():
            if name is not None and self.parallel.partitioned:
                return load_sharded_checkpoint(
                    root / name,
                    self.ranks,
                    lambda values: self.parallel.load_whole(self.trainable(), values, f"checkpoint {name}"),
                    self.optimizer,
                    self.scheduler,
                    masters=self.masters,
                    sharding=self._sharding(),
                )
            return load_checkpoint(root, self.model, self.optimizer, self.scheduler, masters=self.masters, name=name)

        state = self.ranks.run_alike("resume: loading the checkpoint", load)
        if state is None:
            return None
        self.ranks.check_same(
            self.parallel.replicated(self.trainable()), "resume: weights compared", f"after loading {name}"
        )
        saved = state.get("world_size", 1)
        if saved != self.ranks.size and self.ranks.main:  # the steps do not depend on N beyond rounding
            print(
                f"longstraw: resuming {name}, written by a run of {saved} process(es), on {self.ranks.size}",
                file=sys.stderr,
            )
        return int(state["step"])

    def export(self, step: int) -> dict[str, Path]:
        """The final model folders of a run that ended at `step` (`longstraw.train.export`; rank 0)."""
        merge = self.cfg.merge_adapter
        return self._write(
            step, lambda model, base: export_model(model, self.tokenizer, self.out, merge_adapter=merge, **base)
        )

    def save_model(self, path: Path, step: int) -> None:
        """The model at `step` in the folder `path` itself, TRL's `save_model` (`save_model_folder`; rank 0)."""
        self._write(step, lambda model, base: save_model_folder(model, self.tokenizer, path, **base))

    def _write(self, step: int, write):
        """`write(model, {"base_model", "base_path"})` with the model at `step` and its base (for an adapter)."""
        base_model = base_path = None
        if self.cfg.lora or self.peft_config is not None:
            if self.cfg.model in TINY_CONFIGS:
                base_model = tiny_base(self.cfg, self.tokenizer)
            else:
                base_path = str(Path(self.cfg.model).resolve())
        model = self._unsharded_copy(step) if self.parallel.partitioned else self.model
        # save_pretrained writes `dtype` and `architectures` into the live config; on N ranks rank 0 alone exports,
        # and the ranks' configs must stay equal (a context-parallel capture compares them): put them back
        config = model.config
        before = dict(vars(config))
        try:
            return write(model, dict(base_model=base_model, base_path=base_path))
        finally:
            for key in set(vars(config)) - set(before):
                delattr(config, key)
            vars(config).update(before)

    def _unsharded_copy(self, step: int):
        """A model of this run's architecture holding the last checkpoint's trainable weights whole (rank 0's export
        with sharded layers or spread experts; memory: a second copy of the model on rank 0, at the end)."""
        name = latest_name(self.root)
        ckpt = self.root / str(name)
        if name is None or read_trainer_state(ckpt)["step"] != step:
            raise RuntimeError(f"export: the last checkpoint {ckpt} is not of the final step {step}")
        with torch.random.fork_rng(devices=[]):  # rank 0's random streams stay those of the other ranks
            model, _ = build_model_and_tokenizer(self.cfg, peft_config=self.peft_config)
        with LazyTensors(ckpt / "weights" / SHARDED_WEIGHTS) as weights:
            load_full_tensors(
                [(n, p) for n, p in model.named_parameters() if p.requires_grad], weights, f"export from {ckpt}"
            )
        return model
