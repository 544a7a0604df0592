"""Real loading code: `from_pretrained` on a local folder (saved first), plain and with a PEFT adapter."""

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import longstraw
from longstraw.model.oracles import full_sequence_logprobs

from .conftest import make_model, tokens
from .test_equivalence import FP32_GRAD_TOL

#: the loaded model's replay against the original's full-sequence forward, absolute: the fp32 bound (float32's
#: epsilon 1.19e-7 × 2^10), as tests/test_equivalence.py holds the replay of the model itself
LOGPROB_TOL = FP32_GRAD_TOL


def test_from_pretrained_local_folder(tmp_path):
    model = make_model("qwen3_next")
    model.save_pretrained(tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    prompt, response = tokens(21, 1), tokens(5, 2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        out = longstraw.capture(loaded, prompt, chunk_size=8).replay(response).logprobs
    assert (out - ref).abs().max().item() <= LOGPROB_TOL


def test_peft_adapter_round_trip(tmp_path):
    model = make_model("llama", use_lora=True)
    model.save_pretrained(tmp_path / "adapter")
    make_model("llama").save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    prompt, response = tokens(15, 3), tokens(4, 4)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        out = longstraw.capture(loaded, prompt, chunk_size=4).replay(response).logprobs
    assert (out - ref).abs().max().item() <= LOGPROB_TOL
