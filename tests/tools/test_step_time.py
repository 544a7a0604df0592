"""`longstraw plan`'s time prediction: its arithmetic against the model's own modules and a plain count, its rates
measured once and cached, and what `longstraw plan` prints."""

import json

import pytest
import torch

from longstraw.model.observe import observe_attention
from longstraw.testing.models import tiny_model
from longstraw.tools.planner import PlanConfig
from longstraw.tools.step_time import Rates, calibrate, keys_seen, linear_per_token, predict_time, published_rates

DENSE = ["llama", "qwen3", "gemma3_text"]


def _linear_weights(model) -> int:
    """The decoder layers' nn.Linear weights, counted on the model."""
    layers = model.get_decoder().layers
    return sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))


def _naive_keys(model, first: int, last: int) -> int:
    """Σ over layers and queries first..last − 1 of the keys each query reads, from the windows the layers' attention
    modules were observed to pass (None: every earlier key)."""
    calls = observe_attention(model)
    total = 0
    for i in range(model.config.num_hidden_layers):
        window = calls[i].sliding_window
        for p in range(first, last):
            total += p + 1 if window is None else min(p + 1, window)
    return total


@pytest.mark.parametrize("arch", DENSE)
def test_linear_weights_and_keys_equal_the_models(arch):
    """A token's linear weights equal the decoder's nn.Linear weights counted on the model; the keys its queries read
    equal a plain count over the windows the model's attention modules pass (Gemma 3's sliding layers), from position
    0 and from past the window."""
    model = tiny_model(arch)
    cfg = model.config
    assert linear_per_token(cfg) == _linear_weights(model)
    window = getattr(cfg, "sliding_window", None) or 0
    for first, last in [(0, 40), (3, 7), (window + 5, window + 30), (0, window + 9)]:
        assert keys_seen(cfg, first, last) == _naive_keys(model, first, last), (first, last)


def test_stage_times_are_the_counted_products_at_the_given_rates():
    """With rates of 1 GFLOP/s for products and attention and 1 GB/s for memory, each stage's seconds are its FLOPs
    and bytes as counted on the model (linear weights, the keys each query reads) over those rates."""
    model = tiny_model("gemma3_text")
    cfg = model.config
    lin, h, vocab = _linear_weights(model), cfg.hidden_size, cfg.vocab_size
    q_width = cfg.num_attention_heads * cfg.head_dim
    rates = Rates({s: 1e9 for s in ("capture", "sample", "replay")}, {s: 1e9 for s in ("capture", "sample", "replay")},
                  1e9, 1e9, "test")
    p, g, r, q = 300, 4, 8, 2
    pc = PlanConfig(cfg, p, num_generations=g, completion_length=r, dtype="fp32", replay_batch=4)
    t = predict_time(pc, rates, questions=q, recapture_every=3, steps=5)
    assert t.capture == pytest.approx((2 * lin * p + 4 * q_width * _naive_keys(model, 0, p)) / 1e9, rel=1e-12)
    rows = q * g
    pairs = rows * _naive_keys(model, p, p + r)
    from longstraw.tools.planner import plan

    state = plan(pc).durable_state
    sample = (2 * lin * rows * r + 2 * h * vocab * rows * r + 4 * q_width * pairs + r * state) / 1e9
    assert t.sample == pytest.approx(sample, rel=1e-12)
    replay = (4 * lin * rows * r + 6 * h * vocab * rows * r + 10 * q_width * pairs + 2 * 2 * state) / 1e9
    assert t.replay == pytest.approx(replay, rel=1e-12)
    assert t.step == pytest.approx(t.capture / 3 + t.sample + t.replay + t.optimizer)
    assert t.run == pytest.approx(5 * t.step)
    # a decode of more than GEMM_MAX_ROWS query rows per key head runs another kernel: its attention at `sample_wide`
    from longstraw.ops.kernels.gemm import GEMM_MAX_ROWS

    wide = Rates(rates.matmul, {**rates.attention, "sample_wide": 2e9}, 1e9, 1e9, "test")
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    assert predict_time(pc, wide, questions=q).sample == pytest.approx(t.sample, rel=1e-12)  # 8 rows: gemm_cpu's
    many = GEMM_MAX_ROWS // (group * g) + 1  # questions enough to pass GEMM_MAX_ROWS rows per key head
    at_one, at_two = (predict_time(pc, x, questions=many).sample for x in (rates, wide))
    pairs = many * g * _naive_keys(model, p, p + r)
    assert at_one - at_two == pytest.approx(4 * q_width * pairs * (1 / 1e9 - 1 / 2e9), rel=1e-9)


def test_rates_are_measured_once_and_cached(tmp_path, monkeypatch):
    """The first call measures positive rates; the second, for the same widths and threads, reads them back."""
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    first = calibrate("llama", "fp32", keys=1024)
    assert all(v > 0 for v in [*first.matmul.values(), *first.attention.values(), first.copy])
    assert first.measured and len(list((tmp_path / "rates").glob("*.json"))) == 1
    assert calibrate("llama", "fp32", keys=1024) == first
    with pytest.raises(ValueError, match="positive rate"):
        Rates({"capture": 1.0}, first.attention, 1.0, 1.0, "x")


def test_plan_prints_the_times_and_a_gpu_estimate_labelled(tmp_path, monkeypatch, capsys):
    """`longstraw plan --Q --recapture-every --steps` adds the stages' times; `--gpu h100` labels them an estimate
    from published peak rates, and its step is shorter than this machine's prediction by far."""
    from longstraw.cli import main

    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    argv = ["plan", "gemma3_text", "--P", "2048", "--G", "4", "--R", "8", "--Q", "2", "--recapture-every", "4",
            "--steps", "10", "--dtype", "fp32"]

    def run(*extra):
        capsys.readouterr()
        assert main(argv + list(extra)) == 0
        return capsys.readouterr().out

    here = json.loads(run("--json"))["time"]
    gpu = json.loads(run("--json", "--gpu", "h100"))["time"]
    assert here["estimate"] is False and gpu["estimate"] is True and "published" in gpu["rates"]
    assert here["run"] == pytest.approx(10 * here["step"]) and gpu["step"] < here["step"] / 100
    text = run("--gpu", "h100")
    assert "estimate from published peak rates" in text and "run (10 steps)" in text
    assert published_rates("h100").measured is False


def test_overheads_add_per_token_step_and_row_and_are_measured_on_the_models_code():
    """Measured overheads add their seconds per prompt token, decode step, decode step and row, and replayed token to
    the products' time; `measure_overheads` measures them on the model itself (here a tiny llama from its config),
    non-negative and finite."""
    from dataclasses import replace

    from longstraw.testing.models import tiny_config
    from longstraw.tools.step_time import measure_overheads

    cfg = tiny_model("gemma3_text").config
    every = {s: 1e9 for s in ("capture", "sample", "replay")}
    bare = Rates(every, dict(every), 1e9, 1e9, "test")
    o = {"capture": 1e-3, "decode_step": 2e-3, "decode_row": 3e-5, "replay": 5e-4, "question": 7e-2}
    pc = PlanConfig(cfg, 300, num_generations=4, completion_length=8, dtype="fp32", row_suffix=5)
    plain, more = predict_time(pc, bare, questions=2), predict_time(pc, replace(bare, overheads=o), questions=2)
    assert more.capture - plain.capture == pytest.approx(300 * 1e-3)
    assert more.sample - plain.sample == pytest.approx(8 * (2e-3 + 8 * 3e-5) + 2 * 5 * 1e-3 + 2 * 7e-2)
    assert more.replay - plain.replay == pytest.approx(8 * 8 * 5e-4)
    got = measure_overheads("llama", tiny_config("llama"), "fp32", bare)
    assert set(got) == set(o) and all(0 <= v < 1 for v in got.values())


def test_rates_measured_on_a_busy_machine_are_said_so_and_not_cached(tmp_path, monkeypatch):
    """A calibration whose process got a fraction of its threads' CPU time (here: none, the CPU clock held still)
    labels its rates as measured on a busy machine and leaves nothing in the cache."""
    import longstraw.tools.step_time as step_time

    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    monkeypatch.setattr(step_time.time, "process_time", lambda: 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rates = calibrate("llama", "fp32", keys=1024)
    finally:
        torch.set_num_threads(threads)
    assert "busy machine" in rates.source
    assert not list((tmp_path / "rates").glob("*.json"))
