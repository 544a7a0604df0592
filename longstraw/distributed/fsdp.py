"""FSDP2 for the weights: each decoder layer's parameters sharded over the ranks (`torch.distributed.fsdp.fully_shard`).

    longstraw.distributed.shard(model)               # every rank, after PEFT wrapping, before the optimizer
    state = longstraw.capture(model, prompt, group=pg)
    longstraw.distributed.gradient_sync(model, False)
    for each of this rank's branches but the last:  replay, backward     # gradients accumulate unsharded, unreduced
    longstraw.distributed.gradient_sync(model, True)
    last branch: replay, backward (exact mode: state.backward() last)    # one reduce-scatter per layer, once per step
    torch.distributed.all_reduce(p.grad) for p in replicated_parameters(model)
    optimizer.step()

What is sharded: the decoder layers, the bulk of the weights; each holds 1/N of its parameters between forwards and
gathers them for its own forward and backward (FSDP2's hooks on the layer, which longstraw's stand-in layer classes
keep: `longstraw.prepare` subclasses the layer's class as `fully_shard` does, so both compose, activation
checkpointing of the replay included, whose recompute gathers the layer again). The embeddings, final norm and LM
head stay replicated (longstraw calls the decoder stack and the LM head separately, outside any one module's
forward): their gradients are summed by the caller (`replicated_parameters`; the trainer's all-reduce).

Gradients: FSDP2 averages over the ranks by default; longstraw's losses are per branch and their gradients meant
to be summed over the ranks' branches (as `all_reduce` would), so `shard` sets the divide factor to 1. With
`gradient_sync(model, False)` a layer's gradients accumulate unsharded and unreduced over the step's backwards
(memory: one unsharded copy of the trainable parameters' gradients, small with LoRA); the backward that runs with
sync on reduce-scatters them once. Parameters are `DTensor`s: an optimizer built after `shard` steps the shards.

Every rank must run the same forwards and backwards in the same order (capture, replay, sample and the reverse pass
are collectives already, and the trainer pads a rank short of branches with a weight-0 replay), since each layer's
forward and backward all-gathers and reduce-scatters over the group.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models import base_model, decoder_of

__all__ = ["gradient_sync", "replicated_parameters", "shard", "sharded_layers"]


def shard(model, mesh=None, reshard_after_forward: bool = True):
    """Shard every decoder layer of `model` (a transformers causal LM, optionally PEFT-wrapped) over `mesh` (a 1-D
    `DeviceMesh`; None: all ranks of the default group on the model's device type) with `fully_shard`; returns
    `model`. `reshard_after_forward`: free the gathered parameters after each layer's forward (and gather again in
    backward), the memory-lean FSDP2 default. Call it once, after PEFT wrapping and before building the optimizer."""
    from torch.distributed.fsdp import fully_shard

    from ..prepare import prepare

    if sharded_layers(model):
        raise ValueError("the model's decoder layers are already sharded (longstraw.distributed.shard was called)")
    prepare(model)  # longstraw's stand-in classes first; fully_shard then subclasses them
    for layer in decoder_of(base_model(model)).layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        # summed over the ranks' branches, not averaged: a plain SUM reduction (gloo has no PREMUL_SUM, which a
        # divide factor of 1 would otherwise select; torch 2.11-2.13 FSDP2)
        layer.set_gradient_divide_factor(1.0)
        force_sum = getattr(layer, "set_force_sum_reduction_for_comms", None)
        if force_sum is not None:
            force_sum(True)
    return model


def sharded_layers(model) -> list[nn.Module]:
    """The decoder layers `shard` sharded (FSDP2 modules), in order; empty if none."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in decoder_of(base_model(model)).layers if isinstance(m, FSDPModule)]


def gradient_sync(model, enabled: bool) -> None:
    """Whether the next backwards reduce-scatter the sharded layers' gradients (`set_requires_gradient_sync`)."""
    for layer in sharded_layers(model):
        layer.set_requires_gradient_sync(enabled, recurse=False)


def replicated_parameters(model) -> list[torch.Tensor]:
    """The trainable parameters FSDP does not shard (embeddings, final norm, LM head, ...): the caller sums their
    gradients over the ranks."""
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
