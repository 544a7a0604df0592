"""Batched replay (`longstraw.replay.batched.replay_batch`): k responses of one state in one forward and backward,
held to the unmodified model and to one-at-a-time replay.

The references: transformers' own model on each row's whole sequence (its cache filled under `no_grad` over the
prompt and the row's question, the response with grad: `cache_reference_logprobs`, the detached objective; one
full-sequence forward per row, the exact one), whose gradients over the k rows add up; and `PromptState.replay` one
response at a time (itself held to those references by tests/test_equivalence.py and tests/test_shared_prefix.py).
The responses have different lengths (one of a single token), so the batch pads; the rows' losses have different
weights, so a row's loss lost or given to another row shows.
"""

import pytest
import torch

import longstraw
from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs
from longstraw.replay.batched import batch_size, replay_batch, replay_branches, stacks_for_replay
from longstraw.testing.memory import LiveBytes

from ..conftest import assert_grads_close, assert_tie_free, make_model, tokens
from ..test_equivalence import FP32_GRAD_TOL

#: one model per layer kind: full attention, sliding window, chunked attention, attention sinks, gated DeltaNet,
#: short convolutions, Mamba-2 with mixer-less layers, Jamba's Mamba, MLA latents, DSA, DeepSeek-V4's compressed
#: attention
KINDS = [
    "llama",
    "gemma3_text",
    "llama4_text",
    "gpt_oss",
    "qwen3_next",
    "lfm2",
    "nemotron_h",
    "jamba",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
]
#: fp32 log-probs, absolute: the bound tests/test_equivalence.py holds every replay to
LOGPROB_TOL = 1e-4
#: the rows' loss weights (advantages): distinct, one negative
WEIGHTS = [0.7, -1.2, 0.4, 1.1]


def _grads(model, fn):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    fn()
    return [None if p.grad is None else p.grad.clone() for p in params]


def _case(model, question: int):
    """A 17-token document, a row's question of `question` tokens (0: none) and four responses of 4, 1, 6, 3 tokens,
    from the first seed whose sequences have no top-k near-tie for DSA and compressed attention (`assert_tie_free`)."""
    for seed in range(20):
        doc, q = tokens(17, 1 + seed), tokens(question, 20 + question + seed)
        responses = [tokens(n, 40 + i + 10 * seed) for i, n in enumerate((4, 1, 6, 3))]
        try:
            for r in responses:
                assert_tie_free(model, torch.cat([doc, q, r]))
        except AssertionError:
            continue
        return doc, q, responses
    raise AssertionError("no tie-free tokens in 20 seeds")


@pytest.mark.parametrize("question", [0, 5], ids=["no-question", "question-5"])
@pytest.mark.parametrize("arch", KINDS)
def test_batched_detached_replay_equals_transformers_cache_per_row(arch, question):
    """Detached: each row's log-probs are transformers' (its cache over document + question, `LOGPROB_TOL`), and the
    gradient of Σ w_i · Σ_t lp_i,t from one batched replay is the sum of the rows' reference gradients
    (`FP32_GRAD_TOL` relative)."""
    model = make_model(arch, True)
    doc, q, responses = _case(model, question)

    def reference():
        for w, r in zip(WEIGHTS, responses):
            with torch.autograd.graph.allow_mutation_on_saved_tensors():
                (w * cache_reference_logprobs(model, torch.cat([doc, q]), r)).sum().backward()

    got = []

    def batched():
        with longstraw.capture(model, doc, chunk_size=4, block_size=4) as state:
            outs = replay_batch(state, responses, prefix_ids=q if question else None)
            sum((w * o.logprobs).sum() for w, o in zip(WEIGHTS, outs)).backward()
            got.extend(o.logprobs.detach() for o in outs)

    assert_grads_close(_grads(model, batched), _grads(model, reference), tol=FP32_GRAD_TOL)
    with torch.no_grad():
        for lp, r in zip(got, responses):
            assert lp.shape == r.shape
            assert (lp - cache_reference_logprobs(model, torch.cat([doc, q]), r)).abs().max() <= LOGPROB_TOL


@pytest.mark.parametrize("question", [0, 5], ids=["no-question", "question-5"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next", "lfm2", "deepseek_v3"])
def test_batched_exact_replay_sums_the_rows_full_sequence_gradients(arch, question):
    """Exact: one batched replay and `state.backward()` give the gradient of the k rows' full-sequence GRPO terms
    (one transformers forward of document + question + response per row), `FP32_GRAD_TOL` relative."""
    model = make_model(arch, True)
    doc, q, responses = _case(model, question)

    def naive():
        for w, r in zip(WEIGHTS, responses):
            (w * full_sequence_logprobs(model, torch.cat([doc, q]), r)).sum().backward()

    def batched():
        with longstraw.capture(model, doc, chunk_size=4, prompt_grad="exact", block_size=4) as state:
            outs = replay_batch(state, responses, prefix_ids=q if question else None)
            sum((w * o.logprobs).sum() for w, o in zip(WEIGHTS, outs)).backward()
            state.backward()

    assert_grads_close(_grads(model, batched), _grads(model, naive), tol=FP32_GRAD_TOL)


def test_batched_replay_after_a_branch_equals_serial_replay_after_it():
    """After a row's `Branch` (its question read once): the batch's log-probs and entropies are `Branch.replay`'s one
    at a time (`LOGPROB_TOL`), its gradient theirs summed (`FP32_GRAD_TOL`); the branch is left as it was."""
    model = make_model("qwen3_next", True)
    doc, q, responses = _case(model, 5)
    with longstraw.capture(model, doc, chunk_size=4, block_size=4) as state, state.fork() as branch:
        with torch.no_grad():
            branch.extend(q)
        serial = []

        def one_by_one():
            for w, r in zip(WEIGHTS, responses):
                out = branch.replay(r)
                serial.append(out)
                (w * out.logprobs).sum().backward()

        batch = []

        def together():
            outs = replay_batch(branch, responses)
            batch.extend(outs)
            sum((w * o.logprobs).sum() for w, o in zip(WEIGHTS, outs)).backward()

        want = _grads(model, one_by_one)
        assert_grads_close(_grads(model, together), want, tol=FP32_GRAD_TOL)
        for a, b in zip(batch, serial):
            assert (a.logprobs - b.logprobs).abs().max() <= LOGPROB_TOL
            assert (a.entropy - b.entropy).abs().max() <= LOGPROB_TOL
        assert_grads_close(_grads(model, one_by_one), want, tol=FP32_GRAD_TOL)  # the branch unchanged by the batch


#: rows of one document in one batch (`replay_branches`): questions of 0, 2, 5 and 9 tokens (the tiny models' windows
#: are 5, so a window reaches back into the question or the document), 2, 1, 3 and 1 responses
QUESTIONS, COUNTS = (0, 2, 5, 9), (2, 1, 3, 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss", "mistral"])
def test_rows_replayed_together_equal_transformers_cache_per_row(arch):
    """Branches of one document after questions of different lengths, all their responses in one batch: each
    response's log-probs are transformers' (its cache over document + its row's question, `LOGPROB_TOL`), and the
    gradient of Σ w · Σ_t lp is the sum of the responses' reference gradients (`FP32_GRAD_TOL` relative). Full
    attention, sliding windows with softcaps (Gemma 3), sinks (gpt-oss)."""
    model = make_model(arch, True)
    doc = tokens(17, 1)
    questions = [tokens(n, 30 + n) for n in QUESTIONS]
    responses = [[tokens(n, 50 + 7 * i + j) for j, n in enumerate((4, 1, 6)[:c])] for i, c in enumerate(COUNTS)]
    weights = [[0.3 * (i + 1) - 0.9 * j for j in range(c)] for i, c in enumerate(COUNTS)]

    def reference():
        for q, rs, ws in zip(questions, responses, weights):
            for w, r in zip(ws, rs):
                with torch.autograd.graph.allow_mutation_on_saved_tensors():
                    (w * cache_reference_logprobs(model, torch.cat([doc, q]), r)).sum().backward()

    got = []

    def together():
        with longstraw.capture(model, doc, chunk_size=4, block_size=4) as state:
            branches = [state.fork() if q.numel() else state for q in questions]  # a row without a question: the state
            with torch.no_grad():
                for b, q in zip(branches, questions):
                    if q.numel():
                        b.extend(q)
            assert stacks_for_replay(branches)
            outs = replay_branches(branches, responses)
            sum((w * o.logprobs).sum() for ws, os in zip(weights, outs) for w, o in zip(ws, os)).backward()
            got.extend(outs)

    assert_grads_close(_grads(model, together), _grads(model, reference), tol=FP32_GRAD_TOL)
    flat = [(q, r) for q, rs in zip(questions, responses) for r in rs]
    assert [len(os) for os in got] == list(COUNTS)
    with torch.no_grad():
        for o, (q, r) in zip([o for os in got for o in os], flat):
            assert o.logprobs.shape == r.shape
            assert (o.logprobs - cache_reference_logprobs(model, torch.cat([doc, q]), r)).abs().max() <= LOGPROB_TOL


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next", "deepseek_v3"])
def test_exact_rows_replayed_together_sum_their_full_sequence_gradients(arch):
    """Exact: the responses of rows after questions of 0, 2, 5 and 9 tokens in one batch (`replay_batch(prefixes=)`,
    each question in the batch's forward with its response) and `state.backward()` give the gradient of the rows'
    full-sequence terms (one transformers forward of document + question + response each), `FP32_GRAD_TOL`
    relative; every layer kind (recurrent and latent too: the rows start at one position, padded at their end)."""
    model = make_model(arch, True)
    doc = tokens(17, 1)
    questions = [tokens(n, 30 + n) for n in QUESTIONS]
    pairs = [(q, tokens(n, 50 + 7 * i + j)) for i, (q, c) in enumerate(zip(questions, COUNTS)) for j, n in
             enumerate((4, 1, 6)[:c])]  # fmt: skip
    weights = [0.3 * (i + 1) - 0.5 * (i % 3) for i in range(len(pairs))]

    def naive():
        for w, (q, r) in zip(weights, pairs):
            (w * full_sequence_logprobs(model, torch.cat([doc, q]), r)).sum().backward()

    def together():
        with longstraw.capture(model, doc, chunk_size=4, prompt_grad="exact", block_size=4) as state:
            outs = replay_batch(state, [r for _, r in pairs], prefixes=[q for q, _ in pairs])
            assert [o.logprobs.shape for o in outs] == [r.shape for _, r in pairs]
            sum((w * o.logprobs).sum() for w, o in zip(weights, outs)).backward()
            state.backward()

    assert_grads_close(_grads(model, together), _grads(model, naive), tol=FP32_GRAD_TOL)


def test_rows_of_recurrent_or_exact_states_are_not_replayed_together():
    """Recurrent layers (Qwen3-Next) and an exact state go one row at a time: `stacks_for_replay` says so and
    `replay_branches` refuses by name."""
    model = make_model("qwen3_next")
    with longstraw.capture(model, tokens(9, 1), chunk_size=4) as state, state.fork() as b:
        assert not stacks_for_replay([b])
        with pytest.raises(ValueError, match="stacks_for_replay"):
            replay_branches([b], [[tokens(3, 2)]])
    with longstraw.capture(make_model("llama"), tokens(9, 1), chunk_size=4, prompt_grad="exact") as state:
        assert not stacks_for_replay([state.fork()])


def test_replay_batch_refuses_and_sizes():
    model = make_model("llama")
    with longstraw.capture(model, tokens(9, 1), chunk_size=4) as state:
        assert replay_batch(state, []) == []
        with pytest.raises(ValueError, match="vocabulary|response_ids"):
            replay_batch(state, [torch.tensor([1, 10**6])])
    assert batch_size(3, 100, None, 8) == 3
    assert batch_size(16, 100, None, 8) == 8
    assert batch_size("auto", 100, None, 8) == 8
    assert batch_size("auto", 100, 350, 8) == 3
    assert batch_size("auto", 100, 50, 8) == 1
    with pytest.raises(ValueError, match="replay_batch"):
        batch_size(0, 100, None, 8)


def _batch_graph(model, state, k: int, r: int = 12) -> int:
    """The bytes of tensors a batched replay of k responses of `r` tokens leaves alive for its backward (its graph's
    saved tensors and its outputs), measured after the forward."""
    responses = [tokens(r, 60 + i) for i in range(k)]
    existing = [*model.parameters(), *(t for layer in state.live_layers() for t in layer.tensors())]
    with LiveBytes(existing=existing) as live:
        outs = replay_batch(state, responses)
        held = live.now
    sum(o.logprobs.sum() for o in outs).backward()
    return held


def test_batched_replay_graph_is_independent_of_the_prompt_and_holds_k_graphs():
    """Exact tensor bytes (`LiveBytes`, the prompt state and the weights excluded) a batched replay's graph holds:
    the same at P = 64 and P = 1,024 — nothing of the prompt's size enters it (the prompt part is read in place, its
    queries folded) — and a batch of 4 at most 4 × one replay's (seen failing with the prompt K/V repeated per row of
    the batch: 2,493,512 against 527,432 bytes at P = 1,024 and 64)."""
    model = make_model("llama", True)
    graphs = {}
    for p in (64, 1024):
        with longstraw.capture(model, tokens(p, 1), chunk_size=64) as state:
            graphs[p] = (_batch_graph(model, state, 1), _batch_graph(model, state, 4))
    assert graphs[64] == graphs[1024], graphs
    assert graphs[64][1] <= 4 * graphs[64][0], graphs
