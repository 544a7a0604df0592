"""Every dataset row is checked before step 1 (`longstraw.train.row_check`): a prompt past the model's positions, a
row without a column its reward function reads, a chat message without text stop the run naming the file and row
before any training (no metrics, no checkpoint), or, with `drop_invalid_rows: true`, are dropped, each named.

The references are independent of the check: the rows' token counts from the tokenizer itself, the rows written out
by hand, and the run's files (a step that ran leaves metrics.jsonl and a checkpoint)."""

import json
import statistics

import pytest

from longstraw import GRPOConfig, GRPOTrainer
from longstraw.tasks import build_tokenizer
from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

from .test_data_rewards import CHAT_TEMPLATE, _model_folder

DOC = " ".join(f"f{(7 * i) % 32}" if i % 9 else f"k{i % 64} v{i % 16}" for i in range(40))
#: rows 0-3 share DOC (a prefix of 40+ tokens); rows 4-5 are short and their own
ROWS = [{"prompt": DOC + f" ? k{9 * q}", "answer": f"v{q % 16}", "level": q} for q in range(4)] + [
    {"prompt": f"k{q} v{q} ? k{q}", "answer": f"v{q}", "level": q} for q in range(4, 6)
]


def needs_level(prompts, completions, level, **kwargs):
    """Reads the `level` column (a required keyword)."""
    return [float(x) for x in level]


def reads_maybe(prompts, completions, level=None, **kwargs):
    """Reads `level` when there is one (a keyword with a default)."""
    return [0.0] * len(completions)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, data, **kw):
    base = dict(model="llama", dataset=str(data), output_dir=str(tmp_path / "run"), num_steps=3, num_generations=2,
                prompts_per_step=2, max_completion_length=4, progress=False, threads=1, lora=False, chunk_size=8,
                eval_fraction=0.0, token_cache=None, reward_funcs=["exact_match"])
    return TrainConfig(**{**base, **kw})


def _nothing_trained(tmp_path):
    run = tmp_path / "run"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def _tokens(text):
    return len(build_tokenizer()(text, add_special_tokens=False)["input_ids"])


def test_a_prompt_past_the_positions_stops_the_run_before_step_1_naming_the_row(tmp_path):
    """Row 5 of the file (read by step 3) is longer than the model's positions with max_completion_length: refused
    when the trainer starts, naming the file and line, before any step (without the check it failed at step 3)."""
    rows = [dict(r) for r in ROWS]
    rows[4]["prompt"] = DOC + " " + DOC  # ~90 tokens
    limit = _tokens(DOC) + 10
    assert _tokens(rows[4]["prompt"]) + 4 > limit >= max(_tokens(r["prompt"]) + 4 for i, r in enumerate(rows) if i != 4)
    data = _write(tmp_path / "text.jsonl", rows)
    n = _tokens(rows[4]["prompt"])
    with pytest.raises(ValueError, match=rf"text\.jsonl:5: prompt of {n} tokens \+ max_completion_length 4 "
                                         rf".*max_position_embeddings={limit}.*drop_invalid_rows"):
        Trainer(_cfg(tmp_path, data, model_overrides={"max_position_embeddings": limit})).train()
    _nothing_trained(tmp_path)


def test_a_row_without_a_column_its_reward_reads_stops_the_run_before_step_1(tmp_path):
    rows = [dict(r) for r in ROWS]
    del rows[4]["level"]
    data = _write(tmp_path / "text.jsonl", rows)
    with pytest.raises(ValueError, match=r"text\.jsonl:5: reward function 'needs_level' reads the column 'level', "
                                         r"which this row does not have"):
        Trainer(_cfg(tmp_path, data), reward_funcs=[needs_level]).train()
    _nothing_trained(tmp_path)
    # a keyword with a default is read only where there is one: the same rows train
    assert len(Trainer(_cfg(tmp_path, data, num_steps=1), reward_funcs=[reads_maybe]).train()) == 1


def test_a_reward_keyword_no_row_has_is_refused_naming_the_function(tmp_path):
    data = _write(tmp_path / "text.jsonl", ROWS)

    def wants_levels(prompts, completions, levels, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"reward function 'wants_levels' reads the column 'levels', which no row "
                                         r"has \(did you mean 'level'\?"):
        Trainer(_cfg(tmp_path, data, drop_invalid_rows=True), reward_funcs=[wants_levels])
    _nothing_trained(tmp_path)


def test_invalid_rows_are_dropped_each_named_when_the_config_asks(tmp_path, capsys):
    """`drop_invalid_rows: true`: the long row, the row without `level` and a chat row without text are dropped,
    each named, the count reported; the run trains on the rows written out by hand without them."""
    folder = _model_folder(tmp_path)
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"], "level": r["level"]}
            for r in ROWS]
    rows[1]["messages"] = [{"role": "user", "content": ""}]
    del rows[2]["level"]
    rows[4]["messages"][0]["content"] = DOC + " " + DOC
    tok = build_tokenizer(num_keys=16, num_values=8)
    tok.chat_template = CHAT_TEMPLATE

    def length(r):
        return len(tok(tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"])

    limit = length(rows[0]) + 4
    data = _write(tmp_path / "chat.jsonl", rows)
    trainer = Trainer(_cfg(tmp_path, data, model=str(folder), drop_invalid_rows=True, num_steps=1,
                           model_overrides={"max_position_embeddings": limit}), reward_funcs=[needs_level])
    out = capsys.readouterr().out
    assert "dropped 3 of 6 rows" in out
    for line in (2, 3, 5):
        assert f"chat.jsonl:{line}:" in out
    kept = [rows[i] for i in (0, 3, 5)]
    assert [ex.messages for ex in trainer.data.rows] == [r["messages"] for r in kept]
    assert len(trainer.train()) == 1


def test_the_start_reports_rows_lengths_and_shared_prefixes(tmp_path, capsys):
    data = _write(tmp_path / "text.jsonl", ROWS)
    Trainer(_cfg(tmp_path, data, min_shared_prefix=16))
    out = capsys.readouterr().out
    lengths = sorted(_tokens(r["prompt"]) for r in ROWS)
    assert (f"6 rows; prompt tokens min {lengths[0]} / median {statistics.median(lengths):g} / max {lengths[-1]}; "
            "4 rows share their first 16 tokens with another row") in out


def test_a_grpo_trainer_dataset_row_is_named_before_step_1(tmp_path):
    """Through TRL's shape: a `datasets.Dataset`-like list of rows, the row named by its index."""
    rows = [dict(r) for r in ROWS]
    del rows[5]["level"]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=3, longstraw=dict(threads=1, chunk_size=8, progress=False,
                                                                            token_cache=None))
    with pytest.raises(ValueError, match=r"train_dataset row 5: reward function 'needs_level' reads the column"):
        GRPOTrainer(model="llama", reward_funcs=[needs_level], args=args, train_dataset=rows).train()
    _nothing_trained(tmp_path)


def test_epochs_count_the_rows_left_after_dropping(tmp_path):
    """`num_train_epochs` counts steps over the rows that train: 6 rows less 2 dropped, 2 prompts a step, is 2 steps
    an epoch (⌊4 / 2⌋), not 3."""
    rows = [dict(r) for r in ROWS]
    del rows[1]["level"], rows[3]["level"]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, num_train_epochs=1, warmup_ratio=0.5,
                      longstraw=dict(threads=1, chunk_size=8, progress=False, token_cache=None, drop_invalid_rows=True))
    trainer = GRPOTrainer(model="llama", reward_funcs=[needs_level], args=args, train_dataset=rows)
    assert len(trainer.data.rows) == 4
    assert trainer.state.max_steps == trainer.cfg.num_steps == 2 and trainer.cfg.warmup_steps == 1
    trainer.train()
    assert [m["step"] for m in trainer.state.log_history[:-1]] == [1, 2]
    # the warm-up of 1 step over 2: the first step at half the learning rate (lr_lambda: (0 + 1) / (1 + 1))
    assert trainer.state.log_history[0]["lr"] == 1e-6 * 0.5


def test_a_row_the_tokenizer_reads_as_mostly_unknown_is_refused_before_step_1(tmp_path):
    """The built-in tiny tokenizer knows the toy task's vocabulary only: an English question encodes to its `[UNK]`
    mostly. Such a row (row 2 here) stops the run naming it, with the counts the tokenizer itself gives; a row with a
    few unknown tokens (1 of 48) is kept, and with `drop_invalid_rows` the English row is dropped, named."""
    tok = build_tokenizer()
    english = "What is the value of the key in this document? Answer briefly. k3"
    ids = tok(english, add_special_tokens=False)["input_ids"]
    unknown = ids.count(tok.unk_token_id)
    assert 2 * unknown > len(ids) and unknown < len(ids)  # mostly, not only, unknown: the threshold is what decides
    rows = [dict(r) for r in ROWS]
    rows[1]["prompt"] = ROWS[1]["prompt"] + " Hello"  # one unknown token of 48
    rows[2]["prompt"] = english
    data = _write(tmp_path / "data.jsonl", rows)
    with pytest.raises(ValueError, match=rf"data.jsonl:3: {unknown} of the prompt's {len(ids)} tokens are the "
                                         r"tokenizer's unknown token .*use a tokenizer made for it"):
        Trainer(_cfg(tmp_path, data)).train()
    _nothing_trained(tmp_path)
    trainer = Trainer(_cfg(tmp_path, data, drop_invalid_rows=True))
    assert [ex.prompt for ex in trainer.data.rows] == [r["prompt"] for i, r in enumerate(rows) if i != 2]
    assert len(trainer.row_report.dropped) == 1 and "data.jsonl:3" in trainer.row_report.dropped[0]
