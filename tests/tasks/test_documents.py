"""The long-document task on real text: prompts of the asked length in the real model's tokens, the facts the
question needs inside, and the reward that reads a code out of a sentence."""

import random

import pytest

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
