"""An agent task on real English text: a long document behind tools, several turns, a verifiable answer.

The document is the standard library's docstrings (`longstraw.tasks.documents`) in `num_sections` numbered sections
of about `section_tokens` tokens each; one sentence, "The access code for the <name> archive is 4817.", sits in one
of them. The prompt shows the section titles (the modules the text comes from) and the three tools; by default the
document itself is only behind them. With `document_in_prompt` the whole document is in the prompt as well (a long
shared prompt, captured once, whose G trajectories each grow by their own tool replies), and with `distractors` as
many other archives' codes are planted in other sections (reading the prompt for "access code" finds several):

- `search <word>`: the sentences holding the word, each with its section number (at most 8);
- `open <n>`: section n, whole (hundreds to thousands of tokens: the context grows by it);
- `answer <code>`: the final answer, which ends the trajectory.

A turn calls a tool by writing its command on a line (`parse_commands`), or in the chat format
`<tool_call>{"name": "search", "arguments": {"word": "harbor"}}</tool_call>`. The environment (`ArchiveTools`, TRL's
`environment_factory` convention) scores the trajectory (`environment_reward`): 1 for the right code, 0.25 for one
that read the code but did not answer it, 0 otherwise; success in the benchmark counts the right code only.
`GuidedArchiveTools` adds a rung below those (`tool_reward`, 0.05, for a trajectory that used a tool to any effect: a
search with a hit or an open of a section): a denser signal for a small model that rarely reaches the code at first.
Rows are `{"messages": [...], "answer": "4817", "archive": "harbor", "sections": [...], "titles": [...]}`;
`write_archive_task` writes the JSONL files for `longstraw train` with `environment:
longstraw.tasks.archive_tools:ArchiveTools` and `tool_parser: longstraw.tasks.archive_tools:parse_commands`.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from ..agent.environment import ToolCall, parse_tool_calls
from .documents import ARCHIVES, named_paragraphs

_COMMAND = re.compile(r"^\W*(search|open|answer)\b[\s:]*[\"'“”‘’`<(\[]*([\w-]+)", re.IGNORECASE | re.MULTILINE)
_ARGUMENT = {"search": "word", "open": "section", "answer": "code"}


def parse_commands(text: str) -> list[ToolCall]:
    """The chat format's tool calls if there are any, else the first line that starts with `search`, `open` or
    `answer`: its first word after the command (quotes and brackets dropped) is the argument."""
    calls = parse_tool_calls(text)
    if calls:
        return calls
    m = _COMMAND.search(text)
    if m is None:
        return []
    name = m.group(1).lower()
    return [ToolCall(name, {_ARGUMENT[name]: m.group(2)})]


class ArchiveTools:
    """The environment of one trajectory (see the module doc)."""

    #: the reward of a trajectory that used a tool to some effect (a search with a hit, an open of a section) without
    #: reading the code; 0 here, `GuidedArchiveTools` sets it
    tool_reward: float = 0.0

    def reset(self, sections=(), titles=(), answer="", archive="", **columns):
        self.sections, self.code, self.archive = list(sections), str(answer), archive
        self.done, self.reward, self.found, self.used = False, 0.0, False, False

    def search(self, word: str) -> str:
        """Sentences holding `word`, each with its section number."""
        word = str(word).strip().lower()
        if not word:
            return "search needs a word"
        hits = []
        for i, text in enumerate(self.sections, 1):
            for sentence in re.split(r"(?<=[.!?])\s+", text):
                if word in sentence.lower():
                    hits.append(f"[section {i}] {sentence.strip()}")
                    self.found |= len(hits) <= 8 and self.code in sentence
        self.used |= bool(hits)
        return "\n".join(hits[:8]) if hits else f"no sentence holds {word!r}"

    def open(self, section) -> str:
        """Section `section` (1-based), whole."""
        try:
            n = int(str(section).strip().lstrip("#"))
        except ValueError:
            return f"open needs a section number 1..{len(self.sections)}; got {section!r}"
        if not 1 <= n <= len(self.sections):
            return f"there is no section {n}: sections are 1..{len(self.sections)}"
        self.found |= self.code in self.sections[n - 1]
        self.used = True
        return self.sections[n - 1]

    def answer(self, code) -> str:
        """The final answer: ends the trajectory."""
        self.done = True
        self.reward = float(str(code).strip(" .") == self.code)
        return "answer recorded"

    def get_reward(self) -> float:
        """1 for the right code; 0.25 for a trajectory that read the code (a search hit or the opened section) but
        did not answer it; `tool_reward` for one that used a tool to some effect; 0 otherwise."""
        return self.reward or 0.25 * self.found or self.tool_reward * self.used


class GuidedArchiveTools(ArchiveTools):
    """`ArchiveTools` whose reward also pays 0.05 for a trajectory that searched with a hit or opened a section (and
    read no code): 1 > 0.25 > 0.05 > 0, each rung a step towards the answer."""

    tool_reward = 0.05


INSTRUCTIONS = (
    "You have tools to read a long document. Call one tool per turn by writing one line:\n"
    "search <word>  - find the sentences that hold a word\n"
    "open <number>  - read a section\n"
    "answer <code>  - give your final answer\n\n"
    "The document's sections:\n{titles}\n\n"
    "Question: what is the access code for the {archive} archive? Use the tools, then answer with the code."
)


def make_row(
    tokenizer,
    paras: list[tuple[str, str]],
    num_sections: int,
    section_tokens: int,
    rng: random.Random,
    document_in_prompt: bool = False,
    distractors: int = 0,
) -> dict:
    """One row: `num_sections` sections of about `section_tokens` tokens, the code in one of them (and each of
    `distractors` other archives' codes in another section); the document also in the prompt with
    `document_in_prompt`."""
    if not 0 <= distractors < len(ARCHIVES) - 1:
        raise ValueError(f"distractors must be in 0..{len(ARCHIVES) - 2}; got {distractors}")
    archive = rng.choice(ARCHIVES)
    code = f"{rng.randrange(1000, 10000)}"
    order = rng.sample(range(len(paras)), len(paras))
    sections, titles, k = [], [], 0
    for _ in range(num_sections):
        body, used, names = [], 0, []
        while k < len(order) and used < section_tokens:
            name, text = paras[order[k]]
            k += 1
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if used + n > 1.5 * section_tokens:
                continue
            body.append(text)
            names.append(name)
            used += n
        sections.append("\n\n".join(body))
        titles.append(", ".join(dict.fromkeys(names)))
    where = rng.randrange(num_sections)
    _plant(sections, where, archive, code, rng)
    distracting = rng.sample([a for a in ARCHIVES if a != archive], distractors)
    for name in distracting:
        _plant(sections, rng.randrange(num_sections), name, f"{rng.randrange(1000, 10000)}", rng)
    listing = "\n".join(f"{i}. {t}" for i, t in enumerate(titles, 1))
    content = INSTRUCTIONS.format(titles=listing, archive=archive)
    other = rng.choice([a for a in ARCHIVES if a != archive and a not in distracting])
    shown = f"{rng.randrange(1000, 10000)}"
    example = [  # one worked exchange before the question (a small model follows the form it has seen)
        {"role": "user", "content": f"Example question: what is the access code for the {other} archive?"},
        {"role": "assistant", "content": f"search {other}"},
        {"role": "tool", "content": f"[section 2] The access code for the {other} archive is {shown}."},
        {"role": "assistant", "content": f"answer {shown}"},
    ]
    head = []
    if document_in_prompt:  # a system message ahead of the worked example, so that the question follows the example
        shown_doc = "\n\n".join(f"[section {i}]\n{text}" for i, text in enumerate(sections, 1))
        head = [{"role": "system", "content": f"The document:\n\n{shown_doc}"}]
    return {
        "messages": [*head, *example, {"role": "user", "content": content}],
        "answer": code,
        "archive": archive,
        "sections": sections,
        "titles": titles,
        "section": where + 1,
    }


def _plant(sections: list[str], at: int, archive: str, code: str, rng: random.Random) -> None:
    """Puts the sentence giving `archive`'s code between two paragraphs of section `at`."""
    parts = sections[at].split("\n\n")
    parts.insert(rng.randrange(len(parts) + 1), f"The access code for the {archive} archive is {code}.")
    sections[at] = "\n\n".join(parts)


def write_archive_task(
    tokenizer,
    out: str | Path,
    train_rows: int,
    eval_rows: int,
    num_sections: int = 8,
    section_tokens: int = 400,
    seed: int = 0,
    document_in_prompt: bool = False,
    distractors: int = 0,
) -> dict[str, Path]:
    """Writes `train.jsonl` and `eval.jsonl` (held-out rows, another seed) into `out`; returns their paths.
    `document_in_prompt` and `distractors` as in `make_row`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paras = named_paragraphs()
    paths = {}
    for name, rows, s in (("train", train_rows, seed), ("eval", eval_rows, 10_000 + seed)):
        rng = random.Random(s)
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text(
            "".join(
                json.dumps(
                    make_row(tokenizer, paras, num_sections, section_tokens, rng, document_in_prompt, distractors)
                )
                + "\n"
                for _ in range(rows)
            )
        )
    return paths
