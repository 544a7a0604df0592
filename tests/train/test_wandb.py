"""`report_to: [wandb]` (`longstraw.train.metrics`): a `GRPOTrainer` run in wandb's offline mode writes its run files
under `output_dir/wandb`, read back here from the run's `.wandb` file with wandb's own record type (its protobuf
`Record`) and held to the run's metrics.jsonl; a resumed run continues the same wandb run."""

import json
import struct
import sys
import time
from pathlib import Path

import pytest
from transformers import TrainerCallback

from longstraw import GRPOTrainer

from .test_trl_shape import ROWS, _args, reward_len


def history(run_file: Path) -> tuple[str, list[dict]]:
    """(the run's id, its history rows) from a `.wandb` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log records (in 32 KiB blocks, each a 7-byte header: checksum, length, type 1 full / 2 first / 3 middle /
    4 last) holding wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, rows, run_id = 7, 32768, b"", [], None
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "run":
                run_id = rec.run.run_id
            elif rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return str(run_id), rows


def settled(run_file: Path, rows: int, timeout_s: float = 60.0) -> tuple[str, list[dict]]:
    """`history(run_file)` once it holds its run record and `rows` history rows: wandb's service process writes the
    file and may still be writing it when `wandb.finish` returns (seen on a loaded machine: a resumed run's file read
    without its run record); after `timeout_s`, whatever it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = history(run_file)
        if (got[0] != "None" and len(got[1]) >= rows) or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


class StopAt2(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        control.should_training_stop = state.global_step == 2
        return control


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline with its settings under tmp_path; the process as it was after (wandb's `init` leaves its
    exception hook and import hook installed, and importing it wraps the console streams' `write`)."""
    streams = [(s, vars(s).get("write")) for s in (sys.stdout, sys.stderr) if hasattr(s, "__dict__")]
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    yield wandb
    wandb.teardown()  # the wandb-core service this process started
    for stream, write in streams:
        if write is None:
            vars(stream).pop("write", None)
        else:
            stream.write = write


def test_report_to_wandb_logs_every_step_under_trls_names_and_a_resume_continues_the_run(tmp_path, offline):
    """4 steps, stopped after step 2 and resumed (`resume_from_checkpoint=True`): two offline run folders under
    `output_dir/wandb` of one wandb run id, whose history rows are steps 1-4 with `train/reward`, `train/loss`,
    `train/completions/mean_length` and `train/learning_rate` equal to metrics.jsonl's values."""
    args = _args(tmp_path, "run", report_to=["wandb"])
    first = GRPOTrainer(model="llama", reward_funcs=reward_len, args=args, train_dataset=ROWS, callbacks=[StopAt2()])
    assert first.train().global_step == 2
    again = GRPOTrainer(model="llama", reward_funcs=reward_len, args=args, train_dataset=ROWS)
    assert again.train(resume_from_checkpoint=True).global_step == 4

    out = tmp_path / "run"
    runs = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2
    read = [settled(p, rows=2) for p in runs]
    assert read[0][0] == read[1][0] == (out / "wandb" / "run_id").read_text()
    rows = [r for _, part in read for r in part]
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["_step"] for r in rows] == [m["step"] for m in jsonl] == [1, 2, 3, 4]
    for r, m in zip(rows, jsonl):
        for name, ours in (("train/reward", "reward"), ("train/loss", "loss"),
                           ("train/completions/mean_length", "completion_length"), ("train/learning_rate", "lr")):
            assert r[name] == pytest.approx(m[ours], rel=1e-12), (name, r[name], m[ours])


def test_report_to_wandb_without_the_package_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    trainer = GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "run", report_to="wandb"),
                          train_dataset=ROWS)
    with pytest.raises(ValueError, match=r"report_to: wandb needs the `wandb` package \(pip install wandb\)"):
        trainer.train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
