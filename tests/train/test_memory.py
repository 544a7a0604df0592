"""Step memory cannot read 0 for a step that allocated, on the second step as on the first."""

import torch

from longstraw.train.config import TrainConfig
from longstraw.train.memory import MemoryMeter
from longstraw.train.trainer import Trainer


def _allocate_and_free(n_small: int = 20000) -> None:
    xs = [torch.ones(256) for _ in range(n_small)]  # ~20 MiB of 1 KiB tensors: the allocator's heap, not mmap
    del xs


def test_meter_sees_a_repeated_allocation_every_time():
    """The trap: memory freed by step 1 stays resident, so "peak − RSS before" reads ~0 from step 2 on."""
    meter = MemoryMeter("cpu")
    seen = []
    for _ in range(3):
        meter.start_step()
        with meter.stage("replay"):
            _allocate_and_free()
        seen.append(meter.results()["mem_replay_mb"])
    assert all(s >= 10.0 for s in seen), seen


def test_every_grpo_step_reports_memory_per_stage(tmp_path):
    """Capture (the prompt state) and replay (one response's graph) allocate fresh memory every step. Sampling
    at this size fits in heap pages already resident (RSS cannot see it), so it is only required present."""
    cfg = TrainConfig(model="llama", output_dir=str(tmp_path / "run"), prompt_length=512, num_steps=3,
                      task_options={"num_pairs": 4, "num_values": 8}, num_generations=8, max_completion_length=8,
                      ignore_eos=True, progress=False, threads=1, lora=False)
    rows = Trainer(cfg).train()
    for r in rows:
        assert r["step_mem_mb"] > 0 and r["mem_capture_mb"] > 0 and r["mem_replay_mb"] > 0, r
        assert r["mem_sample_mb"] >= 0
        assert r["step_mem_mb"] == max(v for k, v in r.items() if k.startswith("mem_"))


def _tb_config(tmp_path, steps=2):
    return TrainConfig(model="llama", output_dir=str(tmp_path / "run"), prompt_length=24, num_steps=steps,
                       task_options={"num_pairs": 4, "num_values": 8}, num_generations=2, max_completion_length=1,
                       progress=False, threads=1, lora=False, report_to=["tensorboard"])


def test_report_to_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import pytest

    from longstraw.train import metrics

    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    with pytest.raises(ValueError, match="pip install tensorboard"):
        Trainer(_tb_config(tmp_path)).train()


def test_report_to_tensorboard_writes_the_metrics_of_every_step(tmp_path):
    """The event files (read back with tensorboard's own reader) hold each step's loss and reward as
    metrics.jsonl does."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = Trainer(_tb_config(tmp_path)).train()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    jsonl = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [r["step"] for r in rows] == [1, 2]
    for key, tag in (("loss", "grpo/loss"), ("reward", "reward")):
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == [1, 2]
        assert [e.value for e in scalars] == pytest_approx([r[key] for r in jsonl])


def pytest_approx(values):
    import pytest

    # TensorBoard keeps a scalar in float32: a metric rounds once, by at most half of float32's epsilon relative;
    # below float32's smallest normal (1.2e-38) it keeps less precision, and absolute
    return pytest.approx(values, rel=torch.finfo(torch.float32).eps / 2, abs=torch.finfo(torch.float32).tiny)
