"""FSDP2 for the weights (`longstraw.distributed.shard`) composed with context parallelism: gloo on CPU, 2 processes.

Each rank shards the decoder layers of the same tiny model, captures the prompt over the group, replays two branches
of its own (the second with activation checkpointing, whose recompute gathers the layer again) with gradient sync
off for the first backward and on for the last, and takes one AdamW step on its shards. The single-process reference
replays all 2 · N branches on an unsharded copy: log-probs, summed gradients and the exact-mode gradient must agree
within the model's own float32 rounding floor, measured on transformers' model against a float64 copy and capped at the
float32 bound per parameter (`test_distributed.float32_floor`), each parameter's gradient and the whole, and the weights after the step must be torch's AdamW applied to the ranks' own summed
gradient on one tensor (its elementwise float32 arithmetic: one rounding, `replay_tol`). Compared with the reference's
update directly, the step would measure AdamW's amplification instead: its first update g / (|g| + eps) turns the
rounding of gradient elements near eps into a whole step.
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

import longstraw
import longstraw.testing.models

from ..conftest import lora, rel_err, spawn_ranks, tokens
from .test_distributed import _assert_grads_within_floor, assert_plant_refused, float32_floor, planted_index
from .test_distributed_trainer import EPS32, adamw_replay, replay_tol
from ..test_equivalence import FLOOR_FACTOR

N = 2
TIMEOUT_S = 60
#: (arch, LoRA, prompt_grad): dense and MLA, adapters and full fine-tuning, detached and exact
CASES = (("llama", True, "detached"), ("llama", False, "exact"), ("deepseek_v3", False, "detached"))


def _response(rank: int, k: int) -> torch.Tensor:
    return tokens(5 + rank + 2 * k, seed=300 + 10 * rank + k)


def _advantage(rank: int, k: int, length: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0 + rank, length) * (1 - 2 * k)


def _model(arch: str, use_lora: bool):
    model = longstraw.testing.models.tiny_model(arch)
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
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named}
        result[arch, use_lora, prompt_grad] = dict(logprobs=logprobs, grads=grads, weights=weights,
                                                   sharded_grads_after_first=early, full_bytes=full_bytes,
                                                   local_bytes=local_bytes)
        state.release()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _reference(arch, use_lora, prompt_grad, chunk=4, block=4):
    """One process over all the branches: log-probs per (rank, branch), the summed gradients, the weights before the
    step and the optimizer's settings."""
    model = _model(arch, use_lora)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    state = longstraw.capture(model, tokens(20, seed=3), chunk_size=chunk, block_size=block, prompt_grad=prompt_grad)
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
    return logprobs, grads, before, dict(lr=opt.defaults["lr"], adam={k: opt.defaults[k] for k in
                                                                        ("betas", "eps", "weight_decay")})


def test_fsdp2_sharded_layers_equal_one_process(tmp_path):
    spawn_ranks(_worker, (str(tmp_path / "init"), str(tmp_path)), N,
                ["torch", "torch.distributed", "torch.distributed.fsdp", "longstraw", "longstraw.distributed",
                 "longstraw.testing.models", "transformers.models.llama.modeling_llama",
                 "transformers.models.deepseek_v3.modeling_deepseek_v3"], 3 * TIMEOUT_S, "the FSDP2 cases")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(N)]
    for case in CASES:
        want_lp, want_g, before, opt = _reference(*case)
        names = list(want_g)
        flat = lambda d: torch.cat([d[n].flatten() for n in names])  # noqa: E731
        # the model's own float32 rounding over the same branches, on transformers (not on longstraw)
        arch, use_lora, prompt_grad = case
        branches = [(None, _response(rank, k), _advantage(rank, k, _response(rank, k).numel()))
                    for rank in range(N) for k in range(2)]
        floor = float32_floor(_model(arch, use_lora), tokens(20, seed=3), branches, exact=prompt_grad == "exact")
        lp_floor = floor["logprobs"]
        for rank in range(N):
            got = results[rank][case]
            for k in range(2):
                err = (got["logprobs"][k] - want_lp[rank, k]).abs().max().item()
                # `FLOOR_FACTOR` × the floor (the ranks regroup the same sums once more) + one rounding of the value
                tol = FLOOR_FACTOR * lp_floor + EPS32 * want_lp[rank, k].abs().max().item()
                assert err <= tol, f"{case} rank {rank} branch {k}: log-probs off by {err:.2e}"
            # each parameter and the whole within the floor as above + `GRAD_TOL` (the reduction of the branches'
            # gradients over the ranks, reordered); a 1e-4 relative error in one small parameter's gradient refused
            got_g, ref_g = [got["grads"][n] for n in names], [want_g[n] for n in names]
            _assert_grads_within_floor(got_g, ref_g, floor, f"{case} rank {rank}")
            assert_plant_refused(got_g, ref_g, floor, planted_index(arch, use_lora, ref_g), f"{case} rank {rank}")
            # one AdamW step on the shards moves the weights as one step on one tensor by the same gradient
            run = dict(start=flat(before), grads=[flat(got["grads"])], lrs=[opt["lr"]], adam=opt["adam"])
            err = rel_err(flat(got["weights"]), adamw_replay(run))
            assert err <= replay_tol(run), f"{case} rank {rank}: the weights after the step off by {err:.2e}"
            # meaningful: the step moved the weights by far more than that
            assert rel_err(flat(got["weights"]), flat(before)) > 1e3 * replay_tol(run)
            # the first backward (sync off) reduced nothing; the step's last one reduced every layer
            assert got["sharded_grads_after_first"] == 0
            # each rank keeps about 1/N of the decoder layers' parameters
            assert got["local_bytes"] < 0.75 * got["full_bytes"]
