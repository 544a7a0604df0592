"""User data: a JSONL file of {"prompt": ..., "answer": ...} objects, one per line."""

from __future__ import annotations

import json
from pathlib import Path

from .base import Example


def load_jsonl(path: str | Path) -> list[Example]:
    """Examples of a JSONL file, with errors that name the line."""
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
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("answer"), str):
            raise ValueError(f'{path}:{n}: each line needs string fields "prompt" and "answer"')
        out.append(Example(row["prompt"], row["answer"]))
    if not out:
        raise ValueError(f"dataset {path} is empty")
    return out
