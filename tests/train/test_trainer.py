"""The trainer: one optimizer step per batch, exact resume, clear errors that lose nothing."""

import json
import math
import os
import signal

import pytest
import torch

from longstraw.train.config import TrainConfig
from longstraw.train.trainer import RewardFunctionError, Trainer

from ..conftest import full_and_resumed

DETERMINISTIC = ("loss", "reward", "reward_std", "entropy", "clip_ratio", "grad_norm", "lr", "step", "prompt_length",
                 "completion_length", "kl", "durable_bytes", "rewards/exact_match/mean")


def _cfg(tmp_path, name="run", **kw):
    base = dict(model="llama", output_dir=str(tmp_path / name), prompt_length=24,
                task_options={"num_pairs": 4, "num_values": 8}, num_steps=4, num_generations=4,
                max_completion_length=2, prompts_per_step=2, eval_examples=4, progress=False, threads=1,
                learning_rate=1e-2, beta=0.05, lora=True, sft_warmup_steps=1, lr_scheduler="cosine")
    base.update(kw)
    return TrainConfig(**base)


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}


def _metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def _same(rows_a, rows_b):
    """The same metrics, bit for bit (and the tests compare the weights with `torch.equal`): a resumed run does the
    same float32 arithmetic in the same order from exactly restored values (safetensors, torch.save, the RNG states),
    and a checkpointed replay recomputes each layer's forward as it ran."""
    assert len(rows_a) == len(rows_b)
    for a, b in zip(rows_a, rows_b):
        for k in DETERMINISTIC:
            if k in a or k in b:
                assert a[k] == b[k], (k, a[k], b[k])


@pytest.mark.parametrize("prompt_grad", ["detached", "exact"])
def test_one_optimizer_step_per_batch(tmp_path, prompt_grad):
    trainer = Trainer(_cfg(tmp_path, num_steps=2, sft_warmup_steps=0, prompt_grad=prompt_grad))
    calls = []
    trainer.opt.register_step_post_hook(lambda *a: calls.append(1))
    rows = trainer.train()
    assert len(calls) == 2 and [r["step"] for r in rows] == [1, 2]
    assert all(r["phase"] == "grpo" and r["durable_bytes"] > 0 for r in rows)


@pytest.mark.parametrize("prompts_per_step", [1, 2], ids=["state-reused", "recaptured"])
def test_resume_after_step_2_equals_uninterrupted(tmp_path, prompts_per_step):
    full, resumed = full_and_resumed(lambda name: Trainer(_cfg(tmp_path, name, prompts_per_step=prompts_per_step)))
    assert resumed.step == 4
    _same(_metrics(tmp_path / "full"), _metrics(tmp_path / "part"))
    wa, wb = _weights(full), _weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in the test, as Ctrl-C does in a terminal. A process started with SIGINT
    ignored keeps it ignored (CPython installs its KeyboardInterrupt handler only over the default disposition), and
    a job that a non-interactive shell starts in the background is started so, as a CI runner may start the suite:
    the test's SIGINT was then dropped and the run trained on to its end ("DID NOT RAISE KeyboardInterrupt")."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_in_the_middle_of_step_3_then_resume(tmp_path, sigint_raises):
    from longstraw.tasks import exact_match

    calls = {"n": 0}

    def reward(prompts, completions, answer, **kw):
        calls["n"] += 1
        if calls["n"] == 4:  # steps 2 and 3 score 2 prompts each; the 2nd prompt of step 3
            os.kill(os.getpid(), signal.SIGINT)
        return exact_match(prompts, completions, answer)

    reward.__name__ = "exact_match"  # same metric names as the uninterrupted run
    full = Trainer(_cfg(tmp_path, "full"), reward_funcs=[exact_match])
    full.train()
    part = Trainer(_cfg(tmp_path, "part"), reward_funcs=[reward])
    with pytest.raises(KeyboardInterrupt):
        part.train()
    assert part.step == 2
    assert (tmp_path / "part" / "checkpoints" / "latest").read_text() == "step-2"
    resumed = Trainer(_cfg(tmp_path, "part"), reward_funcs=[exact_match])
    resumed.train()
    _same(_metrics(tmp_path / "full"), _metrics(tmp_path / "part"))
    wa, wb = _weights(full), _weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_reward_function_error_is_named_and_checkpoint_intact(tmp_path):
    def flaky(prompts, completions, **kw):
        if flaky.n >= 2:
            raise KeyError("no such field")
        flaky.n += 1
        return [0.0] * len(completions)

    flaky.n = 0
    trainer = Trainer(_cfg(tmp_path, prompts_per_step=1, sft_warmup_steps=0, beta=0.0), reward_funcs=[flaky])
    with pytest.raises(RewardFunctionError, match="'flaky' raised KeyError"):
        trainer.train()
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step-2"
    assert (ckpt / "step-2" / "weights" / "adapter_model.safetensors").exists()
    assert not list(ckpt.glob(".*tmp"))


def test_non_finite_loss_skips_the_update(tmp_path):
    def inf_reward(prompts, completions, **kw):
        return [float("inf")] * len(completions)

    trainer = Trainer(_cfg(tmp_path, num_steps=1, sft_warmup_steps=0, beta=0.0), reward_funcs=[inf_reward])
    before = _weights(trainer)
    (row,) = trainer.train()
    assert "skipped" in row
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        pytest.param(dict(prompt_length=40, model_overrides={"max_position_embeddings": 32, "hidden_size": 32,
                                                              "num_hidden_layers": 1}),
                     ValueError, "max_position_embeddings", id="prompt-too-long"),
        pytest.param(dict(model="gpt2"), ValueError, "neither a built-in", id="unsupported-arch"),
        pytest.param(dict(prompt_length=5), ValueError, "shorter than", id="prompt-too-short-for-task"),
    ],
)
def test_bad_runs_fail_clearly(tmp_path, kw, exc, match):
    with pytest.raises(exc, match=match):
        Trainer(_cfg(tmp_path, **kw)).train()


def test_unknown_config_field_and_empty_dataset(tmp_path):
    with pytest.raises(ValueError, match="unknown field.*num_stepz"):
        TrainConfig.from_dict({"num_stepz": 3})
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        Trainer(_cfg(tmp_path, dataset=str(empty)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "k1 v1 ? k1 =", "answer": "v1"}\n{"question": "k1 v1 ? k1 ="}\n')
    with pytest.raises(ValueError, match=r'bad.jsonl:2: each row needs exactly one of the fields "prompt"'):
        Trainer(_cfg(tmp_path, dataset=str(bad)))


def test_user_jsonl_data_trains(tmp_path):
    rows = [{"prompt": f"k{i} v{i % 8} k{i + 1} v{(i + 3) % 8} ? k{i} =", "answer": f"v{i % 8}"} for i in range(6)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = Trainer(_cfg(tmp_path, dataset=str(path), num_steps=2))
    out = trainer.train()
    assert len(out) == 2 and out[-1]["phase"] == "grpo"
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("model", ["glm_moe_dsa", "kimi_linear", "deepseek_v3"])
def test_compressed_attention_trains_same_with_checkpointed_replay(tmp_path, model):
    """The trainer runs MLA/DSA and MLA + linear-attention MoE models (exact prompt gradients, LoRA, KL);
    checkpointing the replay's decoder layers changes neither the metrics nor the weights."""
    runs = []
    for ckpt in (False, True):
        trainer = Trainer(_cfg(tmp_path, f"ckpt{ckpt}", model=model, num_steps=2, sft_warmup_steps=0,
                               prompt_grad="exact", checkpoint_layers=ckpt))
        runs.append((trainer.train(), _weights(trainer)))
    _same(runs[0][0], runs[1][0])
    assert all(r["durable_bytes"] > 0 and math.isfinite(r["loss"]) for r in runs[0][0])
    for k, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][k]), k


def _jsonl(path, n, start=0):
    rows = [{"prompt": f"k{i} v{i % 8} k{i + 1} v{(i + 3) % 8} ? k{i} =", "answer": f"v{i % 8}"}
            for i in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["prompt"] for r in rows]


def test_jsonl_evaluation_uses_held_out_rows(tmp_path):
    """eval_fraction holds out ceil(fraction · n) rows chosen by the seed: never trained on, each evaluated once;
    an eval_dataset replaces the split; eval_fraction 0 evaluates on the training rows; too few rows fail clearly."""
    prompts = _jsonl(tmp_path / "data.jsonl", 10)
    trainer = Trainer(_cfg(tmp_path, dataset=str(tmp_path / "data.jsonl"), eval_fraction=0.2, num_steps=1))
    train = [ex.prompt for ex in trainer.data.rows]
    held = [ex.prompt for ex in trainer.data.eval_rows]
    assert len(held) == 2 and len(train) == 8 and sorted(train + held) == sorted(prompts) and not set(train) & set(held)
    again = Trainer(_cfg(tmp_path, "again", dataset=str(tmp_path / "data.jsonl"), eval_fraction=0.2, num_steps=1))
    assert [ex.prompt for ex in again.data.eval_rows] == held
    seen = []
    encode = trainer.policy.encode
    trainer.policy.encode = lambda text: seen.append(text) or encode(text)
    result = trainer.evaluate()
    assert seen == held and list(result) == ["held-out rows"] and 0.0 <= result["held-out rows"] <= 1.0

    other = _jsonl(tmp_path / "eval.jsonl", 3, start=100)
    trainer = Trainer(_cfg(tmp_path, "ext", dataset=str(tmp_path / "data.jsonl"), eval_dataset=str(tmp_path / "eval.jsonl")))
    assert [ex.prompt for ex in trainer.data.eval_rows] == other and len(trainer.data.rows) == 10
    trainer = Trainer(_cfg(tmp_path, "none", dataset=str(tmp_path / "data.jsonl"), eval_fraction=0.0))
    assert trainer.data.eval_rows == trainer.data.rows and len(trainer.data.rows) == 10
    _jsonl(tmp_path / "one.jsonl", 1)
    with pytest.raises(ValueError, match="too few to hold out"):
        Trainer(_cfg(tmp_path, "one", dataset=str(tmp_path / "one.jsonl")))


def test_an_output_dir_that_is_a_file_is_refused_before_any_work(tmp_path, monkeypatch):
    """A file as `output_dir` (or a path under one) is refused in one line before the model is built: the trainer,
    `GRPOTrainer` and the command line (tests/commands/test_cli.py) all check it first."""
    from longstraw import GRPOConfig, GRPOTrainer
    from longstraw.train import trainer as trainer_module

    def no_work(*args, **kwargs):
        raise AssertionError("the model was built before output_dir was checked")

    monkeypatch.setattr(trainer_module, "build_model_and_tokenizer", no_work)
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        with pytest.raises(ValueError, match=rf"output_dir {out}: {tmp_path / 'file'} is a file, not a folder; give"):
            Trainer(_cfg(tmp_path, output_dir=str(out)))
    with pytest.raises(ValueError, match="is a file, not a folder"):
        GRPOTrainer(model="llama", reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                    args=GRPOConfig(output_dir=str(tmp_path / "file")), train_dataset=[{"prompt": "k1 v1 ? k1"}])


def test_a_config_that_fails_at_its_first_step_leaves_the_runs_record(tmp_path):
    """Resuming a run with a config that fails (prompt + response past the model's positions, found at the first
    step) leaves the run's config.yaml and metrics.jsonl as they were; a config whose step runs is recorded."""
    Trainer(_cfg(tmp_path, num_steps=1, sft_warmup_steps=0)).train()
    run = tmp_path / "run"
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    bad = Trainer(_cfg(tmp_path, num_steps=2, sft_warmup_steps=0, prompt_length=40, force_resume=True,
                       model_overrides={"max_position_embeddings": 32}))  # forced: other overrides are refused
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        bad.train()
    assert {name: (run / name).read_bytes() for name in before} == before
    Trainer(_cfg(tmp_path, num_steps=2, sft_warmup_steps=0, force_resume=True)).train()  # its schedule had ended
    assert "num_steps: 2" in (run / "config.yaml").read_text().splitlines()


def test_zero_std_groups_are_counted_and_a_step_of_none_rewards_warns(tmp_path):
    """`frac_reward_zero_std` (TRL's name) is the share of a step's groups whose rewards are all equal, against the
    share counted here from what the reward function returned; a step whose rewards are all None (every function
    abstained) warns, once, naming the step."""
    import warnings

    returned = []

    def reward(prompts, completions, **kw):
        call = len(returned)  # steps 1 and 2 score 2 prompts each
        values = [[1.0] * 4, [0.0, 1.0, 1.0, 2.0], [None] * 4, [None] * 4][call]
        returned.append(values)
        return values

    trainer = Trainer(_cfg(tmp_path, num_steps=2, sft_warmup_steps=0), reward_funcs=[reward])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = trainer.train()
    for step, row in enumerate(rows):
        calls = returned[2 * step: 2 * step + 2]
        assert row["frac_reward_zero_std"] == sum(len(set(v)) == 1 for v in calls) / len(calls)
    assert [r["frac_reward_zero_std"] for r in rows] == [0.5, 1.0]
    none = [str(w.message) for w in caught if "returned None" in str(w.message)]
    assert none == ["step 2: every reward function returned None for all 8 completions: the step trains on zero "
                    "advantage; check the columns the reward functions read"]
