"""The device and dtype policy (`longstraw.train.devices`) and the trainer under it, on the CPU."""

import math

import pytest
import torch

from longstraw.train.config import TrainConfig
from longstraw.train.devices import resolve_device, resolve_dtype
from longstraw.train.precision import MasterWeights
from longstraw.train.trainer import Trainer

from ..conftest import full_and_resumed


def test_auto_resolves_to_the_cpu_in_float32_here():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    device = resolve_device("auto")
    assert device.type == "cpu" and resolve_dtype("auto", device) == torch.float32
    assert resolve_dtype("bf16", device) == torch.bfloat16
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("fp64", device)


def test_bf16_lora_run_keeps_adapters_and_accumulation_in_float32(tmp_path):
    """A bf16 model trains through two GRPO steps: finite loss and rewards, base weights bf16, adapter weights and
    their optimizer state float32."""
    cfg = TrainConfig(model="llama", output_dir=str(tmp_path / "run"), prompt_length=64, num_steps=2,
                      task_options={"num_pairs": 4, "num_values": 8}, num_generations=4, max_completion_length=2,
                      progress=False, threads=1, lora=True, train_embeddings=False, dtype="bf16")
    trainer = Trainer(cfg)
    rows = trainer.train()
    assert all(math.isfinite(r["loss"]) for r in rows)
    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    adapters = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    assert all(p.dtype == torch.bfloat16 for p in base)
    states = [s for s in trainer.opt.state.values() if "exp_avg" in s]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)


def test_trainable_fp16_weights_are_refused_bf16_ones_accepted():
    """fp16 gradients would need loss scaling (not done); bf16 weights train on float32 masters."""
    with pytest.raises(ValueError, match="loss scaling"):
        TrainConfig(model="llama", lora=False, dtype="fp16")
    with pytest.raises(ValueError, match="loss scaling"):
        TrainConfig(model="llama", lora=True, train_embeddings=True, dtype="fp16")
    TrainConfig(model="llama", lora=False, dtype="bf16")
    TrainConfig(model="llama", lora=True, train_embeddings=True, dtype="bf16")


def test_trainable_fp16_weights_from_auto_are_refused(tmp_path, monkeypatch):
    """`dtype: auto` resolves to fp16 on a GPU without bf16: the trainer refuses trainable fp16 weights then too."""
    monkeypatch.setattr("longstraw.train.build.resolve_dtype", lambda name, device: torch.float16)
    with pytest.raises(ValueError, match="loss scaling"):
        Trainer(TrainConfig(model="llama", output_dir=str(tmp_path / "run"), lora=False, progress=False))


def test_master_weights_accumulate_and_update_in_float32():
    """A bf16 parameter's gradients, accumulated over 64 backwards, equal their float32 sum (in bf16 the small
    ones are rounded away); updates of 2⁻¹² (below bf16's resolution at 1.0) add up in the master and reach the
    model once they amount to a bf16 step, and the model always holds the master rounded."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    masters = MasterWeights([w])
    (master,) = masters.params
    assert master.dtype == torch.float32 and torch.equal(master, w.float())
    expected = torch.zeros(4, dtype=torch.float64)
    for k in range(64):
        scale = 1.0 if k == 0 else 1e-3  # one large term, then many small ones
        (w * torch.full((4,), scale, dtype=torch.bfloat16)).sum().backward()
        expected += torch.tensor(scale, dtype=torch.bfloat16).double()
        assert w.grad is None
    # 63 float32 additions of positive terms, each rounding by at most half of float32's epsilon of the partial sum
    # (≤ the total)
    assert torch.allclose(master.grad.double(), expected, rtol=63 * torch.finfo(torch.float32).eps / 2, atol=0)
    in_bf16 = torch.tensor(1.0, dtype=torch.bfloat16)
    for _ in range(63):
        in_bf16 += torch.tensor(1e-3, dtype=torch.bfloat16)
    # what accumulating in bf16 would have given: each 1e-3 is below half of bf16's spacing at 1.0 (2⁻⁷ = 7.8e-3) and
    # rounds away, losing all of 0.063
    assert abs(in_bf16.item() - expected[0].item()) > 0.05

    opt = torch.optim.SGD(masters.params, lr=2.0**-12)
    master.grad = torch.ones(4)
    opt.step()
    masters.copy_to_model()
    assert torch.equal(w, torch.ones(4, dtype=torch.bfloat16)) and master[0].item() == 1 - 2.0**-12
    for _ in range(15):
        opt.step()
        masters.copy_to_model()
    assert master[0].item() == 1 - 16 * 2.0**-12 and torch.equal(w, master.bfloat16()) and w[0].item() < 1
    masters.remove()
    w.sum().backward()
    assert w.grad is not None


def _bf16_full_cfg(tmp_path, name, **kw):
    return TrainConfig(model="llama", output_dir=str(tmp_path / name), prompt_length=24, num_steps=4,
                       task_options={"num_pairs": 4, "num_values": 8}, num_generations=4, max_completion_length=2,
                       prompts_per_step=2, eval_examples=4, progress=False, threads=1, learning_rate=1e-2, lora=False,
                       sft_warmup_steps=2, dtype="bf16", **kw)


def test_bf16_full_fine_tuning_steps_on_float32_masters(tmp_path):
    """Full fine-tuning of a bf16 model: weights stay bf16, each the rounding of its float32 master; gradients and
    AdamW state float32; supervised and GRPO steps move the weights."""
    trainer = Trainer(_bf16_full_cfg(tmp_path, "run"))
    before = [p.detach().clone() for p in trainer.params]
    rows = trainer.train()
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert [r["phase"] for r in rows] == ["sft", "sft", "grpo", "grpo"]
    assert all(p.dtype == torch.bfloat16 for p in trainer.params)
    assert len(trainer.masters.pairs) == len(trainer.params)
    for p, master in trainer.masters.pairs:
        assert master.dtype == torch.float32 and torch.equal(p, master.bfloat16())
    states = [s for s in trainer.opt.state.values() if "exp_avg" in s]
    assert len(states) == len(trainer.params) and all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.params))


def test_bf16_full_fine_tuning_resumes_exactly(tmp_path):
    """Interrupted after step 2 and resumed, a bf16 run ends with the masters (saved in the checkpoint, not
    re-read from the rounded weights) and weights of the uninterrupted run."""
    full, resumed = full_and_resumed(lambda name: Trainer(_bf16_full_cfg(tmp_path, name)))
    assert resumed.step == 4
    for (pa, ma), (pb, mb) in zip(full.masters.pairs, resumed.masters.pairs):
        assert torch.equal(pa, pb) and torch.equal(ma, mb)
