"""FSDP2 for the weights (`longstraw.distributed.shard`) composed with context parallelism: gloo on CPU, 2 processes.

Each rank shards the decoder layers of the same tiny model, captures the prompt over the group, replays two branches
of its own (the second with activation checkpointing, whose recompute gathers the layer again) with gradient sync
off for the first backward and on for the last, and takes one AdamW step on its shards. The single-process reference
replays all 2 · N branches on an unsharded copy: summed gradients, the exact-mode gradient and the updated weights
must agree (fp32, relative ≤ 1e-5; the AdamW update ≤ 1e-4: Adam divides by √v, which magnifies the
gradients' rounding where they are tiny).
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

import longstraw

from .conftest import lora, rel_err, spawn_ranks, tokens

N = 2
TIMEOUT_S = 60
#: (arch, LoRA, prompt_grad): dense and MLA, adapters and full fine-tuning, detached and exact
CASES = (("llama", True, "detached"), ("llama", False, "exact"), ("deepseek_v3", False, "detached"))


def _response(rank: int, k: int) -> torch.Tensor:
    return tokens(5 + rank + 2 * k, seed=300 + 10 * rank + k)


def _advantage(rank: int, k: int, length: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0 + rank, length) * (1 - 2 * k)


def _model(arch: str, use_lora: bool):
    model = longstraw.models.tiny_model(arch)
    return lora(model) if use_lora else model


def _worker(rank: int, init: str, out_dir: str):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=N,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from torch.distributed.tensor import DTensor

    from longstraw.distributed import gradient_sync, replicated_parameters, shard

    result = {}
    for arch, use_lora, prompt_grad in CASES:
        model = _model(arch, use_lora)
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        shard(model)
        local_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                          for p in model.parameters())
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        opt = torch.optim.AdamW([p for _, p in named], lr=1e-2)
        state = longstraw.capture(model, tokens(20, seed=3), chunk_size=4, block_size=4, prompt_grad=prompt_grad,
                                  group=dist.group.WORLD)
        gradient_sync(model, False)
        logprobs, early = [], None
        for k in range(2):
            response = _response(rank, k)
            out = state.replay(response, checkpoint_layers=k == 1)
            if k == 1 and prompt_grad == "detached":
                gradient_sync(model, True)  # the step's last backward reduces
            (_advantage(rank, k, response.numel()) * out.logprobs).sum().backward()
            logprobs.append(out.logprobs.detach())
            if k == 0:  # nothing reduced yet: the sharded parameters have no gradient
                early = sum(p.grad is not None for _, p in named if isinstance(p, DTensor))
        if prompt_grad == "exact":
            gradient_sync(model, True)
            state.backward()
        for p in replicated_parameters(model):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        grads = {n: (p.grad.full_tensor() if isinstance(p, DTensor) else p.grad).clone() for n, p in named}
        before = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named}
        opt.step()
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() - before[n] for n, p in named}
        result[arch, use_lora, prompt_grad] = dict(logprobs=logprobs, grads=grads, weights=weights,
                                                   sharded_grads_after_first=early, full_bytes=full_bytes,
                                                   local_bytes=local_bytes)
        state.release()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _reference(arch, use_lora, prompt_grad):
    model = _model(arch, use_lora)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    state = longstraw.capture(model, tokens(20, seed=3), chunk_size=4, block_size=4, prompt_grad=prompt_grad)
    logprobs = {}
    for rank in range(N):
        for k in range(2):
            response = _response(rank, k)
            out = state.replay(response)
            (_advantage(rank, k, response.numel()) * out.logprobs).sum().backward()
            logprobs[rank, k] = out.logprobs.detach()
    state.backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in named}
    before = {n: p.detach().clone() for n, p in named}
    opt.step()
    return logprobs, grads, {n: p.detach() - before[n] for n, p in named}


def test_fsdp2_sharded_layers_equal_one_process(tmp_path):
    spawn_ranks(_worker, (str(tmp_path / "init"), str(tmp_path)), N,
                ["torch", "torch.distributed", "torch.distributed.fsdp", "longstraw", "longstraw.distributed",
                 "longstraw.models", "transformers.models.llama.modeling_llama",
                 "transformers.models.deepseek_v3.modeling_deepseek_v3"], 3 * TIMEOUT_S, "the FSDP2 cases")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(N)]
    for case in CASES:
        want_lp, want_g, want_w = _reference(*case)
        for rank in range(N):
            got = results[rank][case]
            for k in range(2):
                err = (got["logprobs"][k] - want_lp[rank, k]).abs().max().item()
                assert err <= 1e-5, f"{case} rank {rank} branch {k}: log-probs off by {err:.2e}"
            names = list(want_g)
            err = rel_err(torch.cat([got["grads"][n].flatten() for n in names]),
                          torch.cat([want_g[n].flatten() for n in names]))
            assert err <= 1e-5, f"{case} rank {rank}: summed gradient off by {err:.2e} relative"
            # one AdamW step on the shards moves the weights as one step on the whole model
            err = rel_err(torch.cat([got["weights"][n].flatten() for n in names]),
                          torch.cat([want_w[n].flatten() for n in names]))
            assert err <= 1e-4, f"{case} rank {rank}: the optimizer step's update off by {err:.2e} relative"
            # the first backward (sync off) reduced nothing; the step's last one reduced every layer
            assert got["sharded_grads_after_first"] == 0
            # each rank keeps about 1/N of the decoder layers' parameters
            assert got["local_bytes"] < 0.75 * got["full_bytes"]
