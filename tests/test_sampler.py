"""Shared-prefix sampler: log-probs equal replay, greedy equals transformers' generate, seeds reproduce."""

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

import longstraw
from longstraw.sampler import filter_logits, sample

from .conftest import ARCHS, make_model, tokens
from .test_equivalence import FP32_GRAD_TOL

#: the sampler's log-probs against the replay's, absolute (two paths through the same state: a token per forward in
#: a batch of sequences, the response in one forward): the fp32 bound, float32's epsilon (1.19e-7) × 2^10
LOGPROB_TOL = FP32_GRAD_TOL

STOPS = list(range(0, 256, 5))  # ~20% of the vocabulary: sequences stop at different steps


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_logprobs_equal_replay(arch, use_lora=False):
    model = make_model(arch, use_lora)
    state = longstraw.capture(model, tokens(21, 1), chunk_size=6)
    out = state.sample(5, 9, temperature=0.9, top_p=0.95, top_k=100, stop_token_ids=STOPS,
                       generator=torch.Generator().manual_seed(3))
    assert len(out.tokens) == len(out.logprobs) == 5 and out.truncated.shape == (5,)
    for tok, lp, trunc in zip(out.tokens, out.logprobs, out.truncated):
        assert tok.shape == lp.shape and 1 <= tok.numel() <= 9
        assert bool(trunc) == (int(tok[-1]) not in STOPS)
        assert not any(int(t) in STOPS for t in tok[:-1])
        with torch.no_grad():
            ref = state.replay(tok, temperature=0.9).logprobs
        assert (ref - lp).abs().max().item() <= LOGPROB_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate(arch):
    model = make_model(arch)
    prompt = tokens(19, 4)
    with torch.no_grad():
        ref = model.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref[0, prompt.numel():]
    state = longstraw.capture(model, prompt, chunk_size=7)
    out = state.sample(3, 12, temperature=0)
    for tok in out.tokens:
        assert torch.equal(tok, ref)
    assert out.truncated.all()
    # stop at the greedy token of step 5 (or its first occurrence)
    stop = int(ref[5])
    first = int((ref == stop).nonzero()[0])
    out = state.sample(2, 12, temperature=0, stop_token_ids=[stop])
    assert torch.equal(out.tokens[0], ref[: first + 1]) and not out.truncated[0]
    # greedy log-probs are at temperature 1
    with torch.no_grad():
        assert (state.replay(out.tokens[0]).logprobs - out.logprobs[0]).abs().max() <= LOGPROB_TOL


def test_reproducible_from_a_seed():
    state = longstraw.capture(make_model("qwen3_next"), tokens(15, 5))
    a = state.sample(4, 8, generator=torch.Generator().manual_seed(11))
    b = state.sample(4, 8, generator=torch.Generator().manual_seed(11))
    c = state.sample(4, 8, generator=torch.Generator().manual_seed(12))
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert not all(torch.equal(x, y) for x, y in zip(a.tokens, c.tokens))


def test_sampling_leaves_the_state_untouched():
    model = make_model("qwen3_5_text")
    state = longstraw.capture(model, tokens(15, 6), chunk_size=4)
    before = [t.clone() for layer in state.layers for t in layer.tensors()]
    state.sample(3, 6, stop_token_ids=STOPS, generator=torch.Generator().manual_seed(0))
    after = [t for layer in state.layers for t in layer.tensors()]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("top_k,top_p", [(0, 0.7), (5, 1.0), (10, 0.5), (0, 1.0)])
def test_filters_match_transformers_warpers(top_k, top_p):
    z = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    ref = z.clone()
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(torch.isinf(filter_logits(z, top_k, top_p)), torch.isinf(ref))


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(num=0), "num"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
     (dict(top_p=0.0), "top_p"), (dict(top_k=1000), "top_k")],
)
def test_bad_sampling_options(kwargs, match):
    state = longstraw.capture(make_model("llama"), tokens(5, 0))
    args = dict(num=2, max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=match):
        state.sample(**args)


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa", "kimi_linear"])
def test_sampled_logprobs_equal_replay_under_lora(arch):
    """Latent attention reads a LoRA-wrapped `kv_b_proj` by applying it to the identity, once per branch when
    sampling (no grad) and per replay with grad: both agree."""
    test_sampled_logprobs_equal_replay(arch, use_lora=True)


def test_sliding_window_layers_keep_only_the_window_while_decoding(monkeypatch):
    """40 decode steps against window 5: sliding layers hold at most 4 own K/V per step (global layers keep all),
    and the result is unchanged: log-probs equal replay, greedy equals `generate`."""
    from longstraw.kinds import AttentionBranchLayer

    model = make_model("gemma3_text")
    window = model.config.sliding_window
    held = {"sliding": 0, "global": 0}
    update = AttentionBranchLayer.update

    def spy(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        if self.keys.shape[0] == 4:  # the sampler's batch (capture and replays run batch 1)
            kind = "sliding" if self.window is not None else "global"
            held[kind] = max(held[kind], self.keys.shape[-2])
        return out

    monkeypatch.setattr(AttentionBranchLayer, "update", spy)
    prompt = tokens(30, 1)
    state = longstraw.capture(model, prompt, chunk_size=7)
    out = state.sample(4, 40, generator=torch.Generator().manual_seed(3))
    assert held == {"sliding": window - 1, "global": 40}
    for tok, lp in zip(out.tokens, out.logprobs):
        with torch.no_grad():
            assert (state.replay(tok).logprobs - lp).abs().max().item() <= LOGPROB_TOL
    greedy = state.sample(1, 40, temperature=0).tokens[0]
    ref = model.generate(prompt[None], do_sample=False, max_new_tokens=40, min_new_tokens=40, eos_token_id=None,
                         pad_token_id=0)[0, 30:]
    assert torch.equal(greedy, ref)


def test_sampling_past_the_positions_is_refused_as_replay_refuses_it():
    """`sample` refuses a prompt (and prefix) + `max_new_tokens` past `max_position_embeddings` with the message
    `replay` gives for a response of that length; up to the limit it samples (24 + 8 = 32 positions)."""
    from longstraw.testing.models import tiny_model

    state = longstraw.capture(tiny_model("llama", max_position_embeddings=32), tokens(24, 1), chunk_size=8)
    with pytest.raises(ValueError, match=r"is 33 tokens but the model supports max_position_embeddings=32") as sampled:
        state.sample(2, 9)
    with pytest.raises(ValueError) as replayed:
        state.replay(tokens(9, 2))
    assert str(sampled.value) == str(replayed.value)
    with pytest.raises(ValueError, match=r"is 33 tokens"):
        sample(state, 2, 5, prefix_ids=tokens(4, 3))  # a turn after tool output: its prefix holds positions
    out = state.sample(2, 8, generator=torch.Generator().manual_seed(0))
    assert len(out.tokens) == 2 and all(1 <= t.numel() <= 8 for t in out.tokens)


def _chi_square_bound(df: int, z: float = 5.0) -> float:
    """The chi-square statistic that `df` degrees of freedom exceed with probability ≈ Φ(−z) (z = 5: 3e-7), by the
    Wilson–Hilferty cube-root normal approximation (accurate to a few percent of the bound at df ≥ 10)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a**0.5) ** 3


def _assert_drawn_as_weighted(chosen: torch.Tensor, w: torch.Tensor) -> None:
    """No token of weight 0 among `chosen`, and the others' counts pass Pearson's chi-square test against `w` at
    p = 3e-7 (`_chi_square_bound`)."""
    counts = torch.bincount(chosen, minlength=w.numel()).double()
    assert counts[w == 0].sum() == 0
    expected = chosen.numel() * w.double() / w.double().sum()
    on = w > 0
    stat = float(((counts[on] - expected[on]) ** 2 / expected[on]).sum())
    assert stat <= _chi_square_bound(int(on.sum()) - 1), stat


@pytest.mark.parametrize("draw", ["inverse_transform", "multinomial"])
def test_a_draw_follows_its_weights(draw):
    """200,000 tokens drawn from one row of weights spread over four orders of magnitude, with zeros (banned or
    filtered tokens): no token of weight 0, and the counts of the others pass Pearson's chi-square test at
    p = 3e-7 (`_chi_square_bound`). `torch.multinomial` (`reference_draw`) passes the same test; a draw off by one
    token or ignoring a row's total fails it."""
    from longstraw.sampler import _draw, reference_draw

    g = torch.Generator().manual_seed(11)
    w = torch.rand(40, generator=g) ** 4 * 1000 + 0.05
    w[[0, 7, 19, 39]] = 0.0
    n = 200_000
    rows = w.expand(n, -1)
    fn = _draw if draw == "inverse_transform" else reference_draw
    chosen = fn(rows, torch.Generator().manual_seed(3))
    _assert_drawn_as_weighted(chosen, w)


def test_a_two_level_draw_follows_its_weights_across_blocks():
    """The draw's two levels (a block by its cumulative sum, then a token inside it) over 43 tokens in blocks of 8:
    a block of zeros, zeros inside blocks, a short last block. 200,000 draws pass the same chi-square test as
    `test_a_draw_follows_its_weights`; no token of weight 0 is drawn. A remainder carried into the wrong block (or
    a block's offset dropped) fails it."""
    from longstraw.sampler import _draw

    g = torch.Generator().manual_seed(12)
    w = torch.rand(43, generator=g) ** 4 * 1000 + 0.05
    w[8:16] = 0.0
    w[[0, 21, 42]] = 0.0
    n = 200_000
    chosen = _draw(w.expand(n, -1), torch.Generator().manual_seed(5), block=8)
    _assert_drawn_as_weighted(chosen, w)


def test_rows_of_one_generator_draw_together_in_row_order():
    """A batch whose rows draw from their own generators gives each generator's rows what they draw alone, in row
    order (rows of one trajectory or one row's G samples reproduce whatever else is in the batch)."""
    from longstraw.sampler import _draw

    w = torch.rand(5, 30, generator=torch.Generator().manual_seed(1))
    a, b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(5)
    got = _draw(w, [a, b, a, b, a])
    assert torch.equal(got[[0, 2, 4]], _draw(w[[0, 2, 4]], torch.Generator().manual_seed(4)))
    assert torch.equal(got[[1, 3]], _draw(w[[1, 3]], torch.Generator().manual_seed(5)))
