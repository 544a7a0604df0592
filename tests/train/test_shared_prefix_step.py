"""A GRPO step over rows that share a document: one capture, and the same step as capturing every row whole.

The rows are `document + question` prompts of the tiny word-level model. Each step is checked three ways: the old
log-probs the rollout sampled after each row's suffix equal the unmodified model's full-sequence forward over the
row's whole prompt; the accumulated gradient equals the GRPO loss on transformers' own log-probs of each row's whole
prompt (detached: its cache filled without grad, then the response; exact: the full-sequence forward); and it equals
the same rollout updated with every row captured on its own (`share_prefixes: false`).
"""

import dataclasses
import json

import pytest
import torch

from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs
from longstraw.train.config import TrainConfig
from longstraw.train.sharing import Context, shared_contexts
from longstraw.train.trainer import Trainer
from longstraw.train.update import loss_mask

from ..conftest import assert_grads_close
from ..test_equivalence import FP32_GRAD_TOL

DOC = " ".join(f"f{(7 * i) % 32}" if i % 9 else f"k{i % 64} v{i % 16}" for i in range(40))
OTHER = " ".join(f"f{(5 * i + 3) % 32}" for i in range(30))
#: old log-probs against the full-sequence forward, absolute: the sampler's bound (`tests/test_sampler.py`), 16 float32
#: roundings of values of order 1
OLD_LOGPROB_TOL = 16 * 2**-23

ROW_SETS = {
    # three questions, one longer than a chunk (chunk_size 8), one of a single token
    "questions": [DOC + " ? k9", DOC + " ? k18 f1 f2 f3 f4 f5 f6 f7 f8 f9 f10 ? k18", DOC + " ?"],
    # a row whose prompt is the document itself: a strict prefix of the others (its suffix is empty)
    "strict_prefix": [DOC, DOC + " ? k27", DOC + " ? k36 ?"],
    # two documents: nothing shared across them
    "two_documents": [DOC + " ? k9", OTHER + " ? k3", OTHER + " ? k4"],
}


def length_reward(prompts, completions, completion_ids, **kw):
    """Differs between responses, so that advantages (and gradients) are not zero."""
    return [float(len(ids) % 5) + 0.1 * ids[0] for ids in completion_ids]


def _trainer(tmp_path, rows, **kw):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dict(
        model="llama",
        output_dir=str(tmp_path / "run"),
        dataset=str(data),
        eval_fraction=0.0,
        prompts_per_step=len(rows),
        num_steps=1,
        num_generations=3,
        max_completion_length=4,
        chunk_size=8,
        lora=False,
        progress=False,
        threads=1,
        min_shared_prefix=16,
        seed=5,
        reward_funcs=["tests.train.test_shared_prefix_step:length_reward"],
    )
    cfg.update(kw)
    return Trainer(TrainConfig(**cfg))


def _step_grads(trainer, rollout):
    params = trainer.params
    for p in params:
        p.grad = None
    trainer.update(rollout)
    return [None if p.grad is None else p.grad.clone() for p in params]


def _reference_grads(trainer, rollout, exact: bool):
    """The step's GRPO loss on the unmodified model's log-probs of each row's whole prompt."""
    masks = [loss_mask(r, trainer.update_settings) for r in rollout.responses]
    norm = trainer.loss_fn.normalizer(
        [int(m.sum()) for m in masks], rollout.group_ids, trainer.update_settings.max_completion_length
    )
    params = trainer.params
    for p in params:
        p.grad = None
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        for i, (r, m) in enumerate(zip(rollout.responses, masks)):
            prompt = rollout.groups[rollout.group_ids[i]].prompt_ids
            reference = full_sequence_logprobs if exact else cache_reference_logprobs
            lp = reference(trainer.model, prompt, r.tokens)
            loss, _ = trainer.loss_fn.response_loss(lp, r.old_logprobs, float(rollout.advantages[i]), norm[i], mask=m)
            loss.backward()
    return [None if p.grad is None else p.grad.clone() for p in params]


def _row_by_row(rollout):
    """The same rollout with every row its own context, captured whole by the update."""
    groups = [dataclasses.replace(g, state=None, shared=None) for g in rollout.groups]
    contexts = [Context(g.prompt_ids.numel(), (b,)) for b, g in enumerate(groups)]
    return dataclasses.replace(rollout, groups=groups, contexts=contexts, shared_frac=0.0)


@pytest.mark.parametrize("replay_batch", [1, 5], ids=["serial", "batch-5"])
@pytest.mark.parametrize("prompt_grad", ["detached", "exact"])
@pytest.mark.parametrize("rows", list(ROW_SETS))
def test_a_shared_prefix_step_equals_separate_captures(tmp_path, monkeypatch, rows, prompt_grad, replay_batch):
    """With `replay_batch: 5` the rows of a document share their batches (detached: `replay_branches`; exact: each
    row's question in the batch's forward); a document's only row batches within the row."""
    import longstraw.replay.order as order

    together, exact_rows = [], []
    inner, inner_batch = order.replay_branches, order.replay_batch
    monkeypatch.setattr(
        order, "replay_branches", lambda b, rs, **kw: together.append([len(r) for r in rs]) or inner(b, rs, **kw)
    )

    def batch_spy(state, rs, **kw):
        if kw.get("prefixes") is not None:
            exact_rows.append(len(rs))
        return inner_batch(state, rs, **kw)

    monkeypatch.setattr(order, "replay_batch", batch_spy)
    trainer = _trainer(
        tmp_path, [{"prompt": p} for p in ROW_SETS[rows]], prompt_grad=prompt_grad, replay_batch=replay_batch
    )
    rollout = trainer.rollout(0)
    expected = {"questions": [(0, 1, 2)], "strict_prefix": [(0, 1, 2)], "two_documents": [(0,), (1, 2)]}[rows]
    assert [c.rows for c in rollout.contexts] == expected
    assert rollout.shared_frac > 0.2
    assert bool((rollout.advantages != 0).any())
    for i, r in enumerate(rollout.responses):
        with torch.no_grad():
            full = full_sequence_logprobs(trainer.model, rollout.groups[rollout.group_ids[i]].prompt_ids, r.tokens)
        assert (full - r.old_logprobs).abs().max().item() <= OLD_LOGPROB_TOL * max(full.abs().max().item(), 1.0)
    separate = _row_by_row(rollout)
    shared = _step_grads(trainer, rollout)
    assert_grads_close(shared, _reference_grads(trainer, rollout, prompt_grad == "exact"), tol=FP32_GRAD_TOL)
    assert_grads_close(shared, _step_grads(trainer, separate), tol=FP32_GRAD_TOL)
    # detached: 9 responses of 3 rows at k = 5 as 5 (3 + 2), then 4 (1 + 3); the second document's 6 as 3 and 3
    shared_batches = {"questions": [[3, 2], [1, 3]], "strict_prefix": [[3, 2], [1, 3]], "two_documents": [[3], [3]]}
    assert together == (shared_batches[rows] if replay_batch > 1 and prompt_grad == "detached" else [])
    # exact: each row's question in the batch's forward, the rows' responses as 5 and 4 (the second document: 3, 3)
    shared_exact = {"questions": [5, 4], "strict_prefix": [5, 4], "two_documents": [3, 3]}
    assert exact_rows == (shared_exact[rows] if replay_batch > 1 and prompt_grad == "exact" else [])


def test_context_column_groups_rows_wherever_they_are(tmp_path):
    """Rows naming the same `context` share it even with another document's row between them; the step's metrics
    report the contexts and the shared fraction."""
    rows = [
        {"prompt": DOC + " ? k9", "context": "doc"},
        {"prompt": OTHER + " ? k3"},
        {"prompt": DOC + " ? k18", "context": "doc"},
    ]
    trainer = _trainer(tmp_path, rows)
    rollout = trainer.rollout(0)
    assert [c.rows for c in rollout.contexts] == [(0, 2), (1,)]
    assert_grads_close(_step_grads(trainer, rollout), _reference_grads(trainer, rollout, False), tol=FP32_GRAD_TOL)
    m = trainer.train_step(0)
    assert m["contexts"] == 2 and 0.2 < m["prompt_shared_frac"] < 0.5


def test_shared_contexts_rules():
    t = torch.tensor
    doc = list(range(10))
    # consecutive rows share when the common prefix is long enough and each remainder short enough
    assert shared_contexts([t(doc + [1]), t(doc + [2, 3])], min_shared=5) == [Context(10, (0, 1))]
    assert shared_contexts([t(doc + [1]), t(doc + [2, 3])], min_shared=11) == [Context(11, (0,)), Context(12, (1,))]
    assert shared_contexts([t(doc + [1]), t(doc + [2, 3])], min_shared=5, max_suffix=1) == [
        Context(11, (0,)),
        Context(12, (1,)),
    ]
    # a row that is a strict prefix of the next: the context is that row
    assert shared_contexts([t(doc), t(doc + [4])], min_shared=5) == [Context(10, (0, 1))]
    # keys group across other rows, whatever the shared length; a key sharing no token is an error
    assert shared_contexts([t([1, 2, 3]), t([9]), t([1, 2, 4])], keys=["a", None, "a"], min_shared=99) == [
        Context(2, (0, 2)),
        Context(1, (1,)),
    ]
    with pytest.raises(ValueError, match="share no token"):
        shared_contexts([t([1, 2]), t([3, 2])], keys=["a", "a"])


@pytest.mark.parametrize("task", ["kv_retrieval", "multi_kv_retrieval", "aggregation"])
def test_rows_per_context_asks_one_document_several_questions(tmp_path, task):
    """`rows_per_context: 4`: a step's 4 rows are one document's (identical text but the question, each question about
    other pairs), captured once; the next step is the next document."""
    cfg = dict(
        model="llama",
        output_dir=str(tmp_path / "run"),
        task=task,
        prompt_length=60,
        prompts_per_step=4,
        rows_per_context=4,
        num_steps=1,
        num_generations=2,
        max_completion_length=3,
        lora=False,
        progress=False,
        threads=1,
        min_shared_prefix=16,
        task_options={"num_pairs": 6},
    )
    trainer = Trainer(TrainConfig(**cfg))
    for step in (0, 1):
        rows = trainer.examples(step)
        words = [r.prompt.split() for r in rows]
        question = {"kv_retrieval": 2, "multi_kv_retrieval": 4, "aggregation": 3}[task]
        assert all(w[:-question] == words[0][:-question] for w in words)
        assert len({" ".join(w[-question:]) for w in words}) > 1
        rollout = trainer.rollout(step)
        assert len(rollout.contexts) == 1 and rollout.shared_frac > 0.6
    assert trainer.examples(0)[0].prompt.split()[:-question] != trainer.examples(1)[0].prompt.split()[:-question]


def test_rows_by_context_orders_a_dataset_document_by_document():
    from longstraw.tasks import Example
    from longstraw.train.data import rows_by_context

    rows = [
        Example(f"p{i}", None, columns={} if c is None else {"context": c}, source=str(i))
        for i, c in enumerate(["a", "b", "a", None, "b", "a"])
    ]
    got = [r.source for r in rows_by_context(rows, 2)]
    assert got == ["0", "2", "5", "0", "1", "4", "3"]  # a's last block filled up with its first row


def test_reference_policy_logprobs_read_each_rows_suffix():
    """The KL reference policy's log-probs of rows sharing a captured prefix (`rollout.reference_policy_logprobs` with
    `suffixes`): the adapter-free model's full-sequence log-probs over [prefix + the row's suffix + response], float32
    (DESIGN.md's fp32 bound on log-probs of a tiny model, 2^10 float32 eps); responses of two rows, consecutive."""
    from longstraw.testing.models import tiny_model
    from longstraw.train.rollout import Response, reference_policy_logprobs

    from ..conftest import lora, tokens

    model = lora(tiny_model("llama"))
    prefix, suffixes = tokens(30, 1), [tokens(5, 2), tokens(7, 3)]
    rows = [(suffixes[b], tokens(6 + k, 10 * b + k)) for b in range(2) for k in range(2)]
    responses = [Response(r, torch.zeros(r.numel()), torch.ones(r.numel()), False) for _, r in rows]
    got = reference_policy_logprobs(model, prefix, responses, 1.0, 8, suffixes=[s for s, _ in rows])
    with torch.no_grad(), model.disable_adapter():
        for lp, (s, r) in zip(got, rows):
            want = full_sequence_logprobs(model, torch.cat([prefix, s]), r)
            assert (lp - want).abs().max().item() <= 2**10 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("rows", ["questions", "strict_prefix"])
def test_rows_of_a_context_sampled_together_equal_row_by_row(tmp_path, monkeypatch, rows):
    """The rows of a shared context are sampled in one ragged decode batch (`longstraw.ragged`), each row drawing from
    its own seeded generator (the rows' suffixes differ in length): the same responses as sampling row after row (stacking refused), old log-probs within
    the sampler's bound."""
    import longstraw.train.rollout as rollout_module

    trainer = _trainer(tmp_path, [{"prompt": p} for p in ROW_SETS[rows]], max_completion_length=6, temperature=1.0)
    together = trainer.rollout(0)
    monkeypatch.setattr(rollout_module, "stackable", lambda branches: False)
    alone = trainer.rollout(0)
    assert len({g.prompt_ids.numel() for g in together.groups}) == 3  # suffixes of three lengths: a ragged batch
    for a, b in zip(together.responses, alone.responses):
        assert torch.equal(a.tokens, b.tokens)
        assert (a.old_logprobs - b.old_logprobs).abs().max().item() <= OLD_LOGPROB_TOL
