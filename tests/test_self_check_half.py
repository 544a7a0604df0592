"""The half-precision self-check: two signals, both against a float32 copy of the same weights.

Two correct bf16 paths differ from each other by about as much as either differs from float32, so the check holds
longstraw's bf16 error to `HALF_FACTOR` × transformers' own (tests/test_bf16.py measures the same rule on 512 tokens),
and runs longstraw's capture and replay of the float32 copy at the float32 tolerances, where a misread prompt state
cannot hide in the rounding. It must pass correct models, real ones included, and refuse, at its default settings, a
model whose prompt state is read wrongly: a prompt read one token shifted, a sliding window that keeps one key too
few, a layer whose state is lost.
"""

import contextlib

import pytest
import torch

import longstraw
from longstraw import self_check
from longstraw.kinds.sliding_window import SlidingKVState
from longstraw.testing.models import tiny_model

from .conftest import lora

#: the plants: what a wrong capture looks like to the replay that reads it
PLANTS = ("shift", "window", "layer")


@contextlib.contextmanager
def planted(monkeypatch, plant: str):
    """Inside the block the check's captures are wrong in one way: `shift`, the prompt read one token shifted (a lost
    or doubled chunk); `window`, sliding-window layers keep one key fewer than the next token reads (an off-by-one at
    the window's edge); `layer`, the middle decoder layer's state zeroed (a layer whose state is dropped)."""
    real = self_check.capture_local
    with monkeypatch.context() as m:
        if plant == "shift":
            m.setattr(self_check, "capture_local", lambda model, prompt, **kw: real(model, torch.roll(prompt, 1), **kw))
        elif plant == "window":
            m.setattr(SlidingKVState, "_keep", lambda self: self.window - 2)
        else:

            def dropped(model, prompt, **kw):
                state = real(model, prompt, **kw)
                for t in state.layers[len(state.layers) // 2].tensors():
                    t.zero_()
                return state

            m.setattr(self_check, "capture_local", dropped)
        yield


@pytest.mark.parametrize("arch,use_lora", [("llama", False), ("llama", True), ("qwen3_next", False)],
                         ids=["llama", "llama-lora", "qwen3_next"])
def test_bf16_check_passes_a_correct_model(arch, use_lora):
    model = tiny_model(arch, dtype=torch.bfloat16)
    model = lora(model) if use_lora else model
    was_training = model.training
    report = longstraw.check(model)
    assert report.ok, str(report)
    assert report.half is not None and report.response_length == self_check.HALF_RESPONSE
    ls, hf = report.half["longstraw"], report.half["transformers"]
    assert ls[0] <= self_check.HALF_FACTOR * hf[0] + report.half["eps"]
    assert report.float32_error is not None and report.float32_error <= self_check.FULL_TOLERANCE
    assert report.float32_grad_error is not None and report.float32_grad_error <= self_check.GRAD_TOLERANCE
    # the model's weights, dtype and mode are untouched by the float32 copy
    assert next(model.parameters()).dtype == torch.bfloat16 and model.training == was_training


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("plant", PLANTS)
def test_half_check_refuses_a_misread_state_at_the_default_settings(monkeypatch, plant, dtype):
    """Each plant refused at the check's default prompt (512 tokens, past the window of 5), on a tiny model with
    sliding and full layers, and by the float32 signal on its own (its log-prob error over `FULL_TOLERANCE`)."""
    model = tiny_model("gemma3_text", dtype=dtype)
    with planted(monkeypatch, plant):
        report = longstraw.check(model)
    assert not report.ok, str(report)
    assert report.prompt_length == self_check.MIN_CHECK_PROMPT and report.covers_windows
    assert report.float32_error > self_check.FULL_TOLERANCE, str(report)
    assert report.first_bad_layer is not None


def test_float32_signal_catches_what_the_half_bound_lets_through(monkeypatch):
    """The case the half-precision bound alone misses: on a tiny random llama (near-uniform attention) a one-token
    shift at the default 512 tokens moves the bf16 log-probs by less than the bound allows (one bf16 rounding is part
    of it), so without gradients only the float32 signal can refuse it — and does, at 70× its tolerance (measured:
    7.4e-3 against 1e-4)."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    with planted(monkeypatch, "shift"):
        report = longstraw.check(model, gradients=False)
    assert not report.ok, str(report)
    h = report.half
    half_alone = (h["longstraw"][0] <= self_check.HALF_FACTOR * h["transformers"][0] + h["eps"]
                  and h["longstraw"][1] <= self_check.HALF_FACTOR * h["transformers"][1] + h["eps"])
    assert half_alone, f"the half bound alone now refuses the shift: {report}"
    assert report.float32_error > 10 * self_check.FULL_TOLERANCE, str(report)


def test_float32_check_refuses_a_shift():
    """The float32 check (no half-precision signal) refuses a one-token shift at its default settings."""
    with pytest.MonkeyPatch.context() as m, planted(m, "shift"):
        report = longstraw.check(tiny_model("llama"))
    assert not report.ok and report.float32_error is None and report.logprob_error > self_check.FULL_TOLERANCE


#: the real models in bf16, and the plants each can show (SmolLM2 has no sliding window: its `window` plant would
#: change nothing)
REAL_CASES = [("smollm2", p) for p in ("none", "shift", "layer")] + [("gemma3", p) for p in ("none", *PLANTS)]


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize("name,plant", REAL_CASES, ids=[f"{n}-{p}" for n, p in REAL_CASES])
def test_bf16_check_on_the_real_models(request, monkeypatch, name, plant):
    """SmolLM2-135M-Instruct and Gemma 3 270M in bf16 at the default settings: the correct model passes (its float32
    signal within the float32 tolerances), each plant is refused, by the float32 signal at least. Measured: the
    correct models' float32 signal 2.9e-5 (SmolLM2) and 4.0e-5 (Gemma 3) against 1e-4; Gemma 3's window plant
    moves the bf16 log-probs by less than the half bound allows (0.28 against 0.35 nats at the 90th percentile) and
    the float32 copy's by 3.1e-3: only the float32 signal sees it."""
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(f"real_{name}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    if plant == "none":
        report = longstraw.check(model)
        print(f"\n{name} bf16: {report}")
        assert report.ok, str(report)
        return
    with planted(monkeypatch, plant):
        report = longstraw.check(model)
    print(f"\n{name} bf16, {plant}: {report}")
    assert not report.ok, str(report)
    assert report.float32_error > self_check.FULL_TOLERANCE
