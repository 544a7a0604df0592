"""The trainer in TRL's shape (`longstraw.GRPOTrainer`, `longstraw.GRPOConfig`): a TRL quick-start script with its
import changed runs the `Trainer` run of the `TrainConfig` written out by hand from TRL's meanings, metric for metric.

The references are independent of the mapping under test: the hand-written `TrainConfig` (what TRL's names mean, from
TRL's docs), and TRL's own `GRPOConfig` for the batch arithmetic (its `generation_batch_size`)."""

import json

import pytest
import torch

from longstraw import GRPOConfig, GRPOTrainer
from longstraw.tasks.jsonl import parse_row
from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

from .test_shared_prefix_step import DOC

ROWS = [{"prompt": DOC + f" ? k{9 * q}", "answer": f"v{q % 16}", "level": q} for q in range(1, 7)]
#: longstraw's own settings of the tiny runs (no TRL name): one thread, small chunks, no progress bar
OWN = dict(threads=1, chunk_size=8, progress=False, eval_examples=2)


def reward_len(completions, **kwargs):
    """A reward of TRL's quick-start kind (its own scores the length): here the digits a completion writes."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _reference(tmp_path, name, **kw) -> list[dict]:
    """The `Trainer` run of the hand-written `TrainConfig` that the TRL arguments mean (on the rows as JSONL)."""
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = dict(
        model="llama",
        dataset=str(data),
        eval_fraction=0.0,
        output_dir=str(tmp_path / name),
        lora=False,
        learning_rate=1e-2,
        num_generations=2,
        prompts_per_step=2,
        max_completion_length=4,
        seed=7,
        lr_scheduler="linear",
        adam_betas=[0.9, 0.999],
        save_every=500,
        dtype="auto",
        checkpoint_layers=False,
        **OWN,
    )
    cfg.update(kw)
    return Trainer(TrainConfig(**cfg), reward_funcs=[reward_len]).train()


def _steps(trainer) -> list[dict]:
    """A `GRPOTrainer` run's metrics per step: `state.log_history` less its last entry (the run's summary)."""
    trainer.train()
    return trainer.state.log_history[:-1]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in ("loss", "reward", "grad_norm", "lr", "completion_length"):
            assert x[key] == y[key], (key, x[key], y[key])


def test_the_quick_start_script_runs_the_trainer_run_its_arguments_mean(tmp_path):
    from datasets import Dataset

    trainer = GRPOTrainer(
        model="llama",
        reward_funcs=reward_len,
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            learning_rate=1e-2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_generations=2,
            max_completion_length=4,
            max_steps=3,
            seed=7,
            longstraw=OWN,
        ),
        train_dataset=Dataset.from_list(ROWS),
    )
    assert trainer.cfg.prompts_per_step == 2  # 2 × 2 completions per step over G = 2
    _same(_steps(trainer), _reference(tmp_path, "ref", num_steps=3))
    assert (tmp_path / "trl" / "model" / "config.json").is_file()  # no peft_config: full fine-tuning, as in TRL


def test_epochs_count_steps_over_the_dataset_and_a_list_of_rows_is_a_dataset(tmp_path):
    """6 rows, 2 prompts a step, μ = 2: an epoch is 6 steps; 0.5 epoch is 3 steps, warmup_ratio 0.34 → 2 steps."""
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        num_train_epochs=0.5,
        num_iterations=2,
        warmup_ratio=0.34,
        seed=7,
        longstraw=OWN,
    )
    trainer = GRPOTrainer(model="llama", reward_funcs=[reward_len], args=args, train_dataset=ROWS)
    assert (trainer.cfg.num_steps, trainer.cfg.warmup_steps) == (3, 2)
    _same(_steps(trainer), _reference(tmp_path, "ref", num_steps=3, num_iterations=2, warmup_steps=2))


def test_a_model_object_with_a_peft_config_trains_the_adapter_that_config_describes(tmp_path):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from longstraw.train.build import build_model_and_tokenizer

    model, tok = build_model_and_tokenizer(TrainConfig(model="llama", lora=False, seed=7))
    folder = tmp_path / "base"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    obj = AutoModelForCausalLM.from_pretrained(folder)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = GRPOTrainer(
        model=obj,
        reward_funcs=reward_len,
        peft_config=lora,
        processing_class=tok,
        train_dataset=ROWS,
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            learning_rate=1e-2,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=4,
            max_steps=2,
            seed=7,
            longstraw=OWN,
        ),
    )
    out = _steps(trainer)
    ref = _reference(
        tmp_path,
        "ref",
        model=str(folder),
        num_steps=2,
        lora=True,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules=["q_proj", "v_proj"],
        train_embeddings=False,
    )
    _same(out, ref)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "trl" / "adapter")
    trained = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in adapter.named_parameters() if "lora_" in n}
    assert trained.keys() == loaded.keys() and len(trained) == 2 * 2 * 2  # A and B of q and v in two layers
    for n, p in trained.items():
        torch.testing.assert_close(loaded[n], p, rtol=0, atol=0)


def test_trls_own_config_is_read_and_its_batch_arithmetic_kept():
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(
        output_dir="unused",
        per_device_train_batch_size=3,
        gradient_accumulation_steps=4,
        num_generations=6,
        max_steps=5,
        bf16=False,
        use_cpu=True,
        learning_rate=2e-5,
    )
    ours = GRPOConfig.from_trl(args)
    assert ours.prompts_per_step(1) == args.generation_batch_size // args.num_generations == 2
    cfg = ours.train_config("llama", rows=10, lora=None)
    assert (cfg.num_steps, cfg.learning_rate, cfg.dtype, cfg.device) == (5, 2e-5, "fp32", "cpu")
    assert cfg.checkpoint_layers == args.gradient_checkpointing
    with pytest.raises(ValueError, match="use_vllm"):
        GRPOConfig.from_trl(trl.GRPOConfig(output_dir="unused", use_vllm=True, bf16=False, use_cpu=True))


def test_what_longstraw_does_not_do_is_refused_by_name():
    with pytest.raises(ValueError, match="use_vllm"):
        GRPOConfig(use_vllm=True)
    with pytest.raises(ValueError, match="steps_per_generation"):
        GRPOConfig(steps_per_generation=2)
    with pytest.raises(ValueError, match="divisible by num_generations"):
        GRPOConfig(per_device_train_batch_size=3, num_generations=2)
    with pytest.raises(ValueError, match=r"set them by their TRL names: \{'learning_rate': 'learning_rate'\}"):
        GRPOConfig(longstraw={"learning_rate": 1.0})
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        GRPOConfig(lr_scheduler_type="polynomial")
    with pytest.raises(TypeError, match="DatasetDict"):
        GRPOTrainer(model="llama", reward_funcs=reward_len, train_dataset={"train": ROWS})
    with pytest.raises(ValueError, match="no hub downloads"):
        GRPOTrainer(model="org/not-here", reward_funcs=reward_len, train_dataset=ROWS)


def test_trls_conversational_prompt_is_a_chat_row():
    from longstraw.tasks import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    chat = [{"role": "user", "content": "k3 v1 ? k3"}]
    a = parse_row({"prompt": chat, "answer": "v1"}, "row", tok)
    b = parse_row({"messages": chat, "answer": "v1"}, "row", tok)
    assert (
        (a.prompt, a.messages, a.answer)
        == (b.prompt, b.messages, b.answer)
        == ("<user>k3 v1 ? k3<assistant>", chat, "v1")
    )


def test_weighted_reward_callables_sum_as_trls_nansum(tmp_path):
    """`reward_weights` with the reward functions passed as callables: each completion's reward is TRL's
    Σ_i w_i r_i over the functions that did not abstain (None: TRL's `nansum` skips it), checked against that sum
    computed here from what the functions returned. The values are integers and halves (≤ 64 in all), so their
    weighted sums, step means (÷ 4) and float32 results are exact: the means must be equal; the std goes through a
    square root, float32 against float64 here: 1e-6 relative."""
    returned = []  # per call: (digits' values, length's values), in the order the trainer scores the prompts

    def digits(completions, **kwargs):
        out = [float(sum(ch.isdigit() for ch in c)) for c in completions]
        returned.append([out])
        return out

    def length(completions, **kwargs):  # abstains on each prompt's first completion
        out = [None if i == 0 else float(len(c) + 1) for i, c in enumerate(completions)]
        returned[-1].append(out)
        return out

    trainer = GRPOTrainer(
        model="llama",
        reward_funcs=[digits, length],
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            learning_rate=1e-2,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=4,
            max_steps=2,
            reward_weights=[1.0, 0.5],
            seed=7,
            longstraw=OWN,
        ),
        train_dataset=ROWS,
    )
    rows = _steps(trainer)
    assert len(returned) == 4  # 2 steps × 2 prompts
    for step, row in enumerate(rows):
        want = [
            d + (0.5 * n if n is not None else 0.0)
            for d_vals, n_vals in returned[2 * step : 2 * step + 2]
            for d, n in zip(d_vals, n_vals)
        ]
        assert row["reward"] == sum(want) / len(want)
        torch.testing.assert_close(
            row["reward_std"], torch.tensor(want, dtype=torch.float64).std().item(), rtol=1e-6, atol=0
        )
    assert any(n for call in returned for n in call[1][1:])  # the length term is there: its weight shows


def test_reward_weights_not_one_per_callable_are_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"reward_weights has 1 weights for 2 reward_funcs: give one weight per"):
        GRPOTrainer(
            model="llama",
            reward_funcs=[reward_len, reward_len],
            args=GRPOConfig(output_dir=str(tmp_path / "trl"), reward_weights=[1.0], longstraw=OWN),
            train_dataset=ROWS,
        )
    assert not (tmp_path / "trl").exists()


def _args(tmp_path, name, **kw):
    """4 steps of 2 prompts × G = 2, a checkpoint every 2 steps."""
    base = dict(output_dir=str(tmp_path / name), learning_rate=1e-2, per_device_train_batch_size=4, num_generations=2,
                max_completion_length=4, max_steps=4, save_steps=2, seed=7, longstraw=OWN)
    return GRPOConfig(**{**base, **kw})


def _weights(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_train_resumes_as_trl_says_and_its_state_holds_the_steps(tmp_path):
    """`train(resume_from_checkpoint=True)` after a run stopped at step 3 (its reward raised; checkpoint step-2) ends
    with the uninterrupted run's weights, bit for bit, and `state.log_history` holds the uninterrupted run's metrics
    for the 4 steps (the resumed ones read back), then the summary; `train()` returns transformers' `TrainOutput`.
    From the start (None) over those checkpoints is refused; True with none is refused; a checkpoint folder of this
    run resumes from it (step-2 of the finished run: its steps 3 and 4 again, the same weights). A run from the start
    would end with the same weights too: the resumed runs' reward counts the prompts they scored, 2 steps' worth."""
    from transformers.trainer_utils import TrainOutput

    scored = []

    def counted(completions, **kw):
        scored.append(1)
        return reward_len(completions)

    counted.__name__ = "reward_len"

    full = GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "full"), train_dataset=ROWS)
    out = full.train()
    assert isinstance(out, TrainOutput) and out.global_step == 4 and full.state.global_step == 4
    assert full.args.max_steps == 4 and full.state.max_steps == 4

    calls = []

    def stops_at_step_3(completions, **kw):
        calls.append(1)
        if len(calls) == 5:  # 2 prompts a step: the first prompt of step 3
            raise RuntimeError("stopped")
        return reward_len(completions)

    stops_at_step_3.__name__ = "reward_len"  # the same metric names as the uninterrupted run
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True but .*checkpoints holds no checkpoint"):
        GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "part"), train_dataset=ROWS).train(True)
    part = GRPOTrainer(model="llama", reward_funcs=stops_at_step_3, args=_args(tmp_path, "part"), train_dataset=ROWS)
    with pytest.raises(Exception, match="stopped"):
        part.train()
    again = GRPOTrainer(model="llama", reward_funcs=counted, args=_args(tmp_path, "part"), train_dataset=ROWS)
    with pytest.raises(ValueError, match=r"holds a run's checkpoints \(the latest: step-2\); pass resume_from_checkp"):
        again.train()
    assert again.train(resume_from_checkpoint=True).global_step == 4 and len(scored) == 4  # steps 3 and 4
    wa, wb = _weights(full), _weights(again)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    *steps, summary = again.state.log_history
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and set(summary) == {"train_runtime", "train_loss", "step"}
    _same(steps, full.state.log_history[:-1])

    ckpt = tmp_path / "full" / "checkpoints" / "step-2"
    with pytest.raises(ValueError, match=r"is not a checkpoint of this run: give one of"):
        again.train(resume_from_checkpoint=ckpt)  # another run's checkpoint
    redo = GRPOTrainer(model="llama", reward_funcs=counted, args=_args(tmp_path, "full"), train_dataset=ROWS)
    assert redo.train(resume_from_checkpoint=str(ckpt)).global_step == 4 and len(scored) == 8
    wc = _weights(redo)
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    assert [m["step"] for m in redo.state.log_history[:-1]] == [1, 2, 3, 4]


@pytest.mark.parametrize("peft", [False, True], ids=["full-fine-tuning", "lora"])
def test_save_model_writes_what_transformers_and_peft_load_where_trl_puts_it(tmp_path, peft):
    """`save_model()` writes the trained model into `output_dir` itself (TRL's place), `save_model(dir)` into `dir`:
    a transformers folder, or a PEFT adapter folder over the base; loaded back, the trained weights are equal."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None
    trainer = GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "run", max_steps=2),
                          train_dataset=ROWS, peft_config=lora)
    trainer.train()
    trained = _weights(trainer)
    for folder, call in ((tmp_path / "run", lambda: trainer.save_model()),
                         (tmp_path / "saved", lambda: trainer.save_model(str(tmp_path / "saved")))):
        call()
        if peft:
            loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder / "base"), folder)
            got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        else:
            got = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
        assert set(got) >= set(trained) and len(trained) > 0
        for n, p in trained.items():
            torch.testing.assert_close(got[n], p, rtol=0, atol=0)
