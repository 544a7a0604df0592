"""One captured document, many rows: `replay(response, prefix_ids=question)` against the unmodified model.

A row's prompt is `document + question`. Captured once as `document`, each row's replay reads its question as a prefix
(`PromptState.replay(..., prefix_ids=...)`); the references are transformers' own model on the row's whole prompt:
detached, its cache filled without grad over `document + question` and the response with grad
(`cache_reference_logprobs`); exact, the full-sequence forward, whose gradient over Q rows is the sum of theirs.
"""

import pytest
import torch

import longstraw
from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs
from longstraw.sampler import sample

from .conftest import assert_grads_close, assert_tie_free, make_model, tokens
from .test_equivalence import FP32_GRAD_TOL

#: one model per layer kind: full attention, sliding window, linear attention (gated DeltaNet), MLA latents,
#: short convolutions, Mamba-2 + attention, DSA (latents + indexer keys), DeepSeek-V4's compressed streams
KIND_ARCHS = ["llama", "gemma3_text", "qwen3_next", "deepseek_v3", "lfm2", "falcon_h1", "deepseek_v32", "deepseek_v4"]
#: fp32 log-probs, absolute: the bound `test_equivalence` holds every replay to
LOGPROB_TOL = 1e-4


def _grads(model, fn):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    fn()
    return [None if p.grad is None else p.grad.clone() for p in params]


def _rows(model, doc_len=17, question_lens=(5, 1, 9), response_len=4):
    """A document and per row a question and a response (different lengths; the question of 1 token included)."""
    doc = tokens(doc_len, 1)
    rows = [(tokens(q, 20 + q), tokens(response_len + i, 40 + i)) for i, q in enumerate(question_lens)]
    for q, r in rows:
        assert_tie_free(model, torch.cat([doc, q, r]))
    return doc, rows


@pytest.mark.parametrize("arch", KIND_ARCHS)
def test_detached_prefix_replay_equals_the_whole_prompt_in_transformers_cache(arch):
    model = make_model(arch)
    doc, rows = _rows(model)
    adv = [0.7, -1.2, 0.4]

    def reference():
        for a, (q, r) in zip(adv, rows):
            with torch.autograd.graph.allow_mutation_on_saved_tensors():
                (a * cache_reference_logprobs(model, torch.cat([doc, q]), r)).sum().backward()

    got_lp = []

    def shared():
        with longstraw.capture(model, doc, chunk_size=4, block_size=4) as state:  # questions longer than a chunk
            for a, (q, r) in zip(adv, rows):
                lp = state.replay(r, prefix_ids=q).logprobs
                got_lp.append(lp.detach())
                (a * lp).sum().backward()

    assert_grads_close(_grads(model, shared), _grads(model, reference), tol=FP32_GRAD_TOL)
    with torch.no_grad():
        for lp, (q, r) in zip(got_lp, rows):
            assert (lp - cache_reference_logprobs(model, torch.cat([doc, q]), r)).abs().max() <= LOGPROB_TOL


@pytest.mark.parametrize("arch", KIND_ARCHS)
def test_exact_prefix_replay_sums_the_rows_full_sequence_gradients(arch):
    model = make_model(arch)
    doc, rows = _rows(model)
    adv = [0.7, -1.2, 0.4]

    def naive():
        for a, (q, r) in zip(adv, rows):
            (a * full_sequence_logprobs(model, torch.cat([doc, q]), r)).sum().backward()

    def shared():
        with longstraw.capture(model, doc, chunk_size=4, prompt_grad="exact", block_size=4) as state:
            for a, (q, r) in zip(adv, rows):
                (a * state.replay(r, prefix_ids=q).logprobs).sum().backward()
            state.backward()  # once: the shared document's gradient summed over its rows

    assert_grads_close(_grads(model, shared), _grads(model, naive), tol=FP32_GRAD_TOL)


def test_an_empty_prefix_is_the_plain_replay():
    model = make_model("llama")
    doc, r = tokens(9, 1), tokens(3, 2)
    with torch.no_grad(), longstraw.capture(model, doc, chunk_size=4) as state:
        assert torch.equal(state.replay(r, prefix_ids=[]).logprobs, state.replay(r).logprobs)


@pytest.mark.parametrize("arch", KIND_ARCHS)
def test_a_branch_per_row_samples_and_replays_as_the_whole_prompt(arch):
    """Each row's question read once into its own `Branch` (`extend`): G sequences sampled after it (its own state
    repeated for them) have the full-sequence forward's log-probs over the row's whole prompt and the tokens of
    reading the question per sequence (`prefix_ids`); `Branch.replay` has transformers' detached gradient, and leaves
    the branch as it was (a second replay gives the same values)."""
    model = make_model(arch)
    doc, rows = _rows(model)
    adv = [0.7, -1.2, 0.4]
    with longstraw.capture(model, doc, chunk_size=4, block_size=4) as state:
        for q, _ in rows:
            with torch.no_grad(), state.fork() as branch:
                branch.extend(q)
                got = sample(branch, 3, 4, generator=torch.Generator().manual_seed(7))
                per_row = sample(state, 3, 4, prefix_ids=q, generator=torch.Generator().manual_seed(7))
                assert all(torch.equal(a, b) for a, b in zip(got.tokens, per_row.tokens))
                for tokens, lp in zip(got.tokens, got.logprobs):
                    full = full_sequence_logprobs(model, torch.cat([doc, q]), tokens)
                    assert (lp - full).abs().max() <= LOGPROB_TOL

    def reference():
        for a, (q, r) in zip(adv, rows):
            with torch.autograd.graph.allow_mutation_on_saved_tensors():
                (a * cache_reference_logprobs(model, torch.cat([doc, q]), r)).sum().backward()

    def branches():
        with longstraw.capture(model, doc, chunk_size=4, block_size=4) as state:
            for a, (q, r) in zip(adv, rows):
                with state.fork() as branch:
                    branch.extend(q)
                    first = branch.replay(r).logprobs
                    (a * first).sum().backward()
                    with torch.no_grad():
                        assert torch.equal(branch.replay(r).logprobs, first.detach())

    assert_grads_close(_grads(model, branches), _grads(model, reference), tol=FP32_GRAD_TOL)


def test_a_branch_forks_like_a_prompt_state():
    """A branch of a branch starts where its parent is and grows apart: the parent's next samples are unchanged."""
    model = make_model("qwen3_next")
    doc, (q, r) = tokens(12, 1), (tokens(4, 2), tokens(3, 3))
    with torch.no_grad(), longstraw.capture(model, doc, chunk_size=4) as state, state.fork() as row:
        row.extend(q)
        before = row.replay(r).logprobs
        with row.fork() as child:
            child.extend(r)
            assert child.length == row.length + r.numel() == doc.numel() + q.numel() + r.numel()
            grown = child.replay(tokens(2, 4)).logprobs
        assert torch.equal(row.replay(r).logprobs, before)
        reference = full_sequence_logprobs(model, torch.cat([doc, q, r]), tokens(2, 4))
        assert (grown - reference).abs().max() <= LOGPROB_TOL
