"""Segmented replay under context parallelism (`longstraw.replay.segments.replay_segments` on a `ContextParallelState` or a
branch of one): each rank replays its own multi-turn trajectory in segments, the ranks in lockstep (their trajectories
have other lengths and other numbers of turns), and the gradient summed over the ranks is one process's gradient of
the same trajectories replayed whole (`PromptState.replay`, held to transformers by tests/replay/test_segments.py and
tests/test_equivalence.py), within the model's float32 floor measured on transformers (`float32_floor`).

gloo on CPU, 2 and 3 processes of 1 thread.
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

import longstraw
import longstraw.testing.models

from ..conftest import assert_tie_free, lora, spawn_ranks, tokens
from .test_distributed import (
    _assert_grads_within_floor,
    _logprob_tol,
    assert_plant_refused,
    float32_floor,
    planted_index,
)

TIMEOUT_S = 60
P = 30
SUFFIX = tokens(5, seed=77)
#: each rank's trajectory as runs of (tokens, written by the policy): rank 0 five segments, rank 1 one policy turn
#: only, rank 2 two turns with a trailing tool reply (read by nothing)
RUNS = (((3, 1), (4, 0), (2, 1), (5, 0), (3, 1)), ((6, 1),), ((2, 1), (3, 0), (2, 1), (1, 0)))


def _trajectory(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank r's response `[T]`, its mask and the weights of its log-probs (0 on the environment's tokens)."""
    mask = torch.cat([torch.full((n,), float(policy)) for n, policy in RUNS[rank]])
    response = tokens(mask.numel(), seed=200 + rank)
    return response, mask, torch.linspace(-1.0, 1.0 + rank, mask.numel()) * mask


def _model(arch: str, use_lora: bool):
    model = longstraw.testing.models.tiny_model(arch)
    return lora(model) if use_lora else model


def _worker(rank: int, n: int, init: str, out_dir: str, cases):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft, as pyproject
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from longstraw.replay.segments import replay_segments

    result = {}
    for arch, use_lora, prompt_grad, suffix in cases:
        model = _model(arch, use_lora)
        params = [q for q in model.parameters() if q.requires_grad]
        state = longstraw.capture(model, tokens(P, seed=1), chunk_size=4, block_size=4, prompt_grad=prompt_grad,
                                  group=dist.group.WORLD)
        response, mask, weight = _trajectory(rank)
        out = replay_segments(state, response, mask, lambda sl, r: (weight[sl] * r.logprobs).sum(),
                              prefix_ids=SUFFIX if suffix else None)
        state.backward()
        grads = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]
        for g in grads:  # the sum over the ranks' trajectories
            dist.all_reduce(g)
        result[arch, use_lora, prompt_grad, suffix] = dict(logprobs=out.logprobs, grads=grads)
        state.release()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _one_process(arch: str, use_lora: bool, prompt_grad: str, suffix: bool, n: int):
    """One process, the n trajectories replayed whole: each one's log-probs, the gradient summed over them."""
    model = _model(arch, use_lora)
    params = [q for q in model.parameters() if q.requires_grad]
    state = longstraw.capture(model, tokens(P, seed=1), chunk_size=4, block_size=4, prompt_grad=prompt_grad)
    logprobs = []
    for r in range(n):
        response, _, weight = _trajectory(r)
        out = state.replay(response, prefix_ids=SUFFIX if suffix else None)
        (weight * out.logprobs).sum().backward()
        logprobs.append(out.logprobs.detach())
    state.backward()
    grads = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]
    floor = float32_floor(model, tokens(P, seed=1),
                          [(SUFFIX if suffix else None, _trajectory(r)[0], _trajectory(r)[2]) for r in range(n)],
                          exact=prompt_grad == "exact")
    return logprobs, grads, floor


def _check(tmp_path, n: int, cases) -> dict:
    from longstraw.replay.segments import segments

    assert len({len(segments(_trajectory(r)[1])) for r in range(n)}) == n  # ranks in lockstep over other turn counts
    for arch in {case[0] for case in cases}:  # DSA: no top-k near-tie that another summation order could flip
        for r in range(n):
            assert_tie_free(_model(arch, False), torch.cat([tokens(P, seed=1), SUFFIX, _trajectory(r)[0]]))
    spawn_ranks(_worker, (n, str(tmp_path / "init"), str(tmp_path), tuple(cases)), n,
                ["torch", "torch.distributed", "longstraw", "longstraw.testing.models",
                 "transformers.models.llama.modeling_llama", "transformers.models.gemma3.modeling_gemma3",
                 "transformers.models.qwen3_next.modeling_qwen3_next",
                 "transformers.models.gpt_oss.modeling_gpt_oss", "transformers.models.deepseek_v3.modeling_deepseek_v3", "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"], 3 * TIMEOUT_S, "segmented replays")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    measured = {}
    for case in cases:
        arch, use_lora, prompt_grad, suffix = case
        logprobs, want, floor = _one_process(arch, use_lora, prompt_grad, suffix, n)
        what = f"{arch} {prompt_grad}{' after a suffix' if suffix else ''} N={n}"
        for r in range(n):
            got = results[r][case]
            on = _trajectory(r)[1] > 0  # segmented replay gives the policy's tokens (0 at the environment's)
            err = (got["logprobs"][on] - logprobs[r][on]).abs().max().item()
            assert err <= _logprob_tol(floor, logprobs[r]), f"{what} rank {r}: log-probs off by {err:.2e}"
            assert (got["logprobs"][~on] == 0).all()
            measured[what] = _assert_grads_within_floor(got["grads"], want, floor, f"{what} rank {r}")
        assert_plant_refused(results[0][case]["grads"], want, floor, planted_index(arch, use_lora, want), what)
    return measured


def test_two_ranks_replay_segments_like_one_process_whole(tmp_path):
    """N = 2: rank 0 five segments, rank 1 one policy turn (it takes part in rank 0's four other forwards and its
    reverse pass with one-token forwards of weight 0); full attention (LoRA), sliding + full, gated DeltaNet + full,
    sinks, MLA and DSA latents; detached, after a row's suffix (a branch of the state), and exact."""
    cases = (("llama", True, "detached", False), ("llama", False, "detached", True), ("llama", True, "exact", False),
             ("gemma3_text", False, "detached", False), ("qwen3_next", False, "detached", True),
             ("qwen3_next", False, "exact", False), ("gpt_oss", False, "detached", False),
             ("deepseek_v3", True, "exact", False), ("glm_moe_dsa", False, "detached", False))
    measured = _check(tmp_path, 2, cases)
    print(f"\nsegmented on 2 ranks vs one process whole, summed gradient relative error: {measured}")


def test_three_ranks_replay_segments_like_one_process_whole(tmp_path):
    """N = 3: five, one and four segments (the third ending with a tool reply)."""
    cases = (("llama", True, "detached", False), ("gemma3_text", False, "exact", False))
    measured = _check(tmp_path, 3, cases)
    print(f"\nsegmented on 3 ranks vs one process whole, summed gradient relative error: {measured}")
