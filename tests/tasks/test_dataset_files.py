"""Datasets in the formats users have (`longstraw.tasks.dataset_files`): parquet, Arrow and `save_to_disk` folders hold
the rows their JSONL twin holds, train the same run bit for bit, and are refused with the file named when malformed."""

import json

import pytest

datasets = pytest.importorskip("datasets")

from longstraw.tasks.dataset_files import load_rows  # noqa: E402
from longstraw.tasks.jsonl import load_jsonl  # noqa: E402
from longstraw.train.config import TrainConfig  # noqa: E402
from longstraw.train.trainer import Trainer  # noqa: E402

from ..train.test_trainer import _same  # noqa: E402

def _doc(d: int) -> str:
    return " ".join(f"k{j} v{(3 * j) % 8}" for j in range(3 * d, 3 * d + 3))


#: three documents of three questions each, the document first (so that a document's rows share their prefix)
ROWS = [
    {"prompt": f"{_doc(i // 3)} ? k{i} =", "answer": f"v{(3 * i) % 8}", "context": f"doc{i // 3}", "difficulty": i % 2}
    for i in range(9)
]


def _formats(tmp_path, rows=ROWS) -> dict:
    """The same rows as a JSONL file, a parquet file, an Arrow file, a Dataset folder and a DatasetDict folder."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "splits"))
    arrow = next((tmp_path / "folder").glob("*.arrow"))  # the Arrow file save_to_disk wrote
    return {"jsonl": jsonl, "parquet": tmp_path / "rows.parquet", "arrow": arrow, "folder": tmp_path / "folder",
            "splits": tmp_path / "splits"}


def test_every_format_holds_the_rows_of_its_jsonl_twin(tmp_path):
    files = _formats(tmp_path)
    want = [(e.prompt, e.answer, e.columns) for e in load_jsonl(files["jsonl"])]
    assert [c["context"] for _, _, c in want] == [r["context"] for r in ROWS]
    for name, path in files.items():
        assert [(e.prompt, e.answer, e.columns) for e in load_rows(path)] == want, name


def test_chat_rows_from_parquet_use_the_chat_template(tmp_path):
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(m["content"] for m in messages) + ">"

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": f"a{i}"} for i in range(3)]
    files = _formats(tmp_path, rows)
    got = load_rows(files["parquet"], Tok())
    assert [e.prompt for e in got] == ["q0>", "q1>", "q2>"] and [e.messages for e in got] == [r["messages"] for r in rows]


def test_malformed_tables_are_refused_naming_the_file(tmp_path):
    datasets.Dataset.from_list([{"question": "a"}]).to_parquet(str(tmp_path / "q.parquet"))
    with pytest.raises(ValueError, match=r"q.parquet: its columns are \['question'\]"):
        load_rows(tmp_path / "q.parquet")
    datasets.Dataset.from_list([{"prompt": "a", "answer": 3}]).to_parquet(str(tmp_path / "n.parquet"))
    with pytest.raises(ValueError, match=r'n.parquet row 0: "answer" must be a string'):
        load_rows(tmp_path / "n.parquet")
    two = datasets.Dataset.from_list([{"prompt": "a"}])
    datasets.DatasetDict({"a": two, "b": two}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\] and none is named `train`"):
        load_rows(tmp_path / "ab")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a folder written by datasets' save_to_disk"):
        load_rows(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(tmp_path / "nope.parquet")


@pytest.mark.parametrize("fmt", ["parquet", "folder"])
def test_a_parquet_file_and_a_datasets_folder_train_the_jsonl_run(tmp_path, fmt):
    """A run on the parquet file or the save_to_disk folder equals, metric for metric, the run on the JSONL file of
    the same rows (same rows, same order, same held-out split)."""
    files = _formats(tmp_path)
    runs = []
    for name in ("jsonl", fmt):
        cfg = TrainConfig(model="llama", output_dir=str(tmp_path / f"run-{name}"), dataset=str(files[name]),
                          num_steps=2, num_generations=4, max_completion_length=2, prompts_per_step=2, progress=False,
                          threads=1, learning_rate=1e-2, lora=True, eval_fraction=0.2, rows_per_context=2)
        trainer = Trainer(cfg)
        runs.append(([e.prompt for e in trainer.data.rows], trainer.train()))
    assert runs[0][0] == runs[1][0]
    _same(runs[0][1], runs[1][1])
