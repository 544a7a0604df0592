"""User data as JSONL, parquet or Arrow files, or a `datasets` save_to_disk folder.

A `DatasetDict` folder gives its `train` split, or its only one.

Every format holds the rows `longstraw.tasks.jsonl` describes: a text `prompt` or a chat `messages` per row, and any
other columns (`answer`, `context`, ...) for the reward functions. Parquet, Arrow and dataset folders are read with
Hugging Face `datasets` (the `data` extra: `pip install "longstraw[data]"`), whose Arrow tables are memory-mapped;
each row is checked and parsed into an `Example` here, before training, with errors naming the file and row.
Memory: the rows' text once (a 10^6-token prompt is ~4 MB of text).
"""

from __future__ import annotations

from pathlib import Path

from .base import Example
from .jsonl import load_jsonl, parse_or_drop

#: the file suffixes read with `datasets`, and the loader of each
TABLE_SUFFIXES = (".parquet", ".arrow")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError(
            'reading parquet, Arrow and dataset folders needs Hugging Face datasets: pip install "longstraw[data]"'
        ) from None
    return datasets


def _table(path: Path):
    """The `datasets.Dataset` at `path` (a parquet or Arrow file, or a `save_to_disk` folder)."""
    datasets = _datasets()
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise ValueError(f"dataset {path}: not a folder written by datasets' save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" in ds:
                return ds["train"]
            if len(ds) != 1:
                raise ValueError(
                    f"dataset {path} holds the splits {sorted(ds)} and none is named `train`: give the folder of one "
                    "split (DatasetDict.save_to_disk writes one per split) or save the split you train on"
                )
            return next(iter(ds.values()))
        return ds
    if path.suffix == ".parquet":
        return datasets.Dataset.from_parquet(str(path))
    return datasets.Dataset.from_file(str(path))


def load_rows(path: str | Path, tokenizer=None, dropped: list[str] | None = None) -> list[Example]:
    """The examples of a dataset: a JSONL file, a parquet or Arrow file, or a `save_to_disk` folder (module doc);
    `tokenizer` formats `messages` rows; `dropped`: a list to which a refused row's reason is added instead of raising
    (`drop_invalid_rows`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.is_file() and path.suffix not in TABLE_SUFFIXES:
        return load_jsonl(path, tokenizer, dropped)
    return table_rows(_table(path), f"dataset {path}", tokenizer, dropped)


def table_rows(table, where: str, tokenizer=None, dropped: list[str] | None = None) -> list[Example]:
    """The examples of a `datasets.Dataset` (or any sequence of row dicts) in memory; `where` names it in errors
    ("dataset data.parquet", "train_dataset"); `dropped` as `load_rows`'."""
    columns = getattr(table, "column_names", None)
    if columns is not None and not any(c in columns for c in ("prompt", "messages")):
        raise ValueError(
            f'{where}: its columns are {columns}; a row needs a "prompt" (text or a chat) or "messages" (a chat) column'
        )
    parsed = [parse_or_drop(_present(row), f"{where} row {i}", tokenizer, dropped) for i, row in enumerate(table)]
    out = [ex for ex in parsed if ex is not None]
    if not out and dropped:
        raise ValueError(f"{where}: every row was dropped (the first: {dropped[0]}): fix the rows")
    if not out:
        raise ValueError(f"{where} is empty")
    return out


def _present(row) -> dict:
    """A table row without the columns it leaves empty: a table with both a `prompt` and a `messages` column holds
    one of them per row, the other null (as JSONL rows omit the field)."""
    if not isinstance(row, dict):
        return row  # parse_row names what it is not
    return {k: v for k, v in row.items() if v is not None}
