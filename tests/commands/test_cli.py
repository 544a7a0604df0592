"""The command line: every config field is a documented flag; a tiny train run writes its outputs."""

import dataclasses
import json

import pytest
import torch
import yaml

from longstraw import cli
from longstraw.commands import demo, flags
from longstraw.train.config import TrainConfig


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "x.yaml", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name}" in text
        assert f.metadata["help"], f.name


@pytest.mark.parametrize(
    "name,text,value",
    [("num_steps", "7", 7), ("learning_rate", "1e-3", 1e-3), ("lora", "false", False), ("curriculum", "[8, 16]", [8, 16]),
     ("task_options", "{num_pairs: 2}", {"num_pairs": 2}), ("epsilon_high", "none", None),
     ("lora_target_modules", "[q_proj, v_proj]", ["q_proj", "v_proj"]), ("task", "aggregation", "aggregation")],
)
def test_flag_values_take_the_field_type(name, text, value):
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}[name]
    assert flags.parse_value(field, text) == value


def test_demo_config_is_valid_and_overridable():
    cfg = demo.demo_config({"output_dir": "/tmp/x", "threads": 1})
    assert cfg.stage_length(0) == 22 and cfg.stage_length(cfg.num_steps - 1) == 1024
    assert cfg.sft_warmup_steps < cfg.num_steps


def test_train_command_end_to_end(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model: llama\nprompt_length: 24\ntask_options: {num_pairs: 4, num_values: 8}\n"
                      "num_generations: 4\nmax_completion_length: 1\nprogress: false\nthreads: 1\n")
    out = tmp_path / "run"
    code = cli.main(["train", str(config), "--num_steps", "3", "--sft_warmup_steps", "1", "--eval_examples", "4",
                     "--output_dir", str(out)])
    assert code == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["phase"] == "sft" and rows[1]["phase"] == "grpo"
    assert set(json.loads((out / "eval.json").read_text())["accuracy"]) == {"24"}
    for name in ("reward.png", "eval_accuracy.png", "memory.png", "config.yaml", "adapter/adapter_model.safetensors"):
        assert (out / name).exists(), name
    assert "held-out greedy accuracy" in capsys.readouterr().out
    assert cli.main(["eval", str(out), "--examples", "2"]) == 0


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("num_stepz: 3\n")
    assert cli.main(["train", str(config)]) == 2
    assert "unknown field" in capsys.readouterr().err


def test_demo_runs_in_bf16_from_the_command_line(tmp_path, capsys):
    """`longstraw demo --device cpu --dtype bf16` (cut to 2 steps and 2 held-out prompts of 64 tokens): the demo's full
    fine-tuning runs on bf16 weights with float32 masters and writes a bf16 model."""
    from safetensors import safe_open

    out = tmp_path / "demo"
    code = cli.main(["demo", "--device", "cpu", "--dtype", "bf16", "--num_steps", "2", "--eval_examples", "2",
                     "--eval_every", "0", "--eval_lengths", "[64]", "--threads", "1", "--progress", "false", "--output_dir", str(out)])
    assert code == 0
    assert "held-out greedy accuracy" in capsys.readouterr().out
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["dtype"] == "bf16" and cfg["device"] == "cpu" and cfg["lora"] is False
    with safe_open(str(out / "model" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    blob = torch.load(out / "checkpoints" / "step-2" / "optimizer.pt", weights_only=True)
    assert blob["master_weights"] and all(t.dtype == torch.float32 for t in blob["master_weights"])


def test_vllm_serve_without_lora_serves_an_untied_copy(tmp_path, monkeypatch, capsys):
    """`longstraw vllm-serve MODEL --lora-rank 0` (full fine-tuning: the weights are reloaded every step) on a model
    with tied embeddings writes `MODEL-untied` beside it, whose LM head is a tensor of its own equal to the embeddings
    and whose config says so, and serves that folder (the server itself replaced here: tests/train/test_vllm_backend.py
    runs real ones)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from longstraw.tasks.tokenizer import build_tokenizer
    from longstraw.testing.models import tiny_model
    from longstraw.train import vllm_server

    folder = tmp_path / "tied"
    model = tiny_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    served = []

    class Server:
        url, log_path = "http://127.0.0.1:0", tmp_path / "log"

        def alive(self):
            return False

        def log_tail(self):
            return ""

        def stop(self):
            pass

    monkeypatch.setattr(vllm_server, "ensure_environment", lambda: None)
    monkeypatch.setattr(vllm_server, "start", lambda model, **kw: served.append((model, kw)) or Server())
    assert cli.main(["vllm-serve", str(folder), "--lora-rank", "0"]) == 1  # the stand-in server "exits" at once
    untied = tmp_path / "tied-untied"
    assert served and served[0][0] == untied and served[0][1]["lora_rank"] == 0
    weights = load_file(str(untied / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert weights["lm_head.weight"].data_ptr() != weights["model.embed_tokens.weight"].data_ptr()
    assert AutoConfig.from_pretrained(untied).tie_word_embeddings is False
    assert "serving an untied copy" in capsys.readouterr().out


def test_vllm_serve_stops_on_sigterm_and_puts_the_callers_handler_back(tmp_path, monkeypatch):
    """SIGTERM while `longstraw vllm-serve` waits stops the server and returns 0, as Ctrl-C does; the handler it
    installs for that is the caller's again afterwards (called in-process, as here, it must not outlive the call)."""
    import os
    import signal

    from longstraw.train import vllm_server

    folder = tmp_path / "model"
    folder.mkdir()
    events = []

    class Server:
        url, log_path = "http://127.0.0.1:0", tmp_path / "log"

        def alive(self):
            events.append("alive")
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler stopping the job
            return True

        def log_tail(self):
            return ""

        def stop(self):
            events.append("stop")

    def mine(signum, frame):
        raise AssertionError("the caller's SIGTERM handler ran while vllm-serve had its own")

    monkeypatch.setattr(vllm_server, "ensure_environment", lambda: None)
    monkeypatch.setattr(vllm_server, "start", lambda model, **kw: Server())
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert cli.main(["vllm-serve", str(folder)]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert events == ["alive", "stop"]


TINY = ("model: llama\nprompt_length: 24\ntask_options: {num_pairs: 4, num_values: 8}\nnum_generations: 2\n"
        "max_completion_length: 1\nprogress: false\nthreads: 1\nnum_steps: 1\n")


def _no_run(cfg):
    raise AssertionError("the run started")


@pytest.mark.parametrize(
    "flags,message",
    [
        pytest.param(["--num_step", "3"], "unrecognized arguments: --num_step 3; --num_step: did you mean --num_steps?",
                     id="abbreviated"),
        pytest.param(["--lr", "1e-4"], "unrecognized arguments: --lr 1e-4", id="a-prefix-of-lr_scheduler"),
        pytest.param(["--outputdir=x"], "unrecognized arguments: --outputdir=x; --outputdir: did you mean --output_dir?",
                     id="misspelt"),
    ],
)
def test_flags_are_taken_as_written_and_a_near_miss_names_the_field(tmp_path, monkeypatch, capsys, flags, message):
    """argparse's default would read `--num_step 3` as `--num_steps 3` and `--lr 1e-4` as `--lr_scheduler 1e-4`:
    each is refused before the run starts, naming the field a near miss means."""
    from longstraw.commands import training

    config = tmp_path / "c.yaml"
    config.write_text(TINY)
    monkeypatch.setattr(training, "run_training", _no_run)
    with pytest.raises(SystemExit) as done:
        cli.main(["train", str(config), *flags])
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"longstraw: error: {message}"


def test_an_unknown_config_field_names_the_field_it_is_near():
    with pytest.raises(ValueError, match=r"unknown field\(s\) 'nonsense_x', 'num_step' \(did you mean 'num_steps'\?\);"):
        TrainConfig.from_dict({"num_step": 3, "nonsense_x": 1})


def test_an_output_dir_that_is_a_file_is_refused_in_one_line_before_the_run(tmp_path, monkeypatch, capsys):
    from longstraw.commands import training

    config = tmp_path / "c.yaml"
    config.write_text(TINY)
    (tmp_path / "out").write_text("a file")
    monkeypatch.setattr(training, "run_training", _no_run)
    assert cli.main(["train", str(config), "--output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"longstraw: error: output_dir {tmp_path / 'out'}: {tmp_path / 'out'} is a file, "
                                       "not a folder; give a folder (a new one, or a run's to resume)\n")
