"""Long-document tasks on real English text, in chat form, for real pretrained models.

The text: the docstrings of Python's standard library (`inspect.getdoc` of its modules, classes and functions), on
every machine that runs Python — technical English with code, lists and cross-references, of the kind agents read.
A document is a run of those docstrings, in a seeded order, filled to a target length in the model's tokens; into it
go sentences the question needs:

- `needle`: one sentence "The access code for the <name> archive is 4817." at a random depth; the question asks for
  that code.
- `distractors`: four such sentences for four different archives, each with its own code, at random depths; the
  question names one archive (harder: the model must tell which of four similar sentences answers it).

- `questions` (`make_document_rows`): Q such sentences for Q archives in one document, and Q rows that read the same
  document and each ask about another archive, with a `context` column naming the document: the many-questions
  shape of long-document QA, whose rows share their prompt up to the question (`longstraw.train.sharing`).

Each row is `{"messages": [{"role": "user", "content": ...}], "answer": "4817", "length": N, "depth": d}`; the reward
`contains_answer` (`longstraw.tasks.base`, a built-in reward name) gives 1 when the completion's first line holds the
code (the model may answer in a sentence: "The access code is 4817."). `write_document_task` writes the JSONL files for
`longstraw train`.
"""

from __future__ import annotations

import importlib
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
#: more modules, read only when a document outgrows `SOURCE_MODULES`' text (~54K Gemma 3 tokens; with these ~136K):
#: documents that fit the first pool are the same as before these were added
MORE_MODULES = tuple(
    "os re socket ssl sqlite3 multiprocessing concurrent.futures unittest.mock importlib ast configparser optparse "
    "pydoc doctest mailbox imaplib smtplib ftplib xmlrpc.client http.server http.cookiejar urllib.request calendar "
    "locale gettext codecs selectors queue sched heapq bisect random numbers operator copy pprint reprlib weakref "
    "types abc traceback warnings glob fnmatch filecmp gzip bz2 lzma hashlib hmac secrets base64 binascii "
    "html.parser plistlib netrc platform sysconfig zipapp trace tracemalloc pdb cProfile pstats timeit tomllib wave "
    "colorsys ipaddress uuid socketserver wsgiref.handlers xml.dom.minidom xml.sax shlex cmd code codeop dis "
    "tokenize pickletools zoneinfo graphlib contextvars signal struct io getopt getpass urllib.robotparser "
    "http.cookies logging.handlers logging.config".split()
)
ARCHIVES = ("northern", "harbor", "granite", "willow", "copper", "meadow", "falcon", "cedar", "silver", "orchid")
#: archives a document of more than 10 questions also names (one of 10 or fewer draws from `ARCHIVES` alone)
MORE_ARCHIVES = ("juniper", "basalt", "lantern", "tundra", "sparrow", "quartz", "maple", "onyx", "heron", "aspen")
VARIANTS = ("needle", "distractors")


def paragraphs() -> list[str]:
    """The standard library's docstrings (module, class and function level), each a paragraph of ≥ 200 chars."""
    return [text for _, text in named_paragraphs()]


def more_paragraphs() -> list[str]:
    """Docstrings of `MORE_MODULES` (the same rule as `paragraphs()`), none of them in `paragraphs()`: the text a
    document past the first pool's length goes on with."""
    first = set(paragraphs())
    return [text for _, text in named_paragraphs(MORE_MODULES) if text not in first]


def named_paragraphs(modules: tuple[str, ...] = SOURCE_MODULES) -> list[tuple[str, str]]:
    """`paragraphs()` with the module each comes from: (module name, docstring)."""
    seen, out = set(), []
    for name in modules:
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
    body = _fill(tokenizer, paras, budget, rng)
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


def make_document_rows(
    tokenizer, paras: list[str], length: int, questions: int, rng: random.Random, document: str
) -> list[dict]:
    """`questions` chat rows of one document of about `length` tokens of `tokenizer`: the same text (Q access-code
    sentences at random depths) and each its own question, last; `context`: `document`, the rows' shared name."""
    pool = ARCHIVES if questions <= len(ARCHIVES) else ARCHIVES + MORE_ARCHIVES
    if not 1 <= questions <= len(pool):
        raise ValueError(f"questions must be in [1, {len(ARCHIVES + MORE_ARCHIVES)}] (one archive each)")
    names = rng.sample(pool, questions)
    codes = rng.sample(range(1000, 10000), questions)
    asks = [f"\n\nQuestion: what is the access code for the {n} archive? Answer with the code." for n in names]
    budget = length - max(prompt_tokens(tokenizer, q) for q in asks) - 24 * questions
    body = _fill(tokenizer, paras, budget, rng)
    depths = sorted(rng.random() for _ in names)
    at = {}
    for d, n, c in zip(reversed(depths), reversed(names), reversed(codes)):
        body.insert(round(d * len(body)), f"The access code for the {n} archive is {c}.")
        at[n] = d
    text = "\n\n".join(body)
    return [
        {
            "messages": [{"role": "user", "content": text + q}],
            "answer": str(c),
            "length": length,
            "depth": at[n],
            "variant": "questions",
            "context": document,
        }
        for n, c, q in zip(names, codes, asks)
    ]


def _fill(tokenizer, paras: list[str], budget: int, rng: random.Random) -> list[str]:
    """Paragraphs in a seeded order, as many as fit in `budget` tokens; past `paras`' text, `more_paragraphs()` in a
    seeded order (a document that `paras` fills draws from `rng` exactly as before those were added)."""
    body, used = _take(tokenizer, paras, budget, rng)
    if budget - used >= 40:
        more, _ = _take(tokenizer, more_paragraphs(), budget - used, rng)
        body += more
    return body


def _take(tokenizer, paras: list[str], budget: int, rng: random.Random) -> tuple[list[str], int]:
    """(paragraphs of `paras` in a seeded order that fit in `budget` tokens, the tokens they take)."""
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
    return body, used


def write_document_task(
    tokenizer,
    out: str | Path,
    lengths: list[int],
    train_rows: int,
    eval_rows: int,
    variant: str = "needle",
    seed: int = 0,
    questions: int = 1,
) -> dict[str, Path]:
    """Writes `train.jsonl` (`train_rows` rows, lengths cycling through `lengths`) and `eval-N.jsonl` per length
    (`eval_rows` held-out rows each, other seeds) into `out`; returns the paths by name. `questions` > 1: rows come
    `questions` per document (`make_document_rows`; held-out rows from held-out documents) and `variant` is unused."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paras = paragraphs()

    def rows_of(n: int, length_of, rng: random.Random, name: str) -> list[dict]:
        if questions == 1:
            return [make_row(tokenizer, paras, length_of(i), variant, rng) for i in range(n)]
        rows: list[dict] = []
        while len(rows) < n:
            d = len(rows) // questions
            rows += make_document_rows(tokenizer, paras, length_of(d), questions, rng, f"{name} document {d}")
        return rows[:n]

    paths = {"train": out / "train.jsonl"}
    rows = rows_of(train_rows, lambda i: lengths[i % len(lengths)], random.Random(seed), "train")
    paths["train"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    for length in lengths:
        rng = random.Random(10_000 + seed * 1000 + length)
        path = paths[f"eval-{length}"] = out / f"eval-{length}.jsonl"
        held = rows_of(eval_rows, lambda i, n=length: n, rng, f"eval-{length}")
        path.write_text("".join(json.dumps(r) + "\n" for r in held))
    return paths
