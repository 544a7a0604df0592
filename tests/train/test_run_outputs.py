"""What a run shows of itself on user data: the prompts' real token counts, the completions it wrote, and the
held-out accuracy before and after training."""

import json

from longstraw import cli
from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

REWARDS = '''
def first_word(prompts, completions, answer, **kwargs):
    return [float(c.split()[:1] == [a]) for c, a in zip(completions, answer)]

def length_bonus(prompts, completions, **kwargs):
    return [len(c) / 100 for c in completions]
'''


def _rows(path, n: int) -> list[dict]:
    """Text rows of the built-in vocabulary with 1 to 5 key-value pairs: prompts of different lengths."""
    rows = []
    for i in range(n):
        pairs = " ".join(f"k{(i + j) % 16} v{(i + 2 * j) % 8}" for j in range(1 + i % 5))
        rows.append({"prompt": f"{pairs} ? k{i % 16}", "answer": f"v{i % 8}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _cfg(tmp_path, **kw) -> TrainConfig:
    (tmp_path / "rewards.py").write_text(REWARDS)
    base = dict(model="llama", output_dir=str(tmp_path / "run"), dataset=str(tmp_path / "data.jsonl"),
                eval_fraction=0.25, num_steps=2, prompts_per_step=3, num_generations=3, max_completion_length=2,
                progress=False, threads=1, lora=False, learning_rate=1e-2, eval_examples=64, prompt_length=256,
                task_options={"num_keys": 16, "num_values": 8, "num_pairs": 2},
                reward_funcs=[f"{tmp_path / 'rewards.py'}:first_word", f"{tmp_path / 'rewards.py'}:length_bonus"])
    return TrainConfig(**{**base, **kw})


def test_metrics_record_the_prompts_real_token_counts(tmp_path):
    """`prompt_length` is the mean token count of the step's prompts (with min and max), not the built-in task's
    length setting (256 here, far from these prompts' 5-21 tokens)."""
    _rows(tmp_path / "data.jsonl", 16)
    trainer = Trainer(_cfg(tmp_path))
    seen = []
    rollout = trainer.rollout
    trainer.rollout = lambda step: seen.append(r := rollout(step)) or r
    rows = trainer.train()
    for m, r in zip(rows, seen):
        counts = [g.prompt_ids.numel() for g in r.groups]
        assert len(set(counts)) > 1 or len(counts) == 1
        assert m["prompt_length"] == round(sum(counts) / len(counts)) and m["prompt_length"] != 256
        assert (m["prompt_length_min"], m["prompt_length_max"]) == (min(counts), max(counts))


def test_completions_are_logged_per_step_printed_and_in_tensorboard(tmp_path, capsys):
    """Each GRPO step writes completions/step-N.jsonl: one row per completion with the prompt's tail, the text, each
    reward function's value, the weighted reward (its mean is the step's `reward`) and the advantage (zero mean per
    group); `num_completions_to_print` of them reach the console; TensorBoard holds them as text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = _rows(tmp_path / "data.jsonl", 16)
    cfg = _cfg(tmp_path, report_to=["tensorboard"], num_completions_to_print=2)
    rows = Trainer(cfg).train()
    out = tmp_path / "run"
    prompts = {r["prompt"] for r in data}
    for m in rows:
        logged = [json.loads(x) for x in (out / "completions" / f"step-{m['step']:06d}.jsonl").read_text().splitlines()]
        assert len(logged) == cfg.prompts_per_step * cfg.num_generations
        assert abs(sum(x["reward"] for x in logged) / len(logged) - m["reward"]) < 1e-6
        for x in logged:
            assert set(x["rewards"]) == {"first_word", "length_bonus"}
            assert abs(x["rewards"]["first_word"] + x["rewards"]["length_bonus"] - x["reward"]) < 1e-6
            assert any(p.endswith(x["prompt_tail"].strip()) for p in prompts), x["prompt_tail"]
        for g in {x["group"] for x in logged}:
            assert abs(sum(x["advantage"] for x in logged if x["group"] == g)) < 1e-5
    printed = capsys.readouterr().out
    assert printed.count("advantage") == 2 * len(rows) and "step 1: 9 completions" in printed
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = acc.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [m["step"] for m in rows]
    assert "first_word" in texts[0].tensor_proto.string_val[0].decode()


def test_eval_reports_real_counts_and_the_accuracy_before_training(tmp_path):
    """eval.json: the held-out rows evaluated (4 of 16, not `eval_examples` 64), the starting model's accuracy and
    the gain; the console table shows both; a resumed run keeps the accuracy measured at its start."""
    _rows(tmp_path / "data.jsonl", 16)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(_cfg(tmp_path).to_dict()))
    assert cli.main(["train", str(config)]) == 0
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert result["examples_per_length"] == {"held-out rows": 4} and len(result["samples"]) == 4
    before, after = result["accuracy_before"]["held-out rows"], result["accuracy"]["held-out rows"]
    assert abs(result["gain"]["held-out rows"] - (after - before)) < 1e-12
    start = json.loads((tmp_path / "run" / "eval_start.json").read_text())["accuracy"]
    assert start == result["accuracy_before"]
    # resumed to more steps: the start accuracy is read back, not measured on the trained model
    (tmp_path / "run" / "eval_start.json").write_text(json.dumps({"accuracy": {"held-out rows": -1.0}}))
    assert cli.main(["train", str(config), "--num_steps", "3"]) == 0
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["accuracy_before"] == {"held-out rows": -1.0}
