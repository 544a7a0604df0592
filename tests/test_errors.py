"""Bad input gets a clear error."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import longstraw
from longstraw.errors import UnsupportedArchitectureError
from longstraw.testing.models import tiny_model

from .conftest import tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_unservable_architecture_names_the_class_and_the_tested_families():
    """GPT-2's attention does not go through a cache layer longstraw can replace (no `layers` stack)."""
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        longstraw.capture(gpt2, tokens(5, 0, 64))


@pytest.mark.parametrize(
    "prompt,exc,match",
    [
        pytest.param(torch.zeros(2, 5, dtype=torch.long), ValueError, "1-D", id="batch-of-2"),
        pytest.param(torch.zeros(5), TypeError, "integer", id="float-ids"),
        pytest.param(torch.zeros(0, dtype=torch.long), ValueError, "empty", id="empty"),
        pytest.param(torch.tensor([1, 2, 256]), ValueError, "outside", id="out-of-vocab"),
        pytest.param(torch.tensor([1, -1]), ValueError, "outside", id="negative"),
    ],
)
def test_bad_prompt_ids(model, prompt, exc, match):
    with pytest.raises(exc, match=match):
        longstraw.capture(model, prompt)


def test_bad_response_ids(model):
    state = longstraw.capture(model, tokens(5, 0))
    with pytest.raises(ValueError, match="empty"):
        state.replay(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        state.replay(torch.tensor([300]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param({"prompt_grad": "sometimes"}, "prompt_grad", id="prompt-grad"),
        pytest.param({"chunk_size": 0}, "chunk_size", id="chunk-0"),
        pytest.param({"chunk_size": 2.5}, "chunk_size", id="chunk-float"),
        pytest.param({"block_size": -1}, "block_size", id="block"),
        pytest.param({"state_device": "cuda"}, "state_device", id="state-device-not-host"),
    ],
)
def test_bad_options(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        longstraw.capture(model, tokens(5, 0), **kwargs)


def test_model_on_the_meta_device_or_split_is_refused(model):
    with torch.device("meta"):
        empty = tiny_model("llama")
    with pytest.raises(ValueError, match="meta device"):
        longstraw.capture(empty, tokens(5, 0))
    half = tiny_model("llama")
    half.lm_head.to("meta")  # the nearest thing to a model split over devices on a machine with one
    with pytest.raises(ValueError, match="meta"):
        longstraw.capture(half, tokens(5, 0))


def test_host_state_on_a_cpu_model_changes_nothing(model):
    prompt, response = tokens(9, 1), tokens(4, 2)
    with torch.no_grad():
        a = longstraw.capture(model, prompt, chunk_size=4).replay(response).logprobs
        b = longstraw.capture(model, prompt, chunk_size=4, state_device="cpu").replay(response).logprobs
    assert torch.equal(a, b)


def test_prompt_longer_than_the_model_supports():
    short = tiny_model("qwen3", max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        longstraw.capture(short, tokens(17, 0))
    state = longstraw.capture(short, tokens(12, 0))
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        state.replay(tokens(5, 1))


def test_attention_dropout_is_refused_in_training():
    m = tiny_model("llama", attention_dropout=0.1).train()
    with pytest.raises(NotImplementedError, match="dropout"):
        longstraw.capture(m, tokens(5, 0)).replay(tokens(3, 1))


def test_model_works_normally_after_an_error_inside_a_replay():
    """An error raised inside the model's forward (attention dropout, refused in the split attention after the
    replay named the longstraw attention on the model's config) leaves the model as it was: its own attention
    implementation, and the same logits as before."""
    m = tiny_model("llama", attention_dropout=0.1)
    ids = tokens(9, 1)[None]
    with torch.no_grad():
        before = m(input_ids=ids).logits
    state = longstraw.capture(m, tokens(5, 0))
    m.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        state.replay(tokens(3, 1))
    m.eval()
    assert m.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, before)


def test_capture_reports_progress_per_chunk(model):
    """`progress(done, total)` after each chunk: 10 captured tokens in chunks of 4 → 4, 8, 10."""
    calls = []
    longstraw.capture(model, tokens(11, 1), chunk_size=4, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(4, 10), (8, 10), (10, 10)]
    with pytest.raises(TypeError, match="progress"):
        longstraw.capture(model, tokens(11, 1), progress="yes")


def test_state_keeps_no_view_of_the_callers_prompt(model):
    """Dropping the prompt frees it: the state holds a copy of its last token, not a view of the whole prompt."""
    prompt = tokens(40, 3)
    state = longstraw.capture(model, prompt, chunk_size=16)
    assert state.last_token.untyped_storage().data_ptr() != prompt.untyped_storage().data_ptr()
    assert state.last_token.untyped_storage().nbytes() == 8
