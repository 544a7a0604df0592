"""User data: a JSONL file, one row per line, each a text `prompt` or a chat `messages`.

    {"prompt": "k3 v1 k7 v5 ? k3 =", "answer": "v1"}
    {"messages": [{"role": "user", "content": "..."}], "answer": "v1", "difficulty": 2}
    {"prompt": [{"role": "user", "content": "..."}], "answer": "v1"}     (TRL's conversational format)

A `messages` row is formatted with the tokenizer's chat template, generation prompt added (the text the
model continues). Every other field (`answer`, `difficulty`, ...) is handed to the reward functions as
a keyword list, one entry per completion, as TRL does. Errors name the file and line, before training.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import Example

PROMPT_FIELDS = ("prompt", "messages")


def _chat(tokenizer, messages, where: str) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where}: a `messages` row needs a tokenizer with a chat template (tokenizer.chat_template "
            "is not set); give text `prompt` rows, a model folder whose tokenizer has one, or `chat_template_path`"
        )
    if (
        not isinstance(messages, list)
        or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        or not messages
    ):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(messages):  # an assistant turn that calls tools may have no text
        blank = not m["content"] or (isinstance(m["content"], str) and not m["content"].strip())
        if blank and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f'{where}: message {i} ({m["role"]}) has an empty "content": give its text or drop it')
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def parse_row(row, where: str, tokenizer=None) -> Example:
    """One JSON object as an `Example`; `where` ("file:line") names it in errors."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    has = [f for f in PROMPT_FIELDS if f in row]
    if len(has) != 1:
        raise ValueError(
            f'{where}: each row needs exactly one of the fields "prompt" (text) or "messages" (a chat); '
            f"found {has or 'neither'}"
        )
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f'{where}: "answer" must be a string')
    columns = {k: v for k, v in row.items() if k not in (*PROMPT_FIELDS, "answer")}
    messages = row.get("messages")
    if has == ["prompt"] and isinstance(row["prompt"], list):  # TRL's conversational format: the chat as `prompt`
        messages = row["prompt"]
    elif has == ["prompt"]:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f'{where}: "prompt" must be a non-empty string or a chat (a list of messages)')
        return Example(row["prompt"], answer, columns=columns, source=where)
    return Example(_chat(tokenizer, messages, where), answer, messages=messages, columns=columns, source=where)


def parse_or_drop(row, where: str, tokenizer, dropped: list[str] | None) -> Example | None:
    """`parse_row`, or, with a `dropped` list (`drop_invalid_rows`), None for a row it refuses, its reason kept."""
    if dropped is None:
        return parse_row(row, where, tokenizer)
    try:
        return parse_row(row, where, tokenizer)
    except ValueError as e:
        dropped.append(str(e))
        return None


def load_jsonl(path: str | Path, tokenizer=None, dropped: list[str] | None = None) -> list[Example]:
    """Examples of a JSONL file (see the module doc); `tokenizer` formats `messages` rows. `dropped`: a list to
    which a refused row's reason is added instead of raising (`drop_invalid_rows`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        ex = parse_or_drop(row, f"{path}:{n}", tokenizer, dropped)
        if ex is not None:
            out.append(ex)
    if not out and dropped:
        raise ValueError(f"dataset {path}: every row was dropped (the first: {dropped[0]}): fix the rows")
    if not out:
        raise ValueError(f"dataset {path} is empty")
    return out
