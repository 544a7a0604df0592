"""The trainer with FSDP2 (`fsdp: true`) on 2 processes: gloo, 1 thread each, against one unsharded process.

One spawn of 2 ranks runs three trainings with the decoder layers sharded:
- "lora": run A of tests/test_distributed_trainer.py (a supervised full-sequence step, then 2 GRPO steps with a
  KL term; LoRA), interrupted after step 2 and resumed from its sharded checkpoint by a fresh trainer;
- "full": full fine-tuning in fp32 with exact prompt gradients (the state's reverse pass is the step's last
  backward) and a replayed supervised step;
- "bf16": full fine-tuning of a bf16 model, one supervised step of 3 prompts (one rank pads its batch with a row of
  weight 0): the layers' shards are float32 masters.
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

from longstraw.checkpoint import CheckpointError
from longstraw.trainer import Trainer

from .conftest import spawn_ranks
from .test_distributed_trainer import _cfg, _flat, _rel, _train

TIMEOUT_S = 60
#: each run's differences from run A's config (`_cfg`)
RUNS = {
    "lora": {},
    "full": dict(lora=False, prompts_per_step=1, num_generations=4, sft_full_sequence=False, prompt_grad="exact",
                 beta=0.0),
    "bf16": dict(lora=False, dtype="bf16", beta=0.0, num_steps=1, prompts_per_step=3),  # 3 prompts: one rank pads
}


class _Stop(Exception):
    pass


def _stop_after_2(m):
    if m["step"] == 2:
        raise _Stop


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
        if name == "lora":
            with pytest.raises(_Stop):
                _train(out, dict(fsdp=True, **kw), on_step=_stop_after_2)
        trainer = Trainer(_cfg(out, fsdp=True, **kw))
        layout = _layout(trainer)
        del trainer
        result[name] = dict(_train(out, dict(fsdp=True, **kw)), layout=layout)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-train")
    spawn_ranks(_worker, (2, str(tmp / "init"), str(tmp)), 2,
                ["torch", "torch.distributed", "transformers", "peft", "longstraw", "longstraw.trainer",
                 "longstraw.distributed", "transformers.models.llama.modeling_llama"], 4 * TIMEOUT_S, "fsdp runs")
    two = [torch.load(tmp / f"rank{r}.pt") for r in range(2)]
    torch.set_num_threads(1)
    one = {}
    for name, kw in RUNS.items():
        torch.manual_seed(0)
        init = {k: v.detach().clone() for k, v in Trainer(_cfg(str(tmp / f"init-{name}"), **kw)).model
                .named_parameters() if v.requires_grad}
        one[name] = dict(_train(str(tmp / f"one-{name}"), kw), init=init)
    return dict(tmp=tmp, two=two, one=one)


#: final weights, sharded 2 ranks vs 1 process, relative (fp32; as tests/test_distributed_trainer.py's WEIGHT_TOL:
#: AdamW's first update turns gradient rounding near its eps into 1e-5 of the update)
WEIGHT_TOL = {"lora": 1e-5, "full": 1e-4}


@pytest.mark.parametrize("name", ["lora", "full"])
def test_sharded_trainer_trains_like_one_process(runs, name):
    """Sharded layers (each rank 1/2 of their elements; LoRA's adapters and full fine-tuning alike): the losses and
    gradient norms of every step equal one process's (1e-5), the applied gradients at each step within 1e-6 / 2e-5
    (first / later), the final weights within `WEIGHT_TOL` and bit-identical on the two ranks; "lora" resumed from
    its sharded checkpoint after step 2 (its rows after the resume are step 3's only)."""
    one, (r0, r1) = runs["one"][name], (runs["two"][0][name], runs["two"][1][name])
    lay = r0["layout"]
    assert lay["whole"] > 0 and lay["local"] * 2 == lay["whole"] and lay["dtypes"] == ["torch.float32"], lay
    steps = [r["step"] for r in r0["rows"]]
    assert steps == ([3] if name == "lora" else [1, 2, 3])
    want_rows = {r["step"]: r for r in one["rows"]}
    for got in r0["rows"]:
        want = want_rows[got["step"]]
        assert got["world_size"] == 2 and "skipped" not in got
        for key in ("loss", "kl", "grad_norm", "reward", "entropy"):
            if key in want:
                # (an on-policy GRPO loss is a sum of O(1) terms that cancel to ~0: its rounding is ~1e-7 absolute)
                assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), (got["step"], key, got[key],
                                                                                        want[key])
    grad_err = [_rel(g, w) for g, w in zip(r0["grads"], one["grads"][-len(r0["grads"]):])]
    assert max(grad_err) <= (2e-5 if name == "lora" else 1e-6 if len(grad_err) == 1 else 2e-5), grad_err
    assert grad_err[0] <= (2e-5 if name == "lora" else 1e-6), grad_err
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    moved = _rel(_flat(one["weights"]), _flat(one["init"]))
    err = _rel(_flat(r0["weights"]), _flat(one["weights"]))
    print(f"\nfsdp {name}: weights moved {moved:.2e}, sharded 2 ranks vs 1 process {err:.2e}; applied gradients "
          f"{[f'{e:.1e}' for e in grad_err]}; sharded elements per rank {lay['local']} of {lay['whole']}, "
          f"replicated {lay['replicated']}")
    assert moved > 1e-3 and err <= WEIGHT_TOL[name]


def test_bf16_full_fine_tuning_shards_float32_masters(runs):
    """bf16 full fine-tuning with sharded layers: their shards are float32 (the masters), computed in bf16; the first
    step's summed gradient equals one process's (bf16 model, float32 master gradients) within bf16's rounding."""
    got, want = runs["two"][0]["bf16"], runs["one"]["bf16"]
    assert got["layout"]["dtypes"] == ["torch.float32"] and got["layout"]["local"] * 2 == got["layout"]["whole"]
    err = _rel(got["grads"][0], want["grads"][0])
    print(f"\nfsdp bf16: first-step gradient vs one process {err:.1e}; loss {got['rows'][0]['loss']:.6f} vs "
          f"{want['rows'][0]['loss']:.6f}")
    assert err <= 5e-3
    assert math.isclose(got["rows"][0]["loss"], want["rows"][0]["loss"], rel_tol=1e-3)


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
    with pytest.raises(CheckpointError, match="written with fsdp .* resume it with fsdp: true on as many"):
        Trainer(_cfg(str(tmp / "lora"))).train()
