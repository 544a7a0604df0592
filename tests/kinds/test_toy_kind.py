"""A layer kind added by writing only its own class: `PackedKVState`, full attention whose durable state keeps keys and
values in one buffer `[1, Hkv, P − 1, D + Dv]` (another layout than `KVState`'s two), with its byte formula, its branch
view (an `AttentionBranchLayer` over views of the buffer) and its commit. Nothing else in the package names it.

The test serves the tiny llama's "full_attention" layers with it (the kind registered for the test only) and holds
capture + replay, sampling and detached gradients to the unmodified model, and `nbytes` to its own formula; a variant
with keys and values swapped in the buffer is refused by the same checks (the checks can fail)."""

from __future__ import annotations

import pytest
import torch

import longstraw
import longstraw.kinds.base as kind_base
from longstraw.kinds import AttentionBranchLayer, LayerState, register_layer_kind, state_bytes
from longstraw.kinds.base import grown_bytes, layer_config
from longstraw.model.oracles import full_sequence_logprobs
from longstraw.self_check import check

from ..conftest import make_model, tokens
from ..test_equivalence import FP32_GRAD_TOL, FP32_LOGPROB_TOL


class PackedKVState(LayerState):
    """Prompt keys and values of a full-attention layer in one buffer `[1, Hkv, P − 1, D + Dv]`."""

    layer_types = ("full_attention",)
    uses_attention_interface = True
    grows_with_prompt = True
    appends_own_kv = True

    @classmethod
    def durable_bytes(cls, config, layer_idx: int, tokens: int, elem: int, state_dtype=None) -> int:
        c = layer_config(config, layer_idx)
        return grown_bytes(tokens, c.num_key_value_heads, 2 * c.head_dim, elem, None)

    def __init__(self, config, layer_idx: int, capacity: int):
        super().__init__(config, layer_idx, capacity)
        self.packed: torch.Tensor | None = None
        self.key_width = 0

    def views(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.packed is None:
            return None, None
        kept = self.packed[:, :, : self.length]
        return kept[..., : self.key_width], kept[..., self.key_width :]

    def branch(self, batch: int = 1) -> AttentionBranchLayer:
        k, v = self.views()
        return AttentionBranchLayer(k, v, self.length)

    def commit(self, branch_layer, n: int) -> None:
        k, v = branch_layer.keys, branch_layer.values
        if self.packed is None:
            self.key_width = k.shape[-1]
            self.packed = k.new_empty((*k.shape[:2], self.capacity, k.shape[-1] + v.shape[-1]))
        self.packed[:, :, self.length : self.length + n] = torch.cat([k, v], dim=-1)
        self.length += n

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.packed is None else [self.packed]

    def release(self) -> None:
        self.packed = None


class SwappedKVState(PackedKVState):
    """The same kind with a bug: the branch reads the keys as values and the values as keys."""

    def views(self):
        k, v = super().views()
        return v, k


@pytest.fixture
def serve_with(monkeypatch):
    """Serve "full_attention" with a kind class for one test (the registry restored after it)."""

    def serve(cls):
        monkeypatch.setattr(kind_base, "_KINDS", dict(kind_base._KINDS))
        register_layer_kind(cls)

    return serve


def test_a_kind_in_its_own_class_serves_the_model(serve_with):
    serve_with(PackedKVState)
    model = make_model("llama")
    prompt, response = tokens(19, 1), tokens(6, 2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=5, block_size=4) as state:  # the self-check runs too
            assert all(type(layer) is PackedKVState for layer in state.live_layers())
            out = state.replay(response).logprobs
            nbytes = state.nbytes
            greedy = state.sample(1, 5, temperature=0).tokens[0]
    assert (out - ref).abs().max().item() <= FP32_LOGPROB_TOL
    cfg = model.config
    assert nbytes == sum(state_bytes("full_attention", cfg, i, 18, 4) for i in range(cfg.num_hidden_layers))
    # greedy decoding from the packed state = the model's own greedy continuation
    with torch.no_grad():
        want = model.generate(prompt[None], max_new_tokens=5, do_sample=False, pad_token_id=0)[0, prompt.numel():]
    assert torch.equal(greedy[: want.numel()], want)


def test_a_kind_in_its_own_class_trains_like_the_model(serve_with):
    """Detached gradients of a replayed response (LoRA) against transformers' forward with the prompt's K/V as
    constants: `longstraw.model.oracles.cache_reference_logprobs`."""
    from longstraw.model.oracles import cache_reference_logprobs

    serve_with(PackedKVState)
    model = make_model("llama", use_lora=True)
    prompt, response = tokens(19, 3), tokens(6, 4)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(cache_reference_logprobs(model, prompt, response).sum(), params)
    with longstraw.capture(model, prompt, chunk_size=5, block_size=4) as state:
        got = torch.autograd.grad(state.replay(response).logprobs.sum(), params)
    flat_w, flat_g = torch.cat([w.flatten() for w in want]), torch.cat([g.flatten() for g in got])
    assert ((flat_g - flat_w).norm() / flat_w.norm()).item() <= FP32_GRAD_TOL


def test_the_checks_refuse_a_wrong_kind(serve_with):
    """The same checks on the buggy variant: its log-probs are far off the model's, and the self-check (run afresh,
    `longstraw.self_check.check`) refuses it while it passes the correct kind."""
    serve_with(SwappedKVState)
    model = make_model("llama")
    prompt, response = tokens(19, 1), tokens(6, 2)
    with torch.no_grad():
        ref = full_sequence_logprobs(model, prompt, response)
        with longstraw.capture(model, prompt, chunk_size=5, block_size=4, verify=False) as state:
            out = state.replay(response).logprobs
    assert (out - ref).abs().max().item() > 100 * FP32_LOGPROB_TOL
    assert not check(model).ok
    serve_with(PackedKVState)
    assert check(model).ok
