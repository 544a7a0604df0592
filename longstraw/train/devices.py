"""The one place that decides the device and the dtype of a run.

`device: auto` is CUDA when a CUDA device is present, else the CPU. `dtype: auto` is bfloat16 on CUDA
(what the models people train are stored and trained in) and float32 on the CPU (where bf16 matmuls are
slow and the test suite's tolerances are fp32's). Whatever the model dtype, attention partials,
log-sum-exps, log-probs and loss terms accumulate in float32 (`longstraw.ops.attention`, `longstraw.ops.logprobs`),
and LoRA adapters stay float32 (PEFT keeps adapter weights in float32 by default), so their AdamW state is
float32 too. Trainable bf16 weights (full fine-tuning, or `train_embeddings` beside LoRA) step on float32
master copies (`longstraw.train.precision`). Trainable fp16 weights would also need loss scaling, which the trainer
does not do: `TrainConfig` refuses them.
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is available here")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.float16  # cards before Ampere
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}; got {name!r}")
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(
            f"dtype 'bf16': {torch.cuda.get_device_name(device)} has no bfloat16 arithmetic; use dtype: fp16 (or fp32)"
        )
    return DTYPES[name]
