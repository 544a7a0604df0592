"""The trainer on N processes (`longstraw.distributed.ranks`): gloo, 2 processes of 1 thread.

One spawn of 2 ranks (forkserver, `file://` rendezvous, as tests/distributed/test_distributed.py) trains run A for 3 steps (a
full-sequence supervised step, split over the ranks, then 2 GRPO steps of 2 prompts with G = 3 responses each, so
rank 1 pads its replays, the 2 prompts two questions of one document (a shared prefix captured once, each row's
question read into a branch), prompts recaptured for the update, beta > 0: reference log-probs) and run X (a replayed
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

from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

from ..conftest import spawn_ranks

TIMEOUT_S = 60  # the group's collective timeout; each spawn must finish within 2 × this
STEPS = 3


def token_reward(prompts, completions, completion_ids, **kw) -> list[float]:
    """A dense reward (the first token id mod 5), so that every GRPO group has non-zero advantages."""
    return [(ids[0] % 5) / 4 for ids in completion_ids]


#: run X's differences from A
OTHER = dict(prompts_per_step=1, num_generations=4, sft_full_sequence=False, prompt_grad="exact", beta=0.0,
             rows_per_context=None)


#: run D's differences from A: two groups of one rank (data parallel), 3 prompts of a step in 2 contexts (the first
#: two rows share a document): rank 0 takes the shared context, rank 1 the other
DATA = dict(context_parallel=1, prompts_per_step=3)


class CountingEnv:
    """tests.agent.test_agent's lookup environment, counting the instances this process made."""

    made = 0

    def __init__(self):
        from ..agent.test_agent import LookupEnv

        type(self).made += 1
        self.inner = LookupEnv()

    def reset(self, **columns):
        return self.inner.reset(**columns)

    def lookup(self, key: str) -> str:
        """Look a key up."""
        return self.inner.lookup(key)

    def get_reward(self) -> float:
        return self.inner.get_reward()


#: run Y: agent trajectories (multi-turn, tool replies) from an environment, 2 GRPO steps of 2 prompts, G = 3
AGENT = dict(prompt_length=12, num_steps=2, sft_warmup_steps=0, max_completion_length=160, max_turns=4,
             max_turn_tokens=3, max_tool_tokens=64, environment=f"{__name__}:CountingEnv",
             tool_parser="tests.agent.test_agent:parse_keys",
             reward_funcs=["environment_reward", "tests.agent.test_agent:length_reward"])


def _cfg(out: str, **kw) -> TrainConfig:
    base = dict(model="llama", output_dir=out, prompt_length=24, task_options={"num_pairs": 4, "num_values": 8},
                reward_funcs=[f"{__name__}:token_reward"],
                num_steps=STEPS, num_generations=3, max_completion_length=2, prompts_per_step=2, eval_examples=2,
                progress=False, threads=1, learning_rate=1e-2, beta=0.05, lora=True, sft_warmup_steps=1,
                dist_timeout=TIMEOUT_S, rows_per_context=2, min_shared_prefix=4)
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
                         advantages=r.advantages.clone(), extra=[x.extra for x in r.responses]))
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
                groups=(trainer.parallel.groups.index, trainer.parallel.groups.count, trainer.parallel.context.size),
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
    if scenario == "agent":  # run Y (segment_replay unset: on), then whole replays at Y's weights
        import longstraw.replay.segments as trajectory

        carried = trajectory._replay_carried
        calls = []

        def counted(*args, **kw):  # observes that the ranks replayed in segments
            calls.append(1)
            return carried(*args, **kw)

        trajectory._replay_carried = counted
        result = dict(Y=_train(os.path.join(out_dir, "Y"), AGENT), made=CountingEnv.made, segmented=len(calls))
        calls.clear()
        result["Y_whole"] = _train(os.path.join(out_dir, "Y-whole"), {**AGENT, "segment_replay": False},
                                   force=weights_at(result["Y"]))
        result["whole_segmented"] = len(calls)
        torch.save(result, path)
        dist.destroy_process_group()
        return
    if scenario == "data":  # context_parallel: 1: each rank takes whole prompts of the step, its own contexts
        torch.save(dict(D=_train(os.path.join(out_dir, "D"), DATA),
                        Z=_train(os.path.join(out_dir, "Z"), {**AGENT, **DATA, "rows_per_context": None})), path)
        dist.destroy_process_group()
        return
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
                ["torch", "torch.distributed", "transformers", "peft", "longstraw", "longstraw.train.trainer",
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
    # run A's two rows of a step ask two questions of one document: captured once, each row's question read into a
    # branch on every rank (sampling, detached replays, reference log-probs), as in one process
    shared = [r.get("prompt_shared_frac") for r in a0["rows"] if r["phase"] == "grpo"]
    assert shared == [r.get("prompt_shared_frac") for r in one["rows"] if r["phase"] == "grpo"]
    assert all(0.4 < f < 0.5 for f in shared) if run == "A" else all(f == 0 for f in shared), shared  # 1 − 1/Q at most
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


def test_two_processes_grow_agent_trajectories_like_one(tmp_path):
    """Run Y, agent trajectories through an environment, on 2 ranks = 1 process given the same weights before each
    step: the same trajectories (policy turns and tool replies, every rank growing them on collective branches over
    the context-parallel prompt), the same per-trajectory columns, rewards and advantages, the gradient each step
    applies within `GRAD_TOL`. The environment exists on rank 0 only (rank 1 made none). `segment_replay` at its
    default on both (on: the ranks replay their trajectories' segments in lockstep, each rank its own trajectories,
    of other lengths and turn counts than the other rank's); the same run with `segment_replay: false` (whole
    replays) at the same weights applies the same gradients."""
    two = _spawn(tmp_path, "agent")
    y0, y1 = two[0]["Y"], two[1]["Y"]
    one = _train(str(tmp_path / "one-Y"), AGENT, force=weights_at(y0))  # segment_replay at its default: on
    assert len(one["rollouts"]) == 2
    assert any(e["tool_calls"] > 0 for w in one["rollouts"] for e in w["extra"]), "no tool was called"
    for got in (y0["rollouts"], y1["rollouts"]):
        assert [g["tokens"] for g in got] == [w["tokens"] for w in one["rollouts"]]
        assert [g["extra"] for g in got] == [w["extra"] for w in one["rollouts"]]
        for g, w in zip(got, one["rollouts"]):
            assert torch.allclose(g["rewards"], w["rewards"]) and torch.allclose(g["advantages"], w["advantages"])
    assert all(w["advantages"].abs().max() > 0.1 for w in one["rollouts"])
    # the step's two rows share their document: each trajectory starts from the shared state + its row's question
    assert all(r["prompt_shared_frac"] > 0.2 for r in y0["rows"]), [r["prompt_shared_frac"] for r in y0["rows"]]
    grad_err = [_rel(g, w) for g, w in zip(y0["grads"], one["grads"])]
    assert len(grad_err) == 2 and max(grad_err) <= GRAD_TOL, grad_err
    assert all(torch.equal(y0["weights"][k], y1["weights"][k]) for k in y0["weights"])
    trajectories = 2 * 2 * 3
    assert (two[0]["made"], two[1]["made"]) == (trajectories, 0)
    # both ranks replayed in segments (every response of theirs and the padding), whole replays did not
    assert two[0]["segmented"] == two[1]["segmented"] >= trajectories // 2, (two[0]["segmented"], two[1]["segmented"])
    assert two[0]["whole_segmented"] == two[1]["whole_segmented"] == 0
    whole_err = [_rel(g, w) for g, w in zip(two[0]["Y_whole"]["grads"], y0["grads"])]
    assert len(whole_err) == 2 and max(whole_err) <= GRAD_TOL, whole_err
    print(f"\nagent run, 1 vs 2 processes (segments): applied gradients off by {[f'{e:.1e}' for e in grad_err]}; "
          f"2 processes whole vs segments {[f'{e:.1e}' for e in whole_err]}")


def test_data_parallel_groups_train_like_one(tmp_path):
    """`context_parallel: 1` on 2 processes: each rank captures, samples and replays its own contexts of the step whole
    (no collective inside), the ranks exchange their rows, the gradients are summed over both. Run D (A's config, 3
    prompts in 2 contexts) and run Z (agent trajectories, 3 contexts: rank 0 takes two, rank 1 one; each rank's
    environments its own) = 1 process given the same weights before every step: the same responses, rewards and
    advantages on both ranks, the losses and the applied gradient within the bounds of `test_two_processes_train_like_one`."""
    two = _spawn(tmp_path, "data")
    for run, cfg in (("D", DATA), ("Z", {**AGENT, **DATA, "rows_per_context": None})):
        got0, got1 = two[0][run], two[1][run]
        assert (got0["groups"], got1["groups"]) == ((0, 2, 1), (1, 2, 1))
        one_cfg = {k: v for k, v in cfg.items() if k != "context_parallel"}
        one = _train(str(tmp_path / f"one-{run}"), one_cfg, force=weights_at(got0))
        assert one["rollouts"] and all(w["advantages"].abs().max() > 0.1 for w in one["rollouts"])
        for got in (got0["rollouts"], got1["rollouts"]):
            assert [g["tokens"] for g in got] == [w["tokens"] for w in one["rollouts"]]
            assert [g["extra"] for g in got] == [w["extra"] for w in one["rollouts"]]
            for g, w in zip(got, one["rollouts"]):
                assert torch.allclose(g["rewards"], w["rewards"]) and torch.allclose(g["advantages"], w["advantages"])
        for a, b in zip(got0["rows"], one["rows"]):
            assert a["phase"] == b["phase"] and "skipped" not in a
            for key in ("loss", "kl", "grad_norm", "reward"):
                if key in b:
                    assert math.isclose(a[key], b[key], **METRIC_TOL), (run, a["step"], key, a[key], b[key])
        grad_err = [_rel(g, w) for g, w in zip(got0["grads"], one["grads"])]
        assert len(grad_err) == len(one["grads"]) and max(grad_err) <= GRAD_TOL, (run, grad_err)
        assert all(torch.equal(got0["weights"][k], got1["weights"][k]) for k in got0["weights"])
        print(f"\n{run}, 1 process vs 2 groups of 1: applied gradients off by {[f'{e:.1e}' for e in grad_err]}")


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
               reward_funcs=[f"{tmp_path / 'rewards.py'}:slow"], dist_timeout=3,
               eval_at_start=False)  # (the reward counts its calls: the first two are steps 1 and 2)
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



# ---------------------------------------------------------------------------------------------- two torchrun agents
TINY_REWARD = ("def dense(prompts, completions, completion_ids, **kw):\n"
               "    return [(ids[0] % 5) / 4 for ids in completion_ids]\n")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """`pid` and its live descendants (from /proc). torchrun starts each rank in a session of its own, so killing an
    agent's process group leaves its ranks running: they are found here, before anything is killed."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def _kill_trees(pids: list[int]) -> None:
    """SIGKILL each process and its process group (agents and torchrun's ranks are the leaders of their own)."""
    import signal

    for p in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(p, signal.SIGKILL)
            except OSError:
                pass


class _TwoAgents:
    """`torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d -m longstraw train CFG --output_dir OUT`, twice on
    this machine, as on two machines. Agent 0 alone hosts the rendezvous store (`is_host=true`, started first; agent 1
    starts once it listens, `is_host=false`): with both on localhost each would otherwise try to host it and the one
    that loses falls back to a client, and a rendezvous port taken meanwhile by another process would be joined
    silently. Output goes to files (two pipes read one after the other can fill and stall a process); `finish` waits
    with a hard timeout and, past it, kills both agents and all their ranks and fails with their stderr."""

    def __init__(self, tmp_path, cfg_path, out, tag: str):
        self.logs = []
        self.procs = []
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        for attempt in range(3):  # the free port may be taken before agent 0 binds it: it then exits, try another
            port = _free_port()
            self._start(0, port, tmp_path, cfg_path, out, f"{tag}-{attempt}", env)
            if self._listening(port):
                break
            _kill_trees(_tree(self.procs[0].pid))
            self.procs[0].wait()
        else:
            pytest.fail(f"agent 0 never hosted the rendezvous store: {self.stderr(0)[-2000:]}")
        self._start(1, port, tmp_path, cfg_path, out, f"{tag}-{attempt}", env)

    def _start(self, k, port, tmp_path, cfg_path, out, rdzv_id, env):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", rdzv_id,
               "--rdzv-conf", f"is_host={'true' if k == 0 else 'false'},join_timeout=60",
               "-m", "longstraw", "train", str(cfg_path), "--output_dir", str(out)]
        log = tmp_path / f"agent{k}-{rdzv_id}.log"
        self.logs[k:] = [log]
        with open(log, "w") as f:
            self.procs[k:] = [subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True)]

    def _listening(self, port: int, timeout_s: float = 60) -> bool:
        import socket

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.procs[0].poll() is None:
            try:
                socket.create_connection(("localhost", port), timeout=0.5).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def stderr(self, k: int) -> str:
        return self.logs[k].read_text(errors="replace")

    def pids(self) -> list[int]:
        return [q for p in self.procs for q in _tree(p.pid)]

    def finish(self, timeout_s: float, procs=None) -> list[int]:
        """Wait for the agents (all, or `procs`) to exit; past `timeout_s` kill everything and fail."""
        procs = self.procs if procs is None else procs
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        if any(p.poll() is None for p in procs):
            running = self.pids()
            _kill_trees(running)
            for p in self.procs:
                p.wait()
            pytest.fail(f"agents still running after {timeout_s} s (killed: {running}); their output:\n" +
                        "\n".join(f"--- agent {k}\n{self.stderr(k)[-3000:]}" for k in range(len(self.procs))))
        return [p.returncode for p in procs]


def _two_node_cfg(tmp_path, steps: int, **kw):
    (tmp_path / "rewards.py").write_text(TINY_REWARD)
    cfg = dict(model="llama", prompt_length=24, task_options={"num_pairs": 4, "num_values": 8},
               num_generations=3, max_completion_length=2, num_steps=steps, eval_examples=2, lora=True,
               progress=False, device="cpu", fsdp=True, dist_timeout=60,
               reward_funcs=[f"{tmp_path / 'rewards.py'}:dense"])
    cfg.update(kw)
    path = tmp_path / f"cfg{steps}.yaml"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.slow
def test_torchrun_two_nodes_with_fsdp_and_resume(tmp_path):
    """Two torchrun agents of one process each joining through the c10d rendezvous (`--nnodes 2`, as on two machines;
    both on this one), training with sharded layers (`fsdp: true`): one process group of 2 ranks (`world_size` 2 in
    every row), a sharded checkpoint, one metrics writer; the same commands with `num_steps` 3 resume at step 3. Each
    launch has 90 s (it takes about 13 s alone on 2 cores): past that both agents and their ranks are killed."""
    out = tmp_path / "run"

    def launch(steps: int) -> None:
        agents = _TwoAgents(tmp_path, _two_node_cfg(tmp_path, steps), out, f"two-nodes-{steps}")
        codes = agents.finish(90)
        assert codes == [0, 0], [agents.stderr(k)[-2000:] for k in range(2)]

    t0 = time.perf_counter()
    launch(2)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 for r in rows)
    assert any(r["grad_norm"] > 1e-3 for r in rows)
    ckpt = out / "checkpoints" / "step-2"
    assert (ckpt / "optimizer-rank0.pt").exists() and (ckpt / "optimizer-rank1.pt").exists()
    assert json.loads((ckpt / "trainer_state.json").read_text())["fsdp"] is True
    launch(3)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (out / "checkpoints" / "latest").read_text() == "step-3" and (out / "adapter").is_dir()
    print(f"\ntwo torchrun nodes (c10d rendezvous, fsdp), 2 steps then resumed to 3: {time.perf_counter() - t0:.1f} s")


def test_torchrun_two_nodes_dead_agent_is_an_error(tmp_path):
    """One of two torchrun agents SIGKILLed (its process group) after step 1's metrics row: its rank, which torchrun
    started in a session of its own and so survives it, stops (`longstraw.distributed.ranks.watch_launcher`); the other rank
    fails in its next collective, naming it, and the other agent exits non-zero, within `dist_timeout` (10 s) + 20 s.
    Before, the orphaned rank trained on, and the other agent, its rank done, waited 300 s in torch's exit barrier for
    the dead agent, then exited 0."""
    dist_timeout = 10
    out = tmp_path / "run"
    cfg = _two_node_cfg(tmp_path, 40, dist_timeout=dist_timeout, eval_at_start=False)
    agents = _TwoAgents(tmp_path, cfg, out, "dead-agent")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.exists() and metrics.read_text().strip()):
        if time.monotonic() > deadline or any(p.poll() is not None for p in agents.procs):
            agents.finish(0)  # fails with their output (or kills them)
            pytest.fail(f"no metrics row: {[agents.stderr(k)[-2000:] for k in range(2)]}")
        time.sleep(0.05)
    victim = _tree(agents.procs[1].pid)  # agent 1 and its rank
    assert len(victim) == 2, victim
    import signal

    t0 = time.monotonic()
    os.killpg(agents.procs[1].pid, signal.SIGKILL)  # the agent's process group: the agent alone, not its rank
    (code,) = agents.finish(dist_timeout + 20, procs=agents.procs[:1])
    waited = time.monotonic() - t0
    agents.finish(5)
    log0, log1 = agents.stderr(0), agents.stderr(1)
    assert code != 0, log0[-3000:]
    named = [line for line in log0.splitlines() if "longstraw: error: " in line and " failed on rank " in line
             and ("longstraw collective '" in line or "torch.distributed " in line)]
    assert named, log0[-3000:]  # the collective it waited in: longstraw's, or FSDP2's in a sharded layer
    assert f"its launcher (torchrun agent, pid {agents.procs[1].pid}) died; this rank stops" in log1, log1[-3000:]
    assert not [p for p in victim if os.path.exists(f"/proc/{p}") and _zombie(p) is False], victim
    rows = metrics.read_text().splitlines()
    assert 1 <= len(rows) < 40
    print(f"\none agent killed at step {len(rows)}: the other exited {code} after {waited:.1f} s: {named[0][:300]}")


def _zombie(pid: int) -> bool | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return None


def test_torch_collective_failure_is_named(tmp_path, monkeypatch):
    """A failure inside torch's own collectives (here the gradient norm's all-reduce, raising as gloo does when the
    peer's connection closes) is reported naming the torch.distributed call and where longstraw was
    (`longstraw.distributed.ranks.torch_collective_failure`, which `longstraw train` prints, exit status 3); other errors are
    left alone."""
    import torch.distributed.distributed_c10d as c10d

    from longstraw.distributed.fsdp import clip_grad_norm
    from longstraw.distributed.ranks import torch_collective_failure

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")

    def closed(*args, **kw):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    allreduce = c10d.ProcessGroup.allreduce
    try:
        c10d.ProcessGroup.allreduce = closed
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        with pytest.raises(RuntimeError) as err:
            clip_grad_norm([p], 1.0)
    finally:
        c10d.ProcessGroup.allreduce = allreduce
        dist.destroy_process_group()
    what = torch_collective_failure(err.value)
    assert what.startswith("torch.distributed all_reduce failed on rank 1 of 2 in distributed/fsdp.py:"), what
    assert what.endswith(" (clip_grad_norm) (RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
                         "[127.0.0.1]:1: Connection reset by peer)"), what
    assert torch_collective_failure(RuntimeError("not a collective")) is None
