"""The half-precision self-check: longstraw's and transformers' bf16 both against a float32 copy of the same weights.

Two correct bf16 paths differ from each other by more than either differs from float32, so the check holds
longstraw's error to `HALF_FACTOR` × transformers' own (tests/test_bf16.py measures the same rule on 512 tokens).
It must pass correct models, real ones included, and still refuse a model whose prompt state is read wrongly.
"""

import pytest
import torch

import longstraw
from longstraw import self_check
from longstraw.testing.models import tiny_model
from longstraw.model.oracles import full_sequence_logprobs

from .conftest import lora


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
    # the model's weights, dtype and mode are untouched by the float32 copy
    assert next(model.parameters()).dtype == torch.bfloat16 and model.training == was_training


def test_bf16_check_refuses_a_misread_prompt_state(monkeypatch):
    """A capture that reads the prompt shifted by one token (the kind of error a wrong window or a lost chunk
    makes) is refused in bf16, as it is in fp32."""
    real = self_check.capture_local

    def shifted(model, prompt, **kw):
        return real(model, torch.roll(prompt, 1), **kw)

    monkeypatch.setattr(self_check, "capture_local", shifted)
    # 24 tokens: a tiny random model attends almost uniformly, so a one-token shift of the default 512-token check
    # prompt moves its log-probs by 1.7e-3 on average (measured), under one bf16 rounding (7.8e-3, part of the bound);
    # over 24 tokens by 1.4e-2 (the fp32 check refuses both: 4.9e-2 and 3.4e-3 max against its 1e-4)
    for dtype in (torch.float32, torch.bfloat16):
        report = longstraw.check(tiny_model("llama", dtype=dtype), gradients=False, prompt_length=24)
        assert not report.ok, str(report)


@pytest.mark.real
def test_bf16_check_passes_the_real_model(real_smollm2):
    """SmolLM2-135M-Instruct in bf16: the check passes, and shows why a fixed bound between the two bf16 paths cannot
    work — transformers' bf16 and longstraw's differ from each other by more than the old 0.05 nats."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_smollm2, dtype=torch.bfloat16).eval()
    report = longstraw.check(model, gradients=False)
    assert report.ok, str(report)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (report.prompt_length,), generator=gen)
    response = torch.randint(0, model.config.vocab_size, (report.response_length,), generator=gen)
    with torch.no_grad():
        hf = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=report.chunk_size, verify=False) as st:
            ls = st.replay(response).logprobs
    between = (hf - ls).abs().max().item()
    print(f"\nSmolLM2 bf16: {report}\n  transformers vs longstraw bf16: max {between:.3f} nats")
    assert between > 0.05
