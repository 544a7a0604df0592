"""Prompt token ids computed once per dataset and tokenizer, kept in a memory-mapped Arrow file.

A 10^6-token prompt takes seconds to tokenize (9.2 s for 1.8M tokens with SmolLM2's fast tokenizer on 2 cores),
and a run reads a row's prompt at every step that draws it. `TokenCache` tokenizes each distinct prompt text once
into `FOLDER/<key>.arrow`, an Arrow IPC file with one record batch per text (column `ids`, int32), and memory-maps
it: a row's ids come from the page cache when a step needs them, and no more than that row's ids are held.

The key is the tokenizer's fingerprint (its class, its serialized vocabulary and merges, its special tokens) and the
digests of the texts, in order: another tokenizer, another chat template (applied to a chat row before its text gets
here) or other rows give another file, and nothing stale is ever read. The file is written to a temporary name and
renamed into place: an interrupted build leaves no file, and processes building the same cache at once (the ranks
of a run) each rename the same content.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import torch
from tqdm import tqdm

#: bumped when the file layout changes (part of the key)
FORMAT = 1


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of what decides a tokenizer's ids: its class, its serialized model (a fast tokenizer's JSON, or the
    vocabulary), its added and special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr(sorted(getattr(tokenizer, "special_tokens_map", {}).items())).encode())
    h.update(repr(sorted((k, str(v)) for k, v in getattr(tokenizer, "added_tokens_decoder", {}).items())).encode())
    return h.hexdigest()


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class TokenCache:
    """The token ids of `texts` under `tokenizer` (no special tokens added: a chat template writes its own), built
    in `folder` on first use and memory-mapped. `ids(text)` → `[P]` int64 ids, or None for a text it does not hold.
    Memory: the texts' digests; the ids stay on disk (4 bytes a token) until read."""

    def __init__(self, folder: str | Path, tokenizer, texts: Sequence[str], progress: bool = False):
        self._pa = pa
        digests = [_digest(t) for t in texts]
        self.index: dict[str, int] = {}
        unique: list[str] = []
        for text, d in zip(texts, digests):
            if d not in self.index:
                self.index[d] = len(unique)
                unique.append(text)
        key = hashlib.sha256(f"{FORMAT}\n{tokenizer_fingerprint(tokenizer)}\n".encode())
        key.update("\n".join(_digest(t) for t in unique).encode())
        self.path = Path(folder) / f"{key.hexdigest()[:32]}.arrow"
        #: whether this call tokenized the texts (False: the file was there)
        self.built = not self.path.is_file()
        if self.built:
            self._build(tokenizer, unique, progress)
        self._reader = pa.ipc.open_file(pa.memory_map(str(self.path), "r"))
        if self._reader.num_record_batches != len(unique):
            raise RuntimeError(f"token cache {self.path}: {self._reader.num_record_batches} rows, {len(unique)} texts")

    def _build(self, tokenizer, texts: list[str], progress: bool) -> None:
        pa = self._pa
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        schema = pa.schema([("ids", pa.int32())])
        try:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for text in tqdm(texts, desc="tokenizing prompts (once)", unit="row", disable=not progress):
                    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                    writer.write_batch(pa.record_batch([pa.array(ids, pa.int32())], schema=schema))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def ids(self, text: str) -> torch.Tensor | None:
        """`[P]` int64 token ids of `text`, or None when the cache does not hold it."""
        row = self.index.get(_digest(text))
        if row is None:
            return None
        column = self._reader.get_batch(row).column(0)
        # A copy: the column lives in a read-only memory map, and callers may write the ids they get.
        return torch.from_numpy(column.to_numpy(zero_copy_only=True).copy()).long()

    def __len__(self) -> int:
        return len(self.index)
