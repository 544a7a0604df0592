"""The long-document task on real text: prompts of the asked length in the real model's tokens, the facts the
question needs inside, and the reward that reads a code out of a sentence."""

import random

import pytest
import torch

from longstraw.tasks.base import contains_answer
from longstraw.tasks.documents import make_row, paragraphs, prompt_tokens


def test_contains_answer_reads_the_code_from_the_first_line():
    got = contains_answer(None, ["The access code is 4817.", "4817", "It is 48170.", "no\n4817", "code: 14817"],
                          ["4817"] * 5)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.real
@pytest.mark.parametrize("length,variant", [(2048, "needle"), (6144, "distractors")])
def test_rows_have_the_length_and_the_facts(real_smollm2, length, variant):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_smollm2)
    paras = paragraphs()
    assert len(paras) > 200 and sum(map(len, paras)) > 150_000  # about 50K tokens of text to draw from
    rows = [make_row(tok, paras, length, variant, random.Random(s)) for s in range(3)]
    for row in rows:
        content = row["messages"][0]["content"]
        n = prompt_tokens(tok, content)
        assert 0.95 * length <= n <= length, n
        facts = [line for line in content.split("\n\n") if line.startswith("The access code for the")]
        assert len(facts) == (1 if variant == "needle" else 4)
        asked = content.rsplit("Question: what is the access code for the ", 1)[1].split(" archive")[0]
        assert [f for f in facts if f" {asked} archive" in f] == [f"The access code for the {asked} archive is "
                                                                  f"{row['answer']}."]
    assert len({r["messages"][0]["content"] for r in rows}) == 3


@pytest.mark.real
def test_document_rows_share_the_document_and_ask_each_their_own_question(real_smollm2):
    """Q rows of one document: the same text up to the question in the model's tokens (the chat template around it),
    each asking about another archive whose code is in the text; the shared prefix is nearly the whole prompt."""
    from transformers import AutoTokenizer

    from longstraw.tasks.documents import make_document_rows
    from longstraw.train.sharing import shared_contexts

    tok = AutoTokenizer.from_pretrained(real_smollm2)
    rows = make_document_rows(tok, paragraphs(), 2048, 4, random.Random(0), "doc 0")
    assert len({r["context"] for r in rows}) == 1 and len({r["answer"] for r in rows}) == 4
    ids = []
    for row in rows:
        content = row["messages"][0]["content"]
        assert f"archive is {row['answer']}." in content
        text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        ids.append(torch.tensor(tok(text, add_special_tokens=False)["input_ids"]))
        assert 0.95 * 2048 <= ids[-1].numel() <= 2048
    (ctx,) = shared_contexts(ids, keys=[r["context"] for r in rows])
    assert ctx.rows == (0, 1, 2, 3) and ctx.length >= min(i.numel() for i in ids) - 30


@pytest.mark.real
def test_a_document_past_the_first_texts_length_goes_on_with_more_text(real_smollm2, monkeypatch):
    """A 100K-token document (past the ~54K tokens of `SOURCE_MODULES`' docstrings) reaches its length with
    `MORE_MODULES`' text, no paragraph twice, 16 questions on 16 archives; a document the first text fills is the one
    made without the more text (the same rows for the same seed: earlier benchmarks' documents are unchanged)."""
    from transformers import AutoTokenizer

    from longstraw.tasks import documents
    from longstraw.tasks.documents import make_document_rows

    tok = AutoTokenizer.from_pretrained(real_smollm2)
    rows = make_document_rows(tok, paragraphs(), 100_000, 16, random.Random(1), "long")
    assert len({r["answer"] for r in rows}) == 16
    assert len({r["messages"][0]["content"].rsplit(" archive?", 1)[0].rsplit(" ", 1)[-1] for r in rows}) == 16
    n = prompt_tokens(tok, rows[0]["messages"][0]["content"])
    assert 0.95 * 100_000 <= n <= 100_000
    text = rows[0]["messages"][0]["content"]
    more = documents.more_paragraphs()
    assert max(text.count(p) for p in paragraphs() + more) == 1
    assert sum(p in text for p in more) > 100
    short = make_document_rows(tok, paragraphs(), 4096, 4, random.Random(2), "short")
    monkeypatch.setattr(documents, "MORE_MODULES", ())
    assert make_document_rows(tok, paragraphs(), 4096, 4, random.Random(2), "short") == short
