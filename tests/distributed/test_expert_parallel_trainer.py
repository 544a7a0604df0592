"""The trainer with `expert_parallel: 2` (`longstraw.distributed.expert_parallel` through `Trainer`): 2 processes of 1
thread (gloo), a tiny mixture-of-experts model (Mixtral; DeepSeek-V3 with its shared experts and group-limited
routing) with LoRA on every linear layer, the experts' own 3-D weights included (PEFT 0.21's `target_parameters`
adapters, spread with the experts they adapt), and full fine-tuning of Mixtral. One spawn runs, per case, 3 steps (a
full-sequence supervised step, then 2 GRPO steps with a KL term) and writes every step's applied gradient and weights
whole (spread slices gathered); then the same run interrupted after step 2 and resumed by a fresh trainer from its
checkpoint. The single-process reference trains the unmodified model (every expert on every rank: transformers' own
MoE block) in the test process, its weights set to the spread run's before each step.
"""

from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

from ..conftest import spawn_ranks
from .test_distributed_trainer import EPS32, token_reward  # noqa: F401  (token_reward: the runs' reward by path)

TIMEOUT_S = 60
STEPS = 3
#: (name, config overrides) of the cases
CASES = {
    "mixtral-lora": dict(model="mixtral"),
    "deepseek-lora": dict(model="deepseek_v3"),
    "mixtral-full": dict(model="mixtral", lora=False, learning_rate=1e-3, beta=0.0),
    "mixtral-fsdp": dict(model="mixtral", fsdp=True),  # the dense layers sharded beside the spread experts
}
#: 4 processes: two context-parallel groups of 2 (each an expert group of 2), 3 prompts per step: the groups take 2
#: and 1 of them
CP_CASE = dict(model="mixtral", context_parallel=2, prompts_per_step=3)


def _cfg(out: str, **kw) -> TrainConfig:
    base = dict(output_dir=out, prompt_length=24, task_options={"num_pairs": 4, "num_values": 8},
                reward_funcs=[f"{__name__}:token_reward"], num_steps=STEPS, num_generations=3,
                max_completion_length=2, prompts_per_step=2, eval_examples=2, progress=False, threads=1,
                learning_rate=1e-2, beta=0.05, lora=True, lora_target_modules="all-linear", sft_warmup_steps=1,
                dist_timeout=TIMEOUT_S, eval_at_start=False)
    base.update(kw)
    return TrainConfig(**base)


def _whole(trainer, name: str, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (of parameter `p`) whole: a spread slice gathered over the expert group, an FSDP2 shard over the ranks
    (collectives)."""
    from longstraw.distributed.fsdp import is_sharded

    experts = trainer.parallel.experts
    if experts is not None and experts.is_spread(p):
        return experts.whole(p, name, value).clone()
    value = value.detach()
    return (value.full_tensor() if is_sharded(value) else value).clone()


def _run(out: str, cfg: dict, force: dict | None = None, stop_after: int | None = None, resume: bool = False):
    """Train; per optimizer step, the applied gradient and the weights it was taken at, {name: whole tensor}.
    `force` (step → weights) sets this trainer's weights before that step (the single-process reference)."""
    trainer = Trainer(_cfg(out, **cfg))
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    grads, at = [], []

    def record(opt, *args):
        grads.append({n: _whole(trainer, n, p, p.grad) for n, p in named})
        at.append({n: _whole(trainer, n, p, p) for n, p in named})

    trainer.opt.register_step_pre_hook(record)
    rows = []

    class Stop(Exception):
        pass

    def on_step(m):
        rows.append(m)
        if force is not None and m["step"] + 1 in force:
            with torch.no_grad():
                for n, p in named:
                    p.copy_(force[m["step"] + 1][n])
        if m["step"] == stop_after:
            raise Stop

    if force is not None and 1 in force:
        with torch.no_grad():
            for n, p in named:
                p.copy_(force[1][n])
    try:
        trainer.train(on_step=on_step)
    except Stop:
        pass
    from longstraw.distributed.fsdp import is_sharded

    final = {n: _whole(trainer, n, p, p) for n, p in named}
    return dict(rows=rows, grads=grads, at=at, final=final, experts=trainer.parallel.experts is not None,
                groups=(trainer.parallel.groups.index, trainer.parallel.groups.count, trainer.parallel.context.size),
                shapes={n: tuple(p.to_local().shape if is_sharded(p) else p.shape) for n, p in named},
                fsdp_shards=sum(is_sharded(p) for _, p in named))


def _worker(rank: int, n: int, init: str, out_dir: str, cases: list[str], resume: bool):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    results = {}
    for case in cases:
        cfg = dict(_case(case), expert_parallel=2)
        results[case] = dict(whole=_run(os.path.join(out_dir, case), cfg))
        if resume:
            cut = _run(os.path.join(out_dir, case + "-cut"), cfg, stop_after=2)
            results[case].update(cut_steps=len(cut["rows"]), resumed=_run(os.path.join(out_dir, case + "-cut"), cfg))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _case(name: str) -> dict:
    return CP_CASE if name == "mixtral-cp2" else CASES[name]


PRELOAD = ["torch", "torch.distributed", "longstraw", "longstraw.train.trainer", "peft",
           "transformers.models.mixtral.modeling_mixtral", "transformers.models.deepseek_v3.modeling_deepseek_v3"]


@pytest.fixture(scope="module")
def spread_runs(tmp_path_factory):
    """2 processes, one expert group of 2: every case, and its interrupted and resumed run."""
    tmp = tmp_path_factory.mktemp("ep-trainer")
    spawn_ranks(_worker, (2, str(tmp / "init"), str(tmp), list(CASES), True), 2, PRELOAD, 6 * TIMEOUT_S,
                "expert-parallel training")
    return tmp, [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory):
    """4 processes, two expert groups of 2 (ranks 0-1 and 2-3; ranks 0 and 2, 1 and 3 hold the same experts)."""
    tmp = tmp_path_factory.mktemp("ep-trainer-4")
    spawn_ranks(_worker, (4, str(tmp / "init"), str(tmp), ["mixtral-lora", "mixtral-cp2"], False), 4, PRELOAD,
                12 * TIMEOUT_S,
                "expert-parallel training on 4 processes")
    return tmp, [torch.load(tmp / f"rank{r}.pt") for r in range(4)]


#: the applied gradient, 2 ranks with spread experts vs one process at the same weights, relative to its norm
GRAD_TOL = 16 * EPS32


def _like_one_process(results: list, case: str, tmp_path) -> None:
    got = results[0][case]["whole"]
    assert got["experts"] and len(got["grads"]) == STEPS
    # every rank gathered the same whole gradients and weights
    for other in results[1:]:
        for a, b in zip(got["grads"], other[case]["whole"]["grads"]):
            assert all(torch.equal(a[n], b[n]) for n in a)
    # each rank held half of the experts' weights (and of their adapters), and, with fsdp, half of the layers' others
    halved = [n for n, s in got["shapes"].items() if s != tuple(got["final"][n].shape)]
    assert halved and all(got["shapes"][n][0] * 2 == got["final"][n].shape[0] or
                          got["shapes"][n][1] * 2 == got["final"][n].shape[1] for n in halved)
    assert (got["fsdp_shards"] > 0) == bool(_case(case).get("fsdp"))
    force = {row["step"]: w for row, w in zip(got["rows"], got["at"])}
    one = {k: v for k, v in _case(case).items() if k != "context_parallel"}
    want = _run(str(tmp_path / "one"), one, force=force)
    assert not want["experts"] and len(want["grads"]) == STEPS
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"]), 1):
        flat_g = torch.cat([g[n].flatten() for n in sorted(g)])
        flat_w = torch.cat([w[n].flatten() for n in sorted(w)])
        err = ((flat_g - flat_w).norm() / flat_w.norm()).item()
        print(f"\n{case} step {step}: applied gradient off by {err:.1e} relative")
        assert err <= GRAD_TOL, (case, step, err)
    for a, b in zip(got["rows"], want["rows"]):
        assert a["phase"] == b["phase"]
        if a["phase"] == "grpo":
            assert abs(a["loss"] - b["loss"]) <= GRAD_TOL * max(1.0, abs(b["loss"])), (a["loss"], b["loss"])
            assert a["expert_load_imbalance"] >= 1.0 and a["expert_rows"] > 0


@pytest.mark.parametrize("case", list(CASES))
def test_spread_experts_train_like_one_process(spread_runs, tmp_path, case):
    _like_one_process(spread_runs[1], case, tmp_path)


def test_two_expert_groups_train_like_one_process(two_groups, tmp_path):
    """4 processes in two expert groups: the experts' gradients summed over the groups (ranks holding the same experts),
    the rest over all 4."""
    _like_one_process(two_groups[1], "mixtral-lora", tmp_path)


def test_context_parallel_groups_with_expert_groups_train_like_one_process(two_groups, tmp_path):
    """`context_parallel: 2` and `expert_parallel: 2` on 4 processes: two groups of 2 ranks, each capturing, sampling
    and replaying its own prompts of the step (2 and 1 of 3) with its experts spread over its 2 ranks; the groups'
    rows exchanged, the gradients summed over all 4. The step's rewards and loss are those of one process. Its
    full-sequence supervised step splits 3 prompts over 4 ranks: the ranks' shares differ, so it holds only because
    that step runs in lockstep with spread experts (without it, a named collective timeout)."""
    _like_one_process(two_groups[1], "mixtral-cp2", tmp_path)
    assert [r["mixtral-cp2"]["whole"]["groups"] for r in two_groups[1]] == [(0, 2, 2), (0, 2, 2), (1, 2, 2), (1, 2, 2)]


@pytest.mark.parametrize("case", list(CASES))
def test_spread_experts_resume_from_their_checkpoint(spread_runs, case):
    """Interrupted after step 2 and resumed by a fresh trainer: the final weights are the uninterrupted run's, bit for
    bit (the checkpoint holds the experts gathered whole, and each rank takes its slice back)."""
    _, results = spread_runs
    whole, resumed = results[0][case]["whole"], results[0][case]["resumed"]
    assert results[0][case]["cut_steps"] == 2 and len(resumed["grads"]) == 1
    for n, w in whole["final"].items():
        assert torch.equal(resumed["final"][n], w), n


def test_expert_parallel_refusals(tmp_path):
    """What is not built is refused by name: expert_parallel on a process count it does not divide (one process here),
    with vLLM rollouts; and below 1."""
    with pytest.raises(ValueError, match="expert_parallel: 2 needs a process count it divides; this run has 1"):
        Trainer(_cfg(str(tmp_path / "one"), model="mixtral", expert_parallel=2))
    with pytest.raises(ValueError, match="context_parallel: 2 needs a process count it divides; this run has 1"):
        Trainer(_cfg(str(tmp_path / "cp"), model="mixtral", context_parallel=2))
    # an expert group's ranks run every forward together: inside one context-parallel group
    with pytest.raises(ValueError, match="expert_parallel: 2 needs a context_parallel group it divides"):
        _cfg(str(tmp_path / "c"), model="mixtral", expert_parallel=2, context_parallel=1)
    with pytest.raises(ValueError, match="expert_parallel with rollout_backend: vllm"):
        _cfg(str(tmp_path / "v"), model="mixtral", expert_parallel=2, rollout_backend="vllm", train_embeddings=False)
    with pytest.raises(ValueError, match="expert_parallel must be >= 1"):
        _cfg(str(tmp_path / "z"), model="mixtral", expert_parallel=0)
