"""The device and dtype policy (`longstraw.devices`) and the trainer under it, on the CPU."""

import math

import pytest
import torch

from longstraw.config import TrainConfig
from longstraw.devices import resolve_device, resolve_dtype
from longstraw.trainer import Trainer


def test_auto_resolves_to_the_cpu_in_float32_here():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    device = resolve_device("auto")
    assert device.type == "cpu" and resolve_dtype("auto", device) == torch.float32
    assert resolve_dtype("bf16", device) == torch.bfloat16
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("fp64", device)


def test_bf16_lora_run_keeps_adapters_and_accumulation_in_float32(tmp_path):
    """A bf16 model trains through two GRPO steps: finite loss and rewards, base weights bf16, adapter weights and
    their optimizer state float32."""
    cfg = TrainConfig(model="llama", output_dir=str(tmp_path / "run"), prompt_length=64, num_steps=2,
                      task_options={"num_pairs": 4, "num_values": 8}, num_generations=4, max_completion_length=2,
                      progress=False, threads=1, lora=True, train_embeddings=False, dtype="bf16")
    trainer = Trainer(cfg)
    rows = trainer.train()
    assert all(math.isfinite(r["loss"]) for r in rows)
    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    adapters = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    assert all(p.dtype == torch.bfloat16 for p in base)
    states = [s for s in trainer.opt.state.values() if "exp_avg" in s]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)


def test_half_precision_trainable_weights_without_master_copies_are_refused():
    with pytest.raises(ValueError, match="master weights"):
        TrainConfig(model="llama", lora=False, dtype="bf16")
    with pytest.raises(ValueError, match="train_embeddings"):
        TrainConfig(model="llama", lora=True, train_embeddings=True, dtype="bf16")
