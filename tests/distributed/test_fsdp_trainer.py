"""The trainer with FSDP2 (`fsdp: true`) on 2 processes: gloo, 1 thread each, against one unsharded process.

One spawn of 2 ranks runs four trainings with the decoder layers sharded:
- "lora": run A of tests/distributed/test_distributed_trainer.py (a supervised full-sequence step, then 2 GRPO steps with a
  KL term; LoRA), interrupted after step 2 and resumed from its sharded checkpoint by a fresh trainer;
- "full": full fine-tuning in fp32 with exact prompt gradients (the state's reverse pass is the step's last
  backward) and a replayed supervised step;
- "bf16": full fine-tuning of a bf16 model, one supervised step of 3 prompts (one rank pads its batch with a row of
  weight 0): the layers' shards are float32 masters;
- "agent": run Y (agent trajectories from an environment, LoRA), replayed in segments in lockstep.
The single-process references run in the test process; the tests compare losses, gradient norms, the applied
gradients and the final weights, and check what each rank held and what the checkpoints and the export hold.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from longstraw.train.checkpoint import CheckpointError
from longstraw.train.trainer import Trainer

from ..conftest import spawn_ranks
from .test_distributed_trainer import (
    AGENT,
    GRAD_TOL,
    METRIC_TOL,
    _cfg,
    _rel,
    _train,
    adamw_replay,
    replay_tol,
    weights_at,
)

TIMEOUT_S = 60
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7
#: each run's differences from run A's config (`_cfg`)
RUNS = {
    "lora": {},
    "full": dict(lora=False, prompts_per_step=1, num_generations=4, sft_full_sequence=False, prompt_grad="exact",
                 beta=0.0),
    "bf16": dict(lora=False, dtype="bf16", beta=0.0, num_steps=1, prompts_per_step=3),  # 3 prompts: one rank pads
    # agent trajectories replayed in segments (the default), the ranks in lockstep: the step's last backward (where
    # gradient reduction is turned on) is the last slot's, the same on every rank
    "agent": AGENT,
}


def _layout(trainer) -> dict:
    """What this rank holds of the trainable parameters: sharded elements here / in all, dtypes of the shards."""
    from longstraw.distributed.fsdp import is_sharded

    sharded = [p for p in trainer.params if is_sharded(p)]
    return dict(local=sum(p.to_local().numel() for p in sharded), whole=sum(p.numel() for p in sharded),
                dtypes=sorted({str(p.dtype) for p in sharded}),
                replicated=sum(p.numel() for p in trainer.params if not is_sharded(p)))


def _worker(rank: int, n: int, init: str, out_dir: str):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft, as pyproject
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    result = {}
    for name, kw in RUNS.items():
        out = os.path.join(out_dir, name)
        first = _train(out, dict(fsdp=True, **kw), stop_after=2) if name == "lora" else None
        trainer = Trainer(_cfg(out, fsdp=True, **kw))
        layout = _layout(trainer)
        del trainer
        result[name] = dict(_train(out, dict(fsdp=True, **kw)), layout=layout, before_resume=first)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-train")
    spawn_ranks(_worker, (2, str(tmp / "init"), str(tmp)), 2,
                ["torch", "torch.distributed", "transformers", "peft", "longstraw", "longstraw.train.trainer",
                 "longstraw.distributed", "transformers.models.llama.modeling_llama"], 4 * TIMEOUT_S, "fsdp runs")
    two = [torch.load(tmp / f"rank{r}.pt") for r in range(2)]
    torch.set_num_threads(1)
    one = {}
    for name, kw in RUNS.items():
        torch.manual_seed(0)
        init = {k: v.detach().clone() for k, v in Trainer(_cfg(str(tmp / f"init-{name}"), **kw)).model
                .named_parameters() if v.requires_grad}
        # before each step, the sharded run's weights: every step's gradient compared at the same weights
        one[name] = dict(_train(str(tmp / f"one-{name}"), kw, force=weights_at(two[0][name])), init=init)
    return dict(tmp=tmp, two=two, one=one)


@pytest.mark.parametrize("name", ["lora", "full", "agent"])
def test_sharded_trainer_trains_like_one_process(runs, name):
    """Sharded layers (each rank 1/2 of their elements; LoRA's adapters and full fine-tuning alike) against one
    process given the same weights before every step (`_train(force=...)`): the same losses, gradient norms and
    applied gradients at every step (`METRIC_TOL`, `GRAD_TOL`: the same sums in another order); the final weights
    bit-identical on the two ranks and equal to torch's AdamW replayed over the applied gradients (`replay_tol`), so
    that the weights follow from gradients each within its bound. "lora" resumes from its sharded checkpoint after
    step 2 (its rows after the resume are step 3's only): the replay runs over the interrupted run's two steps and
    the resumed one's, so the checkpoint restored weights and AdamW's moments exactly. (Final weights compared with
    one process's directly would measure AdamW's amplification: its update g / (√v + eps) turns the rounding of
    gradient elements near eps into 1e-4 of full fine-tuning's weights.)"""
    one, (r0, r1) = runs["one"][name], (runs["two"][0][name], runs["two"][1][name])
    lay = r0["layout"]
    assert lay["whole"] > 0 and lay["local"] * 2 == lay["whole"] and lay["dtypes"] == ["torch.float32"], lay
    steps = [r["step"] for r in r0["rows"]]
    assert steps == {"lora": [3], "agent": [1, 2]}.get(name, [1, 2, 3])
    want_rows = {r["step"]: r for r in one["rows"]}
    for got in r0["rows"]:
        want = want_rows[got["step"]]
        assert got["world_size"] == 2 and "skipped" not in got
        for key in ("loss", "kl", "grad_norm", "reward", "entropy"):
            if key in want:
                assert math.isclose(got[key], want[key], **METRIC_TOL), (got["step"], key, got[key], want[key])
    grad_err = [_rel(g, w) for g, w in zip(r0["grads"], one["grads"][-len(r0["grads"]):])]
    assert max(grad_err) <= GRAD_TOL, grad_err
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    chain = r0
    if name == "lora":
        first = r0["before_resume"]
        assert [r["step"] for r in first["rows"]] == [1, 2] and len(first["grads"]) == 2
        chain = dict(first, grads=first["grads"] + r0["grads"], lrs=first["lrs"] + r0["lrs"])
    replay_err = _rel(r0["final"], adamw_replay(chain))
    moved = _rel(r0["final"], chain["start"])
    print(f"\nfsdp {name}: weights moved {moved:.2e}; applied gradients vs one process at the same weights "
          f"{[f'{e:.1e}' for e in grad_err]}; final weights vs AdamW over them {replay_err:.1e}; sharded elements "
          f"per rank {lay['local']} of {lay['whole']}, replicated {lay['replicated']}")
    assert moved > 1e-3 and replay_err <= replay_tol(chain)


def test_bf16_full_fine_tuning_shards_float32_masters(runs):
    """bf16 full fine-tuning with sharded layers: their shards are float32 (the masters), computed in bf16; the first
    step's summed gradient equals one process's (bf16 model, float32 master gradients) within bf16's rounding."""
    got, want = runs["two"][0]["bf16"], runs["one"]["bf16"]
    assert got["layout"]["dtypes"] == ["torch.float32"] and got["layout"]["local"] * 2 == got["layout"]["whole"]
    err = _rel(got["grads"][0], want["grads"][0])
    print(f"\nfsdp bf16: first-step gradient vs one process {err:.1e}; loss {got['rows'][0]['loss']:.6f} vs "
          f"{want['rows'][0]['loss']:.6f}")
    # each gradient element is rounded to bf16 once more on either side (a rank's half of the batch, the padded
    # batch's other shapes): at most bf16's epsilon relative (2 × eps / 2; measured 2.1e-3)
    assert err <= BF16_EPS
    # each token's log-prob carries one bf16 rounding of its logits (≤ eps / 2) where the batch shapes differ, and
    # the loss averages at least 16 of them: eps / 2 / √16
    assert math.isclose(got["rows"][0]["loss"], want["rows"][0]["loss"], rel_tol=BF16_EPS / 8)


def test_sharded_checkpoint_and_export(runs):
    """The sharded checkpoint: whole trainable weights (equal to the final weights) and one optimizer file per rank,
    `fsdp` and `world_size` recorded; rank 0's export (from the checkpoint into a model of its own) holds the final
    weights; a run without fsdp refuses to resume it, naming why."""
    from safetensors.torch import load_file

    tmp, final = runs["tmp"], runs["two"][0]["lora"]["weights"]
    ckpt = tmp / "lora" / "checkpoints" / "step-3"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optimizer-rank0.pt", "optimizer-rank1.pt", "optimizer.pt",
                                                      "trainer_state.json", "weights"]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["fsdp"] is True and state["world_size"] == 2 and state["step"] == 3
    saved = load_file(ckpt / "weights" / "trainable.safetensors")
    assert sorted(saved) == sorted(final) and all(torch.equal(saved[k], final[k]) for k in final)
    exported = load_file(tmp / "lora" / "adapter" / "adapter_model.safetensors")
    assert len(exported) == len(final)
    for k, v in final.items():  # (PEFT renames the adapter's tensors in its files)
        assert sum(torch.equal(e, v) for e in exported.values() if e.shape == v.shape) == 1, k
    with pytest.raises(CheckpointError, match="written with fsdp .* resume it alike on as many"):
        Trainer(_cfg(str(tmp / "lora"))).train()
