"""What the context-parallel capture runs a chunk of positions at a time (`longstraw.prepare`): recurrent decoder
layers (`_forward_in_chunks`) and feed-forward modules (`ChunkedFeedForward`), each against the same module run on
all positions at once. The distributed tests check the same end to end (log-probs unchanged, largest call a chunk)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

import longstraw
from longstraw.hf.parts import decoder_of
from longstraw.testing.models import tiny_model

prep = importlib.import_module("longstraw.model.prepare")  # the module (`longstraw.prepare` is also the function)

EPS = torch.finfo(torch.float32).eps
#: the recurrent layer in chunks against one call, relative (and absolute): each output is a running sum of ≤ 11
#: terms, the chunked one begun from the carried state: ≤ 11 roundings of ≤ eps/2 of the running sum apart, ≤ 2^3 eps
RECURRENT_TOL = EPS * 2**3
#: feed-forward modules in chunks of positions against one call: the same per-position arithmetic, but matrix
#: products over other row counts may block their sums differently: the gate / up products over the hidden size 64,
#: the down product over ≤ 128, the ≤ 3 experts' weighted sum: √(64 + 128 + 3) ≈ 14 ≤ 2^4 at random
FFN_TOL = EPS * 2**4


class _Recurrent(torch.nn.Module):
    """A decoder layer whose state is a running sum kept in the cache (as a linear-attention layer's), reading RoPE
    (cos, sin) and position ids per position."""

    def forward(self, hidden_states, position_embeddings=None, position_ids=None, cache=None, attention_mask=None):
        cos, sin = position_embeddings
        x = hidden_states * cos + sin + position_ids[..., None]
        out = cache.state + x.cumsum(dim=1)
        cache.state = out[:, -1:]
        cache.calls.append(hidden_states.shape[1])
        return out


def _inputs(t: int):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, t, 8, generator=g),
                position_embeddings=(torch.randn(1, t, 8, generator=g), torch.randn(1, t, 8, generator=g)),
                position_ids=torch.arange(5, 5 + t)[None])


def test_recurrent_layer_in_chunks_equals_one_call():
    """11 positions in chunks of 4: three calls of 4, 4, 3 positions, the state carried, per-position arguments
    sliced; the same output as one call over all 11."""
    layer, kw = _Recurrent(), _inputs(11)
    whole_cache = SimpleNamespace(state=torch.zeros(1, 1, 8), calls=[], past_length=0)
    want = layer(cache=whole_cache, **kw)
    cache = SimpleNamespace(state=torch.zeros(1, 1, 8), calls=[], past_length=7)
    hidden = kw.pop("hidden_states")
    got = prep._forward_in_chunks(layer.forward, 4, cache, (hidden,), dict(cache=cache, **kw))
    assert cache.calls == [4, 4, 3] and cache.past_length == 7
    torch.testing.assert_close(got, want, rtol=RECURRENT_TOL, atol=RECURRENT_TOL)


@pytest.mark.parametrize("extra", ["4-D mask", "positional", "unknown per-position tensor"])
def test_recurrent_layer_arguments_it_cannot_slice_run_whole(extra):
    """An argument that holds the positions in a way it does not slice: nothing runs in chunks (None)."""
    layer, kw = _Recurrent(), _inputs(11)
    cache = SimpleNamespace(state=torch.zeros(1, 1, 8), calls=[], past_length=0)
    hidden = kw.pop("hidden_states")
    args = (hidden,)
    if extra == "4-D mask":
        kw["attention_mask"] = torch.ones(1, 1, 11, 11, dtype=torch.bool)
    elif extra == "positional":
        args = (hidden, kw.pop("position_embeddings"))
    else:
        kw["router_bias"] = torch.zeros(1, 11)
    assert prep._forward_in_chunks(layer.forward, 4, cache, args, dict(cache=cache, **kw)) is None
    assert cache.calls == []


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v3", "gpt_oss"])
def test_feed_forward_in_chunks_equals_one_call(monkeypatch, arch):
    """Each decoder layer's feed-forward module (dense MLP, mixtures of experts, gpt-oss's (out, router scores))
    asked for chunks of 4 by the active cache: the same output as one call (fp32, ≤ `FFN_TOL`), run 4 positions at a
    time; without the request, one call."""
    model = tiny_model(arch)
    longstraw.prepare(model)
    seen = []
    mlp = decoder_of(model).layers[-1].mlp
    inner = next(m for m in mlp.modules() if m is not mlp)
    inner.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[-2]))
    x = torch.randn(1, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = mlp(x)
        whole = list(seen)
        seen.clear()
        monkeypatch.setattr(prep, "active_cache", lambda: SimpleNamespace(ffn_chunk=4))
        got = mlp(x)
    k = getattr(model.config, "num_experts_per_tok", 1)
    assert max(whole) > 4 * k and max(seen) <= 4 * k, (whole, seen)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    assert len(got) == len(want) == (2 if arch == "gpt_oss" else 1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=FFN_TOL, atol=FFN_TOL)
