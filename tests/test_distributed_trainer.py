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


class _Stopped(Exception):
    pass


def _train(out: str, cfg: dict | None = None, force: dict | None = None, stop_after: int | None = None,
           **kw) -> dict:
    """Train; record what each optimizer step applies and at which weights. `force` (step → flat weights, of a run
    recorded here) sets this single-process trainer's weights before that step, so that its gradient is taken at the
    weights another run had there: the two runs' gradients then differ only by their arithmetic's order.
    `stop_after` interrupts the run after that step (its checkpoint written) and returns what was recorded."""
    trainer = Trainer(_cfg(out, **(cfg or {})))
    seen = _recording(trainer)
    masters = lambda: torch.cat([_whole(p).flatten() for p in trainer.masters.params])  # noqa: E731
    start = masters()
    grads, lrs, at = [], [], []  # the summed gradient each optimizer step applies (after clipping), its lr, weights

    def record(opt, *args):
        grads.append(torch.cat([_whole(p.grad).flatten() for p in trainer.masters.params]))
        lrs.append(opt.param_groups[0]["lr"])
        at.append(masters())

    trainer.opt.register_step_pre_hook(record)
    on_step = kw.pop("on_step", None)

    done = []

    def set_weights(m):
        done.append(m)
        if force is not None and m["step"] + 1 in force:
            w, offset = force[m["step"] + 1], 0
            with torch.no_grad():
                for p in trainer.masters.params:
                    p.copy_(w[offset: offset + p.numel()].view_as(p))
                    offset += p.numel()
            trainer.masters.copy_to_model()
        if on_step is not None:
            on_step(m)
        if m["step"] == stop_after:
            raise _Stopped

    try:
        rows = trainer.train(on_step=set_weights, **kw)
    except _Stopped:
        rows = done
    return dict(rows=rows, rollouts=seen, weights=_weights(trainer), grads=grads, lrs=lrs, at=at, start=start,
                final=masters(), adam={k: trainer.opt.defaults[k] for k in ("betas", "eps", "weight_decay")})


def weights_at(run: dict) -> dict:
    """step → the flat weights at which `run` took that step's gradient (for `_train(force=...)`)."""
    return {row["step"]: w for row, w in zip(run["rows"], run["at"])}


EPS32 = torch.finfo(torch.float32).eps
#: what each optimizer step applies, N ranks vs 1 process at the same weights, relative: the same float32 sums in
#: another order (each rank's partial sums, then the all-reduce); a reordered sum of n terms errs by about √n · eps
#: (rounding as a random walk), and each gradient element here sums at most 256 terms (responses × tokens): 16 · eps
GRAD_TOL = 16 * EPS32
#: losses, rewards, entropies, KL and gradient norms, the same reordered sums of O(1) terms: GRAD_TOL, relative or,
#: for a sum that cancels to ~0 (an on-policy GRPO loss), absolute
METRIC_TOL = dict(rel_tol=GRAD_TOL, abs_tol=GRAD_TOL)


def replay_tol(run: dict) -> float:
    """`adamw_replay` vs the trainer's weights, relative: the same elementwise float32 AdamW arithmetic, so equal
    bit for bit (as measured) but for an element rounding differently per step where vector and scalar code differ."""
    return len(run["grads"]) * EPS32


def adamw_replay(run: dict) -> torch.Tensor:
    """The flat weights torch's AdamW reaches from `run`'s starting weights by the applied gradients and learning
    rates it recorded: what the trainer's optimizer must have done with them, on one tensor instead of its
    parameters (or their shards)."""
    w = run["start"].clone().requires_grad_(True)
    opt = torch.optim.AdamW([w], lr=run["lrs"][0], **run["adam"])
    for g, lr in zip(run["grads"], run["lrs"]):
        w.grad = g.clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
    return w.detach()


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
    # before each step, rank 0's weights: every step's gradient compared at the same weights
    one = dict(A=_train(str(tmp / "one-A"), force=weights_at(two[0]["A"])),
               X=_train(str(tmp / "one-X"), OTHER, force=weights_at(two[0]["X"])))
    return dict(tmp=tmp, two=two, one=one, init=init, t_two=t_two)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _flat(weights: dict) -> torch.Tensor:
    return torch.cat([w.flatten() for _, w in sorted(weights.items())])


@pytest.mark.parametrize("run", ["A", "X"])
def test_two_processes_train_like_one(runs, run):
    """2 ranks (context-parallel capture, replays spread, gradients all-reduced) = 1 process given the same weights
    before every step (`_train(force=...)`): the same sampled responses, rewards and advantages; losses and the
    other metrics within `METRIC_TOL`; the gradient each optimizer step applies within `GRAD_TOL` (the same sums in
    another order); the two ranks' weights bit-identical, and equal to torch's AdamW replayed over the applied
    gradients (`replay_tol`), so that the final weights follow from gradients each within its bound. (Compared with
    one process's final weights directly, they would measure AdamW's amplification: X's first step leaves many
    gradient elements near AdamW's eps, whose update g / (|g| + eps) turns their rounding into 2e-5 of the update.)
    Meaningful: the weights moved from their start by far more than the tolerance, the GRPO steps had non-zero
    advantages, and every step had a gradient."""
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
                assert math.isclose(got[key], want[key], **METRIC_TOL), (got["step"], key, got[key], want[key])
    # (a GRPO loss is about 0 on-policy, its gradient is not)
    assert all(r["grad_norm"] > 1e-2 for r in one["rows"])
    # one optimizer step per batch, each with the single process's (summed, clipped) gradient
    assert len(a0["grads"]) == len(a1["grads"]) == len(one["grads"]) == STEPS
    grad_err = [_rel(g, w) for g, w in zip(a0["grads"], one["grads"])]
    assert max(grad_err) <= GRAD_TOL, grad_err
    # the same weights on both ranks, bit for bit; what AdamW makes of the applied gradients
    assert all(torch.equal(a0["weights"][k], a1["weights"][k]) for k in a0["weights"])
    moved = _rel(_flat(a0["weights"]), _flat(runs["init"]))
    replay_err = _rel(a0["final"], adamw_replay(a0))
    print(f"\n{run}, 1 vs 2 processes: weights moved {moved:.2e} from init; applied gradients at the same weights "
          f"off by {[f'{e:.1e}' for e in grad_err]}; final weights vs AdamW over them {replay_err:.1e}; losses "
          f"{[r['loss'] for r in one['rows']]} vs {[r['loss'] for r in a0['rows']]}, gradient norms "
          f"{[r['grad_norm'] for r in one['rows']]} vs {[r['grad_norm'] for r in a0['rows']]}; "
          f"spawn + 2 runs {runs['t_two']:.1f} s")
    assert moved > 1e-2
    assert replay_err <= replay_tol(a0)


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
    # B resumed runs A's arithmetic in A's order on as many ranks from exactly saved float32 values (safetensors,
    # torch.save): equal up to the printing of metrics.jsonl (float32 values written as decimals: 8 · eps relative)
    for ra, rb in zip(rows_a, rows_b):
        for key in ("loss", "entropy", "kl", "grad_norm", "reward"):
            if key in ra:
                assert math.isclose(ra[key], rb[key], rel_tol=8 * EPS32, abs_tol=8 * EPS32), (ra["step"], key)
    assert all(torch.equal(b0["weights"][k], a["weights"][k]) for k in a["weights"])


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

