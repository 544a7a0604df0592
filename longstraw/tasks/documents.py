"""Long-document tasks on real English text, in chat form, for real pretrained models.

The text: the docstrings of Python's standard library (`inspect.getdoc` of its modules, classes and functions), on
every machine that runs Python — technical English with code, lists and cross-references, of the kind agents read.
A document is a run of those docstrings, in a seeded order, filled to a target length in the model's tokens; into it
go sentences the question needs:

- `needle`: one sentence "The access code for the <name> archive is 4817." at a random depth; the question asks for
  that code.
- `distractors`: four such sentences for four different archives, each with its own code, at random depths; the
  question names one archive (harder: the model must tell which of four similar sentences answers it).

Each row is `{"messages": [{"role": "user", "content": ...}], "answer": "4817", "length": N, "depth": d}`; the reward
`contains_answer` (`longstraw.tasks.base`, a built-in reward name) gives 1 when the completion's first line holds the
code (the model may answer in a sentence: "The access code is 4817."). `write_document_task` writes the JSONL files for
`longstraw train`.
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

#: the stdlib modules whose docstrings make the text (pure-Python, present in every CPython 3.11+)
SOURCE_MODULES = (
    "argparse",
    "collections",
    "contextlib",
    "dataclasses",
    "email",
    "functools",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "shutil",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
    "asyncio",
    "csv",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "statistics",
    "string",
    "tempfile",
)
ARCHIVES = ("northern", "harbor", "granite", "willow", "copper", "meadow", "falcon", "cedar", "silver", "orchid")
VARIANTS = ("needle", "distractors")


def paragraphs() -> list[str]:
    """The standard library's docstrings (module, class and function level), each a paragraph of ≥ 200 chars."""
    return [text for _, text in named_paragraphs()]


def named_paragraphs() -> list[tuple[str, str]]:
    """`paragraphs()` with the module each comes from: (module name, docstring)."""
    import importlib

    seen, out = set(), []
    for name in SOURCE_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for obj in [mod, *(getattr(mod, a) for a in sorted(vars(mod)) if not a.startswith("_"))]:
            if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 200 and doc not in seen:
                seen.add(doc)
                out.append((name, doc.strip()))
    return out


def prompt_tokens(tokenizer, content: str) -> int:
    """Tokens of a one-message chat prompt as the trainer formats it (chat template, generation prompt)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_row(tokenizer, paras: list[str], length: int, variant: str, rng: random.Random) -> dict:
    """One chat row whose formatted prompt is about `length` tokens of `tokenizer`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    names = rng.sample(ARCHIVES, 1 if variant == "needle" else 4)
    codes = [f"{rng.randrange(1000, 10000)}" for _ in names]
    while len(set(codes)) < len(codes):
        codes = [f"{rng.randrange(1000, 10000)}" for _ in names]
    facts = [f"The access code for the {n} archive is {c}." for n, c in zip(names, codes)]
    asked = rng.randrange(len(names))
    question = f"\n\nQuestion: what is the access code for the {names[asked]} archive? Answer with the code."
    budget = length - prompt_tokens(tokenizer, question) - 24 * len(facts)
    order = rng.sample(range(len(paras)), len(paras))
    body, used = [], 0
    for i in order:
        n = len(tokenizer(paras[i], add_special_tokens=False)["input_ids"]) + 2
        if used + n > budget:
            continue
        body.append(paras[i])
        used += n
        if budget - used < 40:
            break
    depths = sorted(rng.random() for _ in facts)
    for d, fact in zip(reversed(depths), reversed(facts)):
        body.insert(round(d * len(body)), fact)
    content = "\n\n".join(body) + question
    return {
        "messages": [{"role": "user", "content": content}],
        "answer": codes[asked],
        "length": length,
        "depth": depths[asked],
        "variant": variant,
    }


def write_document_task(
    tokenizer,
    out: str | Path,
    lengths: list[int],
    train_rows: int,
    eval_rows: int,
    variant: str = "needle",
    seed: int = 0,
) -> dict[str, Path]:
    """Writes `train.jsonl` (`train_rows` rows, lengths cycling through `lengths`) and `eval-N.jsonl` per length
    (`eval_rows` held-out rows each, other seeds) into `out`; returns the paths by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paras = paragraphs()
    rng = random.Random(seed)
    paths = {"train": out / "train.jsonl"}
    rows = [make_row(tokenizer, paras, lengths[i % len(lengths)], variant, rng) for i in range(train_rows)]
    paths["train"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    for length in lengths:
        rng = random.Random(10_000 + seed * 1000 + length)
        path = paths[f"eval-{length}"] = out / f"eval-{length}.jsonl"
        path.write_text(
            "".join(json.dumps(make_row(tokenizer, paras, length, variant, rng)) + "\n" for _ in range(eval_rows))
        )
    return paths
