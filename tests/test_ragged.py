"""Ragged decoding (`longstraw.ragged`): branches of one prompt with different own lengths decoded in one batch equal
each branch decoded on its own (`longstraw.sampler.sample`, `Branch.sample`): the reference is the one-branch path."""

import pytest
import torch

import longstraw
from longstraw.kinds import AttentionBranchLayer
from longstraw.ops.ragged_attention import ragged_attention, reference
from longstraw.ragged import sample_branches, stackable
from longstraw.sampler import sample

from .conftest import make_model, tokens
from .test_sampler import LOGPROB_TOL

#: every kind `stack_layers` serves (full, sliding and chunked attention, sinks, softcap, linear attention, Mamba,
#: hybrid layers, short convolutions, layers without a mixer) and two it does not (MLA, Llama 4's position from the
#: cache), which decode one branch after another
ARCHS = [
    "llama",
    "mistral",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "qwen3_next",
    "jamba",
    "nemotron_h",
    "falcon_h1",
    "lfm2",
    "deepseek_v3",
    "llama4_text",
]
UNSTACKED = {"deepseek_v3", "llama4_text"}

#: float64 inputs: both paths sum the same scores in another order; float64's epsilon (2.2e-16) × 2^12 growth
F64_TOL = 2.2e-16 * 2**12


@pytest.mark.parametrize(
    "window,chunk,softcap,sinks",
    [(None, None, None, False), (6, None, None, False), (None, 4, None, False), (None, None, 5.0, True)],
)
@pytest.mark.parametrize("r", [1, 3])
def test_ragged_attention_equals_each_row_alone(window, chunk, softcap, sinks, r):
    g = torch.Generator().manual_seed(0)
    b, h, hkv, d, width, n_prompt = 4, 4, 2, 8, 11, 13
    q = torch.randn(b, h, r, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, width, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, width, d, generator=g, dtype=torch.float64)
    pk = torch.randn(1, hkv, n_prompt, d, generator=g, dtype=torch.float64)
    pv = torch.randn(1, hkv, n_prompt, d, generator=g, dtype=torch.float64)
    pads, starts = [0, 5, 8, 11 - r], [n_prompt, n_prompt + 2, n_prompt, n_prompt + 7]
    kw = dict(window=window, chunk=chunk, softcap=softcap, sinks=torch.randn(h, dtype=torch.float64) if sinks else None)
    for prompt in ((pk, pv), (None, None)):
        got = ragged_attention(q, k, v, *prompt, pads=pads, own_starts=starts, **kw)
        want = reference(q, k, v, *prompt, pads=pads, own_starts=starts, **kw)
        assert (got - want).abs().max() <= F64_TOL * want.abs().max()


@pytest.mark.parametrize(
    "window,chunk,softcap,sinks",
    [(None, None, None, False), (6, None, None, False), (None, 4, None, False), (None, None, 5.0, True)],
)
def test_ragged_attention_gradients_equal_each_row_alone(window, chunk, softcap, sinks):
    """With autograd (a replay of several rows together, `longstraw.replay.batched.replay_branches`): the gradients
    of q and the own K/V (padding included: zero) equal those through `split_attention` row by row."""
    g = torch.Generator().manual_seed(1)
    b, h, hkv, d, width, n_prompt, r = 4, 4, 2, 8, 11, 13, 3
    q = torch.randn(b, h, r, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, width, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, width, d, generator=g, dtype=torch.float64)
    pk = torch.randn(1, hkv, n_prompt, d, generator=g, dtype=torch.float64)
    pv = torch.randn(1, hkv, n_prompt, d, generator=g, dtype=torch.float64)
    weight = torch.randn(b, h, r, d, generator=g, dtype=torch.float64)
    pads, starts = [0, 5, 8, 11 - r], [n_prompt, n_prompt + 2, n_prompt, n_prompt + 7]
    kw = dict(window=window, chunk=chunk, softcap=softcap, sinks=torch.randn(h, dtype=torch.float64) if sinks else None)
    for prompt in ((pk, pv), (None, None)):
        grads = []
        for fn in (ragged_attention, reference):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            (fn(*x, *prompt, pads=pads, own_starts=starts, **kw) * weight).sum().backward()
            grads.append([t.grad for t in x])
        for got, want in zip(*grads):
            assert (got - want).abs().max() <= F64_TOL * want.abs().max()


def _branches(model, lengths):
    state = longstraw.capture(model, tokens(19, 1), chunk_size=7)
    out = []
    for i, n in enumerate(lengths):
        branch = state.fork()
        if n:
            branch.extend(tokens(n, 10 + i))
        out.append(branch)
    return state, out


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decoding_equals_one_branch_at_a_time(arch):
    """Greedy: the same tokens; log-probs within the sampler's fp32 bound. Own lengths 0, 3, 9, 1 tokens (the tiny
    models' windows are 5: trimming acts), G 2, 1, 3, 1 and a cap per branch."""
    _, branches = _branches(make_model(arch), [0, 3, 9, 1])
    assert stackable(branches) == (arch not in UNSTACKED)
    nums, caps = [2, 1, 3, 1], [10, 6, 10, 8]
    got = sample_branches(branches, nums, caps, temperature=0, stop_token_ids=[7])
    for b, out, k, c in zip(branches, got, nums, caps):
        want = sample(b, k, c, temperature=0, stop_token_ids=[7])
        assert len(out.tokens) == k and torch.equal(out.truncated, want.truncated)
        for x, y, lx, ly in zip(out.tokens, want.tokens, out.logprobs, want.logprobs):
            assert torch.equal(x, y)
            assert (lx - ly).abs().max() <= LOGPROB_TOL


def _own_keys(branch) -> torch.Tensor:
    return next(layer.keys for layer in branch._own.layers if isinstance(layer, AttentionBranchLayer))


@pytest.mark.parametrize("room_after", [0, 4])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3_next", "falcon_h1"])
def test_kept_turns_grow_each_branch_as_branch_sample_does(arch, room_after):
    """`keep=True` (an agent's turns): two turns of different lengths per branch (rows leaving the batch at different
    steps, then all at once), then a tool reply, then the next turn from each branch equal `Branch.sample` / `extend`
    on each branch alone; each branch's positions too. With `room_after` 4, a reply of up to 4 tokens is written in
    place in the branch's row of the batch (the same storage before and after), a longer one is not; a fork of the
    branch and the branch then grow without changing what the other holds."""
    _, branches = _branches(make_model(arch), [0, 3, 9, 1])
    alone = [b.fork() for b in branches]
    for caps in ([5, 7, 3, 6], [6, 6, 6, 6]):
        got = sample_branches(branches, 1, caps, temperature=0, stop_token_ids=[7], keep=True, room_after=room_after)
        want = [b.sample(c, temperature=0, stop_token_ids=[7]) for b, c in zip(alone, caps)]
        for x, y in zip(got, want):
            assert torch.equal(x.tokens[0], y.tokens[0])
            assert (x.logprobs[0] - y.logprobs[0]).abs().max() <= LOGPROB_TOL
        for i, (b, a) in enumerate(zip(branches, alone)):
            before = _own_keys(b).untyped_storage().data_ptr()
            child = b.fork()  # shares b's row: neither may write what the other reads
            kept = _own_keys(child).clone()
            b.extend(tokens(2 + i, 30 + i))
            a.extend(tokens(2 + i, 30 + i))
            in_place = _own_keys(b).untyped_storage().data_ptr() == before
            assert in_place == (room_after >= 2 + i), (i, in_place)
            assert torch.equal(_own_keys(child), kept)
            grown = _own_keys(b).clone()
            child.extend(tokens(3, 50 + i))
            assert torch.equal(_own_keys(b), grown)
            child.release()
    assert [b.length for b in branches] == [a.length for a in alone]
    got = sample_branches(branches, 1, 5, temperature=0, keep=True)
    want = [a.sample(5, temperature=0) for a in alone]
    assert all(torch.equal(x.tokens[0], y.tokens[0]) for x, y in zip(got, want))


def test_each_branch_draws_from_its_own_generator():
    """Seeded sampling: branch i's rows draw from generator i as `sample(branch_i, ...)` does alone, so a step's rows
    sample the same responses whether batched or not."""
    _, branches = _branches(make_model("qwen3_next"), [2, 5, 0])
    seeds = [3, 4, 5]
    got = sample_branches(branches, [3, 2, 2], 8, generator=[torch.Generator().manual_seed(s) for s in seeds])
    for b, out, k, s in zip(branches, got, [3, 2, 2], seeds):
        want = sample(b, k, 8, generator=torch.Generator().manual_seed(s))
        assert all(torch.equal(x, y) for x, y in zip(out.tokens, want.tokens))


def test_bad_arguments():
    _, branches = _branches(make_model("llama"), [0, 2])
    with pytest.raises(ValueError, match="one entry per branch"):
        sample_branches(branches, [1], 4)
    with pytest.raises(ValueError, match="nums must be 1"):
        sample_branches(branches, 2, 4, keep=True)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample_branches(branches, 1, [4, 0])


@pytest.mark.parametrize("batched", [False, True])
def test_decoding_writes_each_token_in_place(monkeypatch, batched):
    """Decoding copies a branch's own K/V once (into a buffer with room for the turn), not once per token: every step's
    keys of a layer are views of one storage (`Branch.sample`, and a ragged batch); the tokens are checked equal to
    the one-branch path by the tests above."""
    _, branches = _branches(make_model("llama"), [3, 9])
    seen: dict[int, list[int]] = {}  # per layer: the storage of each step's keys
    append = AttentionBranchLayer._append

    def spy(self, k, v):
        keys, values = append(self, k, v)
        seen.setdefault(id(self), []).append(keys.untyped_storage().data_ptr())
        return keys, values

    monkeypatch.setattr(AttentionBranchLayer, "_append", spy)
    if batched:
        sample_branches(branches, 1, 12, temperature=0, keep=True)
    else:
        branches[0].sample(12, temperature=0)
    assert seen and all(len(ptrs) == 12 and len(set(ptrs)) == 1 for ptrs in seen.values()), seen


def test_a_batch_takes_each_branch_once_and_a_failed_one_loses_them(monkeypatch):
    """`keep=True`: a branch's own K/V of layer i are freed once the batch holds them, before layer i + 1 is stacked
    (the batch never holds a branch twice); a batch that fails leaves its branches without state, and using one says
    so."""
    import weakref

    import longstraw.ragged as ragged

    _, branches = _branches(make_model("llama"), [3, 9, 5])
    refs = [[weakref.ref(b._own.layers[i].keys) for b in branches] for i in range(len(branches[0]._own.layers))]
    alive_when_next_stacked: list[bool] = []
    stack = ragged.stack_layers

    def spy(layers, rows, room=0):
        i = len(alive_when_next_stacked)
        alive_when_next_stacked.append(i > 0 and any(r() is not None for r in refs[i - 1]))
        return stack(layers, rows, room)

    monkeypatch.setattr(ragged, "stack_layers", spy)
    sample_branches(branches, 1, 4, temperature=0, keep=True)
    assert len(alive_when_next_stacked) == len(refs) > 1 and not any(alive_when_next_stacked)

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ragged, "stack_layers", stack)
    monkeypatch.setattr(ragged, "decode", fail)
    with pytest.raises(KeyboardInterrupt):
        sample_branches(branches, 1, 4, temperature=0, keep=True)
    with pytest.raises(RuntimeError, match="lost its state"):
        branches[0].extend(tokens(2, 3))


def test_a_long_cap_is_not_held_in_full(monkeypatch):
    """A turn's cap of 600 tokens is not allocated from the first token (a response that stops early would hold it
    all): the room at most doubles what the layer holds (at least `ROOM_MIN`), so 600 tokens after 3 take 3 copies,
    and the last one ends exactly at the cap."""
    from longstraw.kinds.full_attention import ROOM_MIN

    _, branches = _branches(make_model("llama"), [3])
    capacity: dict[int, list[tuple[int, int]]] = {}  # per layer: (own tokens, the room's columns) at each step
    append = AttentionBranchLayer._append

    def spy(self, k, v):
        keys, values = append(self, k, v)
        capacity.setdefault(id(self), []).append((keys.shape[-2], self.room.keys.shape[-2]))
        return keys, values

    monkeypatch.setattr(AttentionBranchLayer, "_append", spy)
    branches[0].sample(600, temperature=0)
    for steps in capacity.values():
        assert len(steps) == 600
        assert all(cap <= 2 * used + ROOM_MIN for used, cap in steps)
        assert len({cap for _, cap in steps}) == 3 and steps[-1] == (603, 603), sorted({c for _, c in steps})
