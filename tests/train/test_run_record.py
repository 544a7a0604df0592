"""A run's `config.yaml` records what ran (`longstraw.train.run_record`); `longstraw eval RUN` evaluates that or
refuses naming the flag that supplies it; a resume of another run, or of a finished schedule, is refused by name.

References independent of the code under test: the rows' canonical JSON hashed here with hashlib, their token counts
from the tokenizer, the accuracy the trained trainer itself measures in the same process, the learning-rate schedule's
closed form."""

import hashlib
import json
import statistics

import pytest
import torch
import yaml

from longstraw import GRPOConfig, GRPOTrainer, cli
from longstraw.tasks import build_tokenizer
from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

from .test_trl_shape import OWN, ROWS


def reward_digits(completions, **kwargs):
    """Importable by name: `tests.train.test_run_record:reward_digits`."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def reward_zero(completions, **kwargs):
    return [0.0] * len(completions)


def _args(tmp_path, **kw):
    return GRPOConfig(output_dir=str(tmp_path / "run"), learning_rate=1e-2, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=2, seed=7, longstraw=dict(OWN), **kw)


def _sha256_of(rows):
    text = "".join(json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n" for r in rows)
    return hashlib.sha256(text.encode()).hexdigest()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_dataset_run_records_its_rows_rewards_lengths_and_trl_config(tmp_path):
    datasets = pytest.importorskip("datasets")
    funcs = [reward_digits, lambda completions, **kw: [0.0] * len(completions)]
    trainer = GRPOTrainer(model="llama", reward_funcs=funcs, args=_args(tmp_path),
                          train_dataset=datasets.Dataset.from_list(ROWS))
    trainer.train()
    values = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    record = values["record"]
    assert record["data"] == {"source": "a datasets.Dataset passed to the trainer", "rows": 6,
                              "sha256": _sha256_of(ROWS)}
    assert record["reward_funcs"] == [
        "tests.train.test_run_record:reward_digits",
        "a callable with no import path (test_a_dataset_run_records_its_rows_rewards_lengths_and_trl_config.<locals>."
        "<lambda>)",
    ]
    assert values["reward_funcs"] == []  # not every one can be called again from the file
    lengths = [len(build_tokenizer()(r["prompt"], add_special_tokens=False)["input_ids"]) for r in ROWS]
    assert record["prompt_tokens"] == {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)}
    assert record["trl_config"] == {"output_dir": str(tmp_path / "run"), "learning_rate": 1e-2,
                                    "per_device_train_batch_size": 4, "num_generations": 2,
                                    "max_completion_length": 4, "max_steps": 2, "seed": 7, "longstraw": OWN}
    assert record["model"]["source"] == "llama"
    # the replay order the run chose once: a step's 4 responses (2 prompts × 2) in one batch (replay_batch: auto)
    assert record["replay_order"] == "whole responses, 4 at a time"


def test_eval_of_an_in_memory_run_refuses_until_told_its_data_and_rewards(tmp_path, capsys):
    def in_script(completions, **kwargs):
        return reward_zero(completions)

    trainer = GRPOTrainer(model="llama", reward_funcs=[reward_digits, in_script], args=_args(tmp_path),
                          train_dataset=ROWS)
    trainer.train()
    want = trainer.evaluate()
    run = str(tmp_path / "run")
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"run trained on a list of rows passed to the trainer \(6 rows, sha256 "
                                         r"[0-9a-f]{12}\): pass --dataset FILE holding those rows"):
        cli.main(["eval", run])
    data = _jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(SystemExit, match=r"cannot call again \(a callable with no import path .*in_script\)\): pass "
                                         r"--reward module:function"):
        cli.main(["eval", run, "--dataset", str(data)])
    rewards = ["--reward", "tests.train.test_run_record:reward_digits",
               "--reward", "tests.train.test_run_record:reward_zero"]
    other = _jsonl(tmp_path / "other.jsonl", ROWS[:5])
    with pytest.raises(SystemExit, match=r"other\.jsonl holds other rows \(5 rows"):
        cli.main(["eval", run, "--dataset", str(other), *rewards])
    capsys.readouterr()
    assert cli.main(["eval", run, "--dataset", str(data), *rewards]) == 0
    out = capsys.readouterr().out
    assert list(want) == ["held-out rows"]
    assert f"| held-out rows |  | {want['held-out rows']:.3f} |" in out and "256" not in out.split("|---:|")[-1]


def test_eval_of_a_file_run_with_importable_rewards_scores_what_it_trained_on(tmp_path, capsys):
    data = _jsonl(tmp_path / "rows.jsonl", ROWS)
    trainer = GRPOTrainer(model="llama", reward_funcs=reward_digits, args=_args(tmp_path), train_dataset=str(data))
    trainer.train()
    want = trainer.evaluate()
    values = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert values["dataset"] == str(data) and values["reward_funcs"] == ["tests.train.test_run_record:reward_digits"]
    assert values["record"]["data"] == {"source": str(data), "rows": 6, "sha256": _sha256_of(ROWS)}
    capsys.readouterr()
    assert cli.main(["eval", str(tmp_path / "run")]) == 0
    assert f"| held-out rows |  | {want['held-out rows']:.3f} |" in capsys.readouterr().out
    _jsonl(data, ROWS[::-1])  # the file changed since: refused
    with pytest.raises(SystemExit, match=r"rows\.jsonl holds other rows \(6 rows"):
        cli.main(["eval", str(tmp_path / "run")])


def _cfg(tmp_path, data, **kw):
    base = dict(model="llama", dataset=str(data), output_dir=str(tmp_path / "run"), num_steps=2, num_generations=2,
                prompts_per_step=2, max_completion_length=4, eval_fraction=0.0, reward_funcs=["exact_match"],
                learning_rate=1e-2, lora=False, **OWN)
    return TrainConfig(**{**base, **kw})


def _steps(tmp_path):
    return [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("change", ["data", "model_overrides", "model"])
def test_resume_refuses_another_run_unless_forced(tmp_path, change):
    data = _jsonl(tmp_path / "a.jsonl", ROWS)
    folder = None
    if change == "model":  # a model folder, and the same model with other weights
        from longstraw.train.build import tiny_base

        tok = build_tokenizer()
        folder, other = tmp_path / "m1", tmp_path / "m2"
        model = tiny_base(TrainConfig(), tok)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        with torch.no_grad():
            model.lm_head.weight.add_(0.01)
        model.save_pretrained(other)
        tok.save_pretrained(other)
    first = dict(model=str(folder)) if folder else {}
    Trainer(_cfg(tmp_path, data, **first)).train()
    changed = {
        "data": dict(dataset=str(_jsonl(tmp_path / "b.jsonl", ROWS[:4]))),
        "model_overrides": dict(model_overrides={"rms_norm_eps": 1e-5}),
        "model": dict(model=str(tmp_path / "m2")),
    }[change]
    what = {"data": r"its data was .*a\.jsonl \(6 rows", "model_overrides": r"its model_overrides were \{\}",
            "model": r"its model was .*m1"}[change]
    with pytest.raises(ValueError, match=rf"resume: .*run is another run: {what}.*pass --force-resume"):
        Trainer(_cfg(tmp_path, data, **{**first, **changed}, num_steps=3)).train()
    assert _steps(tmp_path) == [1, 2]
    assert [m["step"] for m in Trainer(_cfg(tmp_path, data, **{**first, **changed}, num_steps=3,
                                            force_resume=True)).train()] == [3]


def test_the_command_line_takes_force_resume(tmp_path, capsys):
    data = _jsonl(tmp_path / "a.jsonl", ROWS)
    Trainer(_cfg(tmp_path, data)).train()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in _cfg(tmp_path, data).to_dict().items()}))
    other = _jsonl(tmp_path / "b.jsonl", ROWS[:4])
    argv = ["train", str(config), "--dataset", str(other), "--num_steps", "3"]
    assert cli.main(argv) == 2
    assert "another run: its data was" in capsys.readouterr().err
    assert cli.main([*argv, "--force-resume"]) == 0
    assert _steps(tmp_path) == [1, 2, 3]


def test_a_finished_schedule_is_named_not_trained_at_learning_rate_zero(tmp_path, capsys):
    data = _jsonl(tmp_path / "a.jsonl", ROWS)
    Trainer(_cfg(tmp_path, data, lr_scheduler="linear")).train()
    capsys.readouterr()
    assert Trainer(_cfg(tmp_path, data, lr_scheduler="linear")).train() == []
    assert "finished at step 2 of num_steps 2: nothing to train; raise num_steps" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"finished its linear schedule at step 2 \(learning rate 0\.0\).*"
                                         r"--force-resume"):
        Trainer(_cfg(tmp_path, data, lr_scheduler="linear", num_steps=4)).train()
    steps = Trainer(_cfg(tmp_path, data, lr_scheduler="linear", num_steps=4, force_resume=True)).train()
    # the schedule of num_steps 4 at steps 3 and 4: 1e-2 · (1 - 2/4), 1e-2 · (1 - 3/4)
    assert [m["lr"] for m in steps] == [1e-2 * 0.5, 1e-2 * 0.25]


def test_eval_refuses_held_out_rows_that_changed_since_the_run(tmp_path):
    data, held = _jsonl(tmp_path / "rows.jsonl", ROWS), _jsonl(tmp_path / "held.jsonl", ROWS[:2])
    Trainer(_cfg(tmp_path, data, eval_dataset=str(held))).train()
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["record"]["eval_data"] == {
        "source": str(held), "rows": 2, "sha256": _sha256_of(ROWS[:2])}
    assert cli.main(["eval", str(tmp_path / "run")]) == 0
    _jsonl(held, ROWS[2:4])
    with pytest.raises(SystemExit, match=r"held\.jsonl holds other rows \(2 rows"):
        cli.main(["eval", str(tmp_path / "run")])
