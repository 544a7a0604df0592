"""The one entry point of a capture, `longstraw.capture`. It validates, prepares the model, runs the self-check where
the model departs from what was tested, then captures in this process (`longstraw.prompt_state.capture_local`) or as a
collective of a process group (`longstraw.distributed.context_parallel`). Every check of a capture's arguments and of
the model runs here, once, for both."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .distributed import context_parallel as cp
from .model.capability import untested_because
from .model.prepare import prepare
from .ops.attention import DEFAULT_BLOCK
from .prompt_state import PromptState, TokenIds, capture_local, default_chunk_size, validate_capture
from .self_check import ensure_verified

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def capture(
    model: torch.nn.Module,
    prompt_ids: TokenIds,
    chunk_size: int | None = None,
    prompt_grad: str = "detached",
    block_size: int = DEFAULT_BLOCK,
    verify: bool | None = None,
    state_dtype: torch.dtype | str | None = None,
    state_device: torch.device | str | None = None,
    group: ProcessGroup | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PromptState:
    """Capture the durable state of `prompt_ids` (1-D or `[1, P]`) under `no_grad`, `chunk_size` tokens at a time
    (None: chosen for the model, `longstraw.model.chunking.auto_chunk_size` — 4,096 unless one chunk's transients would
    pass 512 MiB; the chunk changes the order of the arithmetic only, not the result beyond rounding).

    `model`: a transformers causal LM, optionally wrapped by PEFT. `prompt_grad`: "detached" (the state is a constant)
    or "exact" (the gradient reaches the prompt through `PromptState.backward()`; also keeps the linear-attention
    states at each chunk boundary). `block_size`: key block of the split attention.

    `model` is served when longstraw can represent each of its decoder layers (`longstraw.model.capability`);
    `state_dtype`: "fp8" (`torch.float8_e4m3fn`) or "int8" keeps the states that grow with P (full-attention
    K/V, MLA latents) in 8 bits with a float32 scale per 64 tokens × head (`longstraw.ops.quant`), quantized once
    here and dequantized tile by tile inside the attention; detached mode only. None: the model's dtype.

    `state_device`: "cpu" for a model on a GPU keeps the full-attention K/V (the state that grows with P in
    dense and hybrid models; with `state_dtype`, its 8-bit blocks) in pinned host memory; the attention
    streams it to the GPU one tile of 65,536 keys at a time, copying the next tile on a side stream while
    the current one is computed. GPU memory of the state falls to one tile per layer in flight; each replay
    and each decoding step reads the whole state over the host link. Other kinds (MLA latents, windows,
    recurrent states) stay on the GPU. Detached mode only. None, or the model's own device: no offload (on a
    CPU model, "cpu" changes nothing).

    `group`: a `torch.distributed` process group: capture is then a collective of its ranks, each keeping the state of
    its own slice of the prompt (context parallelism, `longstraw.distributed`); None: this process alone.

    `verify`: run the self-check (`longstraw.check`) once per model configuration and refuse the model
    (`UnsupportedArchitectureError`) when it fails. None (default): for configurations outside the tested
    families (`longstraw.archs`); True: always; False: never.

    `progress`: called as `progress(done, total)` with the prompt tokens captured so far after each chunk (a capture
    of millions of tokens runs for minutes to hours); with `group`, once, when the collective capture is done.
    """
    g = None  # with `group`: its `Group`
    if group is not None:  # torch.distributed only when a group is given
        # every rank the same arguments first, so that whatever is refused below is refused on every rank alike
        g = cp.agree(group, model, prompt_ids, chunk_size, prompt_grad, block_size, verify, state_dtype, state_device)
    validated = validate_capture(model, prompt_ids, chunk_size, prompt_grad, block_size, state_dtype, progress)
    parts, prompt, compressed = validated
    if g is not None:
        cp.check_served(g, parts, prompt, prompt_grad, compressed, state_device)
    prepare(model)
    if verify or (verify is None and untested_because(model, parts) is not None):
        ensure_verified(model)
    if g is None:
        return capture_local(
            model,
            prompt_ids,
            chunk_size,
            prompt_grad,
            block_size,
            state_dtype,
            state_device,
            progress,
            validated=validated,
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(parts, prompt.numel())
    state = cp.capture(g, parts, prompt, compressed, chunk_size, prompt_grad, block_size)
    if progress is not None:
        progress(prompt.numel() - 1, prompt.numel() - 1)
    return state
