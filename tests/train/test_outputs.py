"""What a run leaves behind loads with plain transformers / PEFT in a fresh process and decodes the same
greedy completions as the trainer's own evaluation; checkpoints are read without running pickled code."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from longstraw import cli
from longstraw.train.checkpoint import CheckpointError
from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

CONFIG = ("model: llama\nprompt_length: 24\ntask_options: {num_pairs: 4, num_values: 8}\nnum_generations: 4\n"
          "max_completion_length: 3\nprogress: false\nthreads: 1\nnum_steps: 2\nsft_warmup_steps: 1\n"
          "eval_examples: 8\nlearning_rate: 0.01\n")

# Runs in a fresh interpreter with nothing of longstraw imported: greedy completions of each held-out
# prompt with `generate`, from the folder(s) named on the command line.
LOADER = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    kind, run = sys.argv[1], sys.argv[2]
    if kind == "adapter":
        from peft import PeftModel
        base = AutoModelForCausalLM.from_pretrained(run + "/base")
        model = PeftModel.from_pretrained(base, run + "/adapter")
        tok = AutoTokenizer.from_pretrained(run + "/adapter")
    else:
        model = AutoModelForCausalLM.from_pretrained(run + "/model")
        tok = AutoTokenizer.from_pretrained(run + "/model")
    model.eval()
    out = []
    for s in json.load(open(run + "/eval.json"))["samples"]:
        ids = torch.tensor([tok(s["prompt"], add_special_tokens=False)["input_ids"]])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    print(json.dumps(out))
""")


def _greedy_in_fresh_process(kind: str, run) -> list[list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LOADER, kind, str(run)], capture_output=True, text=True, env=env,
                          cwd=str(run), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _trim_eos(ids: list[int], eos: int) -> list[int]:
    """generate() pads nothing for one prompt but may stop later than eos in ids; cut at the first eos."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("lora", [False, True], ids=["full-finetune", "lora-and-merged"])
def test_cli_output_loads_with_transformers_and_peft_and_decodes_the_same(tmp_path, lora):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    flags = ["--lora", "true", "--merge_adapter", "true", "--beta", "0.05"] if lora else ["--lora", "false"]
    assert cli.main(["train", str(config), "--output_dir", str(out), *flags]) == 0
    samples = json.loads((out / "eval.json").read_text())["samples"]
    assert len(samples) == 8
    expected = [s["completion_ids"] for s in samples]
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / "model" / name).exists(), name
    kinds = ["adapter", "model"] if lora else ["model"]
    if lora:
        assert (out / "adapter" / "adapter_config.json").exists()
        assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
            str((out / "base").resolve())
    eos = json.loads((out / "model" / "generation_config.json").read_text())["eos_token_id"]
    for kind in kinds:
        got = _greedy_in_fresh_process(kind, out)
        assert [_trim_eos(g, eos) for g in got] == expected, kind


def test_checkpoint_holding_a_pickled_callable_is_refused(tmp_path):
    cfg = TrainConfig(model="llama", output_dir=str(tmp_path / "run"), prompt_length=24, num_steps=1,
                      task_options={"num_pairs": 4, "num_values": 8}, num_generations=2, max_completion_length=1,
                      progress=False, threads=1, eval_examples=1, lora=False)
    Trainer(cfg).train()
    ckpt = tmp_path / "run" / "checkpoints" / "step-1" / "optimizer.pt"
    blob = torch.load(ckpt, weights_only=True)  # what the trainer wrote is plain data
    resumed = Trainer(cfg)
    assert resumed.load_checkpoint() and resumed.step == 1
    blob["scheduler"]["hook"] = os.getcwd  # any callable: unpickling it would import and reference code
    torch.save(blob, ckpt)
    with pytest.raises(CheckpointError, match="refused"):
        Trainer(cfg).load_checkpoint()


def test_a_long_capture_shows_its_progress(monkeypatch, capsys):
    """With `progress`, a capture of a prompt of `LONG_CAPTURE` tokens or more draws a bar of the tokens captured,
    ending at the prompt's captured length; a shorter prompt draws none."""
    import longstraw
    from longstraw.testing.models import tiny_model
    from longstraw.train import rollout

    monkeypatch.setattr(rollout, "LONG_CAPTURE", 100)
    model = tiny_model("llama")
    ids = torch.randint(0, 200, (130,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        longstraw.capture(model, ids, chunk_size=32, progress=rollout.capture_bar(ids.numel()))
    err = capsys.readouterr().err
    assert "capture" in err and "129/129" in err
    assert rollout.capture_bar(99) is None
