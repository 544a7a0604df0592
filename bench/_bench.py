"""What the benchmark scripts share: recording rows as they are measured, writing the results, the figure."""

from __future__ import annotations

import json
from pathlib import Path


def record(rows: list[dict], row: dict, out: Path) -> None:
    """Append a measured row, print it, and rewrite OUT.json, so that an interrupted run keeps what it measured."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


def finish(rows: list[dict], out: Path, plot, table) -> None:
    """Draw OUT.png with `plot(rows, path)`, write OUT.md with `table(rows)` and print that table."""
    plot(rows, out.with_suffix(".png"))
    text = table(rows)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


def memory_time_figure(series, xlabel: str, ylabels: tuple[str, str], title: str, path: Path,
                       legend_size: int = 8) -> None:
    """Write a two-panel PNG: `series` is [(label, matplotlib style, [(x, memory, time), ...])]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.5))
    for label, style, pts in series:
        if pts:
            xs, mems, times = zip(*sorted(pts))
            axes[0].plot(xs, mems, style, label=label)
            axes[1].plot(xs, times, style, label=label)
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: how a base model without a chat template (Gemma 3 270M) reads a one-message row: its text, then "Answer:"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ '\\n' }}Answer:"


def document_rows(tok, length: int, questions: int, seed: int, name: str) -> list[dict]:
    """`longstraw.tasks.documents.make_document_rows` (Q questions about one document of about `length` tokens), as
    chat rows, or as text rows formatted by `PLAIN_TEMPLATE` for a tokenizer without a chat template."""
    import random

    from longstraw.tasks.documents import make_document_rows, paragraphs

    if tok.chat_template:
        return make_document_rows(tok, paragraphs(), length, questions, random.Random(seed), name)
    tok.chat_template = PLAIN_TEMPLATE
    try:
        rows = make_document_rows(tok, paragraphs(), length, questions, random.Random(seed), name)
        return [
            {**{k: v for k, v in r.items() if k != "messages"},
             "prompt": tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)}
            for r in rows
        ]
    finally:
        tok.chat_template = None
