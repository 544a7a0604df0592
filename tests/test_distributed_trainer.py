"""The trainer on N processes (`longstraw.parallel`): gloo, 2 processes of 1 thread.

One spawn of 2 ranks (forkserver, `file://` rendezvous, as tests/test_distributed.py) trains run A for 3 steps (a
full-sequence supervised step, split over the ranks, then 2 GRPO steps of 2 prompts with G = 3 responses each, so
rank 1 pads its replays, prompts recaptured for the update, beta > 0: reference log-probs) and run X (a replayed
supervised step, then GRPO with 1 prompt of G = 4 whose state serves the update, exact prompt gradients), then run B
(A's config), in which rank 1 dies after step 2; a second spawn resumes B. The single-process references run in the
test process. The ranks record every step's sampled responses, rewards and advantages and
their final weights with `torch.save`; the tests compare.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from longstraw.config import TrainConfig
from longstraw.trainer import Trainer

from .conftest import spawn_ranks

TIMEOUT_S = 60  # the group's collective timeout; each spawn must finish within 2 × this
STEPS = 3


def token_reward(prompts, completions, completion_ids, **kw) -> list[float]:
    """A dense reward (the first token id mod 5), so that every GRPO group has non-zero advantages."""
    return [(ids[0] % 5) / 4 for ids in completion_ids]


#: run X's differences from A
OTHER = dict(prompts_per_step=1, num_generations=4, sft_full_sequence=False, prompt_grad="exact", beta=0.0)


def _cfg(out: str, **kw) -> TrainConfig:
    base = dict(model="llama", output_dir=out, prompt_length=24, task_options={"num_pairs": 4, "num_values": 8},
                reward_funcs=[f"{__name__}:token_reward"],
                num_steps=STEPS, num_generations=3, max_completion_length=2, prompts_per_step=2, eval_examples=2,
                progress=False, threads=1, learning_rate=1e-2, beta=0.05, lora=True, sft_warmup_steps=1,
                dist_timeout=TIMEOUT_S)
    base.update(kw)
    return TrainConfig(**base)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor, whole (a sharded one gathered: a collective)."""
    from longstraw.distributed.fsdp import is_sharded

    t = t.detach()
    return (t.full_tensor() if is_sharded(t) else t).clone()


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: _whole(v) for k, v in trainer.model.named_parameters() if v.requires_grad}


def _recording(trainer) -> list:
    """Every GRPO step's responses (token ids), rewards and advantages, as the trainer's rollout returns them."""
    seen = []
    rollout = trainer.rollout

    def record(step):
        r = rollout(step)
        seen.append(dict(step=step, tokens=[x.tokens.tolist() for x in r.responses], rewards=r.rewards.clone(),
                         advantages=r.advantages.clone()))
        return r

    trainer.rollout = record
    return seen


def _train(out: str, cfg: dict | None = None, **kw) -> dict:
    trainer = Trainer(_cfg(out, **(cfg or {})))
    seen = _recording(trainer)
    grads = []  # the summed gradient each optimizer step applies (after clipping)
    trainer.opt.register_step_pre_hook(lambda *a: grads.append(torch.cat([_whole(p.grad).flatten()
                                                                          for p in trainer.masters.params])))
    rows = trainer.train(**kw)
    return dict(rows=rows, rollouts=seen, weights=_weights(trainer), grads=grads)


def _worker(rank: int, n: int, init: str, out_dir: str, scenario: str):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft, as pyproject
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from longstraw.distributed import CollectiveError

    path = os.path.join(out_dir, f"{scenario}-rank{rank}.pt")
    if scenario == "resume":  # run B again: every rank resumes from rank 0's checkpoint of step 2
        torch.save(dict(B=_train(os.path.join(out_dir, "B"))), path)
        dist.destroy_process_group()
        return
    result = dict(A=_train(os.path.join(out_dir, "A")), X=_train(os.path.join(out_dir, "X"), OTHER))
    torch.save(result, path)

    t_step2 = []

    def die_after_2(m):  # rank 1 vanishes without a word after step 2 (its checkpoint written by rank 0)
        if m["step"] == 2:
            if rank == 1:
                os._exit(0)
            t_step2.append(time.perf_counter())

    try:
        _train(os.path.join(out_dir, "B"), on_step=die_after_2)
        result["B_error"] = None
    except CollectiveError as err:  # how long rank 0 went on after step 2 before it knew
        result["B_error"] = (str(err), time.perf_counter() - t_step2[0])
    torch.save(result, path)


def _spawn(tmp_path, scenario: str) -> list[dict]:
    init = tmp_path / f"init-{scenario}"
    spawn_ranks(_worker, (2, str(init), str(tmp_path), scenario), 2,
                ["torch", "torch.distributed", "transformers", "peft", "longstraw", "longstraw.trainer",
                 "longstraw.distributed", "transformers.models.llama.modeling_llama"], 2 * TIMEOUT_S, repr(scenario))
    return [torch.load(tmp_path / f"{scenario}-rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A on 2 ranks and on 1 process, run B (rank 1 dies after step 2) on 2 ranks; the initial weights."""
    tmp = tmp_path_factory.mktemp("dtrain")
    t0 = time.perf_counter()
    two = _spawn(tmp, "first")
    t_two = time.perf_counter() - t0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init = _weights(Trainer(_cfg(str(tmp / "init"))))
    one = dict(A=_train(str(tmp / "one-A")), X=_train(str(tmp / "one-X"), OTHER))
    return dict(tmp=tmp, two=two, one=one, init=init, t_two=t_two)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _flat(weights: dict) -> torch.Tensor:
    return torch.cat([w.flatten() for _, w in sorted(weights.items())])


#: final weights, 2 ranks vs 1 process, relative. X's first step (one replayed answer) leaves many gradient elements
#: near AdamW's eps (1e-8), whose first update g / (|g| + eps) turns the gradient's rounding (1.6e-7 relative) into
#: 2e-5 of the update; measured 2.0e-6 (A) and 2.1e-5 (X)
WEIGHT_TOL = {"A": 1e-5, "X": 1e-4}


@pytest.mark.parametrize("run", ["A", "X"])
def test_two_processes_train_like_one(runs, run):
    """2 ranks (context-parallel capture, replays spread, gradients all-reduced) = 1 process: the same sampled
    responses, rewards and advantages; losses within 1e-5 relative (fp32); the gradient each optimizer step applies
    within 1e-6 at the first step (same weights) and 2e-5 later; final adapter weights within `WEIGHT_TOL`; the two
    ranks bit-identical to each other. Meaningful: the weights moved from their start by far more than the
    tolerance, the GRPO steps had non-zero advantages, and every step had a gradient."""
    one, (r0, r1) = runs["one"][run], runs["two"]
    a0, a1 = r0[run], r1[run]
    assert [r["step"] for r in a0["rows"]] == list(range(1, STEPS + 1))
    assert all(r.get("world_size") == 2 for r in a0["rows"]) and "world_size" not in one["rows"][0]
    # every rank sampled the single process's responses and agreed on rewards and advantages
    assert len(one["rollouts"]) == STEPS - 1
    for got in (a0["rollouts"], a1["rollouts"]):
        assert [g["tokens"] for g in got] == [w["tokens"] for w in one["rollouts"]]
        for g, w in zip(got, one["rollouts"]):
            assert torch.allclose(g["rewards"], w["rewards"]) and torch.allclose(g["advantages"], w["advantages"])
    assert all(w["advantages"].abs().max() > 0.1 for w in one["rollouts"])
    # the metrics every rank returns are the same; the losses are the single process's
    assert [r["loss"] for r in a0["rows"]] == [r["loss"] for r in a1["rows"]]
    for got, want in zip(a0["rows"], one["rows"]):
        assert got["phase"] == want["phase"] and "skipped" not in got
        for key in ("loss", "entropy", "kl", "clip_ratio", "grad_norm", "reward"):
            if key in want:
                # (an on-policy GRPO loss is a sum of O(1) terms that cancel to ~0: its rounding is ~1e-7 absolute)
                assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), (got["step"], key, got[key],
                                                                                        want[key])
    # (a GRPO loss is about 0 on-policy, its gradient is not)
    assert all(r["grad_norm"] > 1e-2 for r in one["rows"])
    # one optimizer step per batch, each with the single process's (summed, clipped) gradient
    assert len(a0["grads"]) == len(a1["grads"]) == len(one["grads"]) == STEPS
    grad_err = [_rel(g, w) for g, w in zip(a0["grads"], one["grads"])]
    assert grad_err[0] <= 1e-6 and max(grad_err) <= 2e-5, grad_err
    # the same weights on both ranks, bit for bit; equal to one process's
    assert all(torch.equal(a0["weights"][k], a1["weights"][k]) for k in a0["weights"])
    moved = _rel(_flat(one["weights"]), _flat(runs["init"]))
    err = _rel(_flat(a0["weights"]), _flat(one["weights"]))
    worst = max(_rel(a0["weights"][k], one["weights"][k]) for k in one["weights"]
                if (one["weights"][k] - runs["init"][k]).norm() > 0)
    of_update = ((_flat(a0["weights"]) - _flat(one["weights"])).norm()
                 / (_flat(one["weights"]) - _flat(runs["init"])).norm()).item()
    print(f"\n{run}, 1 vs 2 processes: weights moved {moved:.2e} from init; 2-rank weights off by {err:.2e} relative "
          f"({of_update:.2e} of the update), applied gradients off by {[f'{e:.1e}' for e in grad_err]} "
          f"(worst tensor {worst:.2e}); losses {[r['loss'] for r in one['rows']]} vs "
          f"{[r['loss'] for r in a0['rows']]}, "
          f"gradient norms {[r['grad_norm'] for r in one['rows']]} vs {[r['grad_norm'] for r in a0['rows']]}; "
          f"spawn + 2 runs {runs['t_two']:.1f} s")
    assert moved > 1e-2
    assert err <= WEIGHT_TOL[run]


def test_dead_rank_is_a_named_error_and_the_resume_continues_identically(runs):
    """Run B: rank 1 dies after step 2; rank 0 raises CollectiveError naming the collective, well within the timeout;
    step 2's checkpoint is intact. Resumed on 2 ranks (fresh processes), B's metrics and weights equal the
    uninterrupted run A's."""
    tmp = runs["tmp"]
    message, waited = runs["two"][0]["B_error"]
    assert "longstraw collective 'longstraw.capture: argument check' failed on rank 0 of 2" in message, message
    assert waited < TIMEOUT_S / 2
    print(f"\nrank 1 died after step 2: rank 0 raised {waited:.2f} s after step 2 ended: {message[:150]}")
    ckpt = tmp / "B" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step-2"
    assert json.loads((ckpt / "step-2" / "trainer_state.json").read_text())["world_size"] == 2
    assert (ckpt / "step-2" / "weights" / "adapter_model.safetensors").exists() and not list(ckpt.glob(".*tmp"))
    b0, b1 = (r["B"] for r in _spawn(tmp, "resume"))
    assert [r["step"] for r in b0["rows"]] == [STEPS]  # only step 3 was left
    assert all(torch.equal(b0["weights"][k], b1["weights"][k]) for k in b0["weights"])
    a = runs["two"][0]["A"]
    assert b0["rollouts"][0]["tokens"] == a["rollouts"][-1]["tokens"]
    rows_a = [json.loads(x) for x in (tmp / "A" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp / "B" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == list(range(1, STEPS + 1))  # rank 0 alone wrote, once per step
    for ra, rb in zip(rows_a, rows_b):
        for key in ("loss", "entropy", "kl", "grad_norm", "reward"):
            if key in ra:
                assert math.isclose(ra[key], rb[key], rel_tol=1e-6, abs_tol=1e-7), (ra["step"], key)
    assert max((b0["weights"][k] - a["weights"][k]).abs().max().item() for k in a["weights"]) <= 1e-6


def test_cli_nproc_2_end_to_end(tmp_path):
    """`longstraw train CONFIG --nproc 2`: two local ranks through torch's elastic launcher, full fine-tuning of a bf16
    model (float32 master weights, whose gradients are the ones summed); rank 0 alone writes metrics (one row per
    step), checkpoints, the model, eval.json and the report (after rank 0's export, which writes `dtype` and
    `architectures` into the model's config, the ranks' configs still agree for the final evaluation's collective
    capture)."""
    cfg = dict(model="llama", prompt_length=24, task_options={"num_pairs": 4, "num_values": 8}, num_generations=2,
               max_completion_length=2, num_steps=2, eval_examples=2, lora=False, progress=False, device="cpu",
               dtype="bf16")
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "longstraw", "train", str(path), "--output_dir", str(out),
                           "--nproc", "2", "--dist_timeout", "60"], capture_output=True, text=True, timeout=150,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 for r in rows)
    assert (out / "checkpoints" / "latest").read_text() == "step-2"
    assert json.loads((out / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "eval.json").read_text())["accuracy"]
    assert proc.stdout.count("held-out greedy accuracy") == 1, proc.stdout
    print(f"\nlongstraw train --nproc 2: {time.perf_counter() - t0:.1f} s")


SLOW_REWARD = '''
import time


def slow(prompts, completions, completion_ids, **kw):
    """Scored on rank 0 only; at step 2 it takes longer than the run's dist_timeout."""
    slow.calls += 1
    if slow.calls == 2:
        time.sleep(30)
    return [float(ids[0] % 2) for ids in completion_ids]


slow.calls = 0
'''


def test_cli_nproc_2_hung_rank_is_a_named_timeout(tmp_path):
    """A rank that stops answering (rank 0 stuck in a reward function at step 2): rank 1 raises after `dist_timeout`
    (3 s) naming the collective it waited in, the launcher stops rank 0, the command fails; step 1's checkpoint
    stays intact."""
    (tmp_path / "rewards.py").write_text(SLOW_REWARD)
    cfg = dict(model="llama", prompt_length=24, task_options={"num_pairs": 4, "num_values": 8}, num_generations=2,
               max_completion_length=2, num_steps=3, eval_examples=2, lora=True, progress=False,
               reward_funcs=[f"{tmp_path / 'rewards.py'}:slow"], dist_timeout=3)
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "run"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "longstraw", "train", str(path), "--output_dir", str(out),
                           "--nproc", "2"], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    waited = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("longstraw: error: longstraw collective 'rollout: rewards from rank 0: size' failed on rank 1 of 2"
            in proc.stderr), proc.stderr[-3000:]
    assert "longstraw: rank 1 of 2 failed first (exit code 3" in proc.stderr, proc.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text() == "step-1"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    print(f"\nhung rank 0: the command failed after {waited:.1f} s")

