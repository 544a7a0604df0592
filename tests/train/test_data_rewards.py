"""Chat data and reward functions from files, through `longstraw train`; bad input fails before the first step."""

import json
import math

import pytest

from longstraw import cli
from longstraw.tasks import build_tokenizer
from longstraw.tasks.jsonl import parse_row
from longstraw.train.config import TrainConfig
from longstraw.train.rewards import RewardFunctionError
from longstraw.train.trainer import Trainer

# Only words of the built-in vocabulary: each message's content, then "=" as the generation prompt.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}={% endif %}"

REWARD_FILE = '''
import json, os
def chat_match(prompts, completions, completion_ids, answer, difficulty, **kwargs):
    """Checks TRL's conversational convention, then scores the answer; logs what it saw."""
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts)
    assert all(c[0]["role"] == "assistant" for c in completions)
    assert len(answer) == len(difficulty) == len(completions) == len(completion_ids)
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps({"answer": answer, "difficulty": difficulty}) + "\\n")
    return [float(c[0]["content"].split()[:1] == [a]) for c, a in zip(completions, answer)]

def nan_reward(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1) + [float("nan")]

def short_reward(prompts, completions, **kwargs):
    return [0.0]
'''


def _model_folder(tmp_path, chat_template=CHAT_TEMPLATE):
    """A local model folder: tiny llama + the task tokenizer, with a chat template."""
    from longstraw.train.build import tiny_base

    tok = build_tokenizer(num_keys=16, num_values=8)
    tok.chat_template = chat_template
    cfg = TrainConfig(model="llama", task_options={"num_keys": 16, "num_values": 8, "num_pairs": 2})
    folder = tmp_path / "base_model"
    tiny_base(cfg, tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _chat_rows(path, n=8):
    rows = [{"messages": [{"role": "user", "content": f"k{i} v{i % 8} k{i + 1} v{(i + 3) % 8} ? k{i}"}],
             "answer": f"v{i % 8}", "difficulty": i % 3} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_chat_jsonl_with_reward_function_from_a_file_trains_through_the_cli(tmp_path, monkeypatch):
    folder = _model_folder(tmp_path)
    rows = _chat_rows(tmp_path / "chat.jsonl")
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "log.jsonl"))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {folder}\ndataset: {tmp_path / 'chat.jsonl'}\neval_fraction: 0.25\n"
                      f"reward_funcs: ['{tmp_path / 'my_rewards.py'}:chat_match']\nnum_generations: 4\n"
                      "max_completion_length: 2\nnum_steps: 3\nprompts_per_step: 2\nprogress: false\nthreads: 1\n"
                      "lora: false\nlearning_rate: 0.01\n")
    assert cli.main(["train", str(config), "--output_dir", str(tmp_path / "run")]) == 0
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["phase"] for m in metrics] == ["grpo"] * 3
    assert all(math.isfinite(m["loss"]) and "rewards/chat_match/mean" in m for m in metrics)
    seen = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    by_answer = {r["answer"]: r["difficulty"] for r in rows}
    # each call: one row's columns repeated once per completion, as TRL hands dataset columns over
    assert all(len(set(s["answer"])) == 1 and s["difficulty"] == [by_answer[s["answer"][0]]] * len(s["answer"])
               for s in seen)
    result = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert list(result["accuracy"]) == ["held-out rows"] and result["baselines"] == {}
    # the chat template's output is what the model read: the generation prompt "=" ends every prompt
    assert all(s["prompt"].endswith("=") for s in result["samples"])


def test_a_chat_format_from_the_config_formats_the_prompts_stops_the_responses_and_is_saved(tmp_path):
    """`chat_template_path` and `eos_token` (TRL SFTConfig's names) give a base model without a chat template its chat
    format: prompts as jinja2 renders the template, responses end at the new token, the saved model keeps both."""
    import jinja2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _model_folder(tmp_path, chat_template=None)
    _chat_rows(tmp_path / "chat.jsonl", 4)
    template = tmp_path / "turns.jinja"
    template.write_text(CHAT_TEMPLATE)
    cfg = _cfg(tmp_path, model=str(folder), dataset=str(tmp_path / "chat.jsonl"), chat_template_path=str(template),
               eos_token="v7", max_completion_length=6, num_generations=4)
    trainer = Trainer(cfg)
    rows = [json.loads(x) for x in (tmp_path / "chat.jsonl").read_text().splitlines()]
    rendered = [jinja2.Template(CHAT_TEMPLATE).render(messages=r["messages"], add_generation_prompt=True) for r in rows]
    assert sorted(ex.prompt for ex in trainer.data.rows) == sorted(rendered)
    stop = trainer.tok.convert_tokens_to_ids("v7")
    assert stop != AutoTokenizer.from_pretrained(folder).eos_token_id and trainer.policy.eos_token_id == stop
    trainer.train()
    saved = tmp_path / "run" / "model"
    assert AutoTokenizer.from_pretrained(saved).chat_template == CHAT_TEMPLATE
    assert AutoTokenizer.from_pretrained(saved).eos_token_id == stop
    assert AutoModelForCausalLM.from_pretrained(saved).generation_config.eos_token_id == stop
    # a template folder: its tokenizer's template; and the refusals, each naming what is wrong
    other = _model_folder(tmp_path / "other")
    assert Trainer(_cfg(tmp_path, model=str(folder), dataset=str(tmp_path / "chat.jsonl"),
                        chat_template_path=str(other))).tok.chat_template == CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"chat_template_path .*nowhere\.jinja: no such file or folder"):
        Trainer(_cfg(tmp_path, model=str(folder), chat_template_path=str(tmp_path / "nowhere.jinja")))
    with pytest.raises(ValueError, match=r"chat_template_path .*base_model: the tokenizer in this folder has no chat"):
        Trainer(_cfg(tmp_path, model=str(folder), chat_template_path=str(folder)))
    with pytest.raises(ValueError, match=r"eos_token '<end_of_turn>' is not a token of the tokenizer's vocabulary"):
        Trainer(_cfg(tmp_path, model=str(folder), eos_token="<end_of_turn>"))


def _cfg(tmp_path, **kw):
    base = dict(model="llama", output_dir=str(tmp_path / "run"), num_steps=1, num_generations=2,
                max_completion_length=1, progress=False, threads=1, lora=False, eval_fraction=0.0)
    return TrainConfig(**{**base, **kw})


def test_bad_data_and_reward_paths_fail_before_the_first_step(tmp_path):
    _chat_rows(tmp_path / "chat.jsonl", 2)
    with pytest.raises(ValueError, match=r"chat.jsonl:1: a `messages` row needs a tokenizer with a chat template"):
        Trainer(_cfg(tmp_path, dataset=str(tmp_path / "chat.jsonl")))  # the built-in tokenizer has none
    (tmp_path / "text.jsonl").write_text('{"prompt": "k1 v1 ? k1", "answer": "v1"}\n')
    with pytest.raises(ValueError, match=r"nowhere\.py:fn.*does not exist"):
        Trainer(_cfg(tmp_path, dataset=str(tmp_path / "text.jsonl"), reward_funcs=["nowhere.py:fn"]))
    with pytest.raises(ValueError, match=r"no_such_module_xyz:fn.*cannot import"):
        Trainer(_cfg(tmp_path, dataset=str(tmp_path / "text.jsonl"), reward_funcs=["no_such_module_xyz:fn"]))
    (tmp_path / "r.py").write_text(REWARD_FILE)
    with pytest.raises(ValueError, match=r"r\.py:missing.*no callable 'missing'"):
        Trainer(_cfg(tmp_path, dataset=str(tmp_path / "text.jsonl"), reward_funcs=[f"{tmp_path / 'r.py'}:missing"]))
    with pytest.raises(ValueError, match="reward_funcs entries"):
        _cfg(tmp_path, reward_funcs=["not_a_builtin"])


@pytest.mark.parametrize("name,match", [("nan_reward", r"'nan_reward' returned NaN for completion 1 on .*text.jsonl:1"),
                                        ("short_reward", r"'short_reward' returned 1 rewards for 2 completions on "
                                                         r".*text.jsonl:1")])
def test_a_failing_reward_function_stops_the_run_naming_it_and_the_row(tmp_path, name, match):
    (tmp_path / "r.py").write_text(REWARD_FILE)
    (tmp_path / "text.jsonl").write_text('{"prompt": "k1 v1 ? k1", "answer": "v1"}\n')
    trainer = Trainer(_cfg(tmp_path, dataset=str(tmp_path / "text.jsonl"), reward_funcs=[f"{tmp_path / 'r.py'}:{name}"]))
    with pytest.raises(RewardFunctionError, match=match):
        trainer.train()


@pytest.mark.parametrize("content", ["", "  ", []], ids=["empty", "blank", "no-parts"])
def test_an_empty_chat_content_is_refused_before_the_first_step_naming_the_row(tmp_path, content):
    """A chat message with no text is refused where the rows are read, naming the file, line and message; an
    assistant turn that calls tools may have no text (TRL's tool-calling rows)."""
    folder = _model_folder(tmp_path)
    rows = _chat_rows(tmp_path / "chat.jsonl", 3)
    rows[1]["messages"] = [{"role": "system", "content": "k1 v1"}, {"role": "user", "content": content}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r'chat\.jsonl:2: message 1 \(user\) has an empty "content": give its text'):
        Trainer(_cfg(tmp_path, model=str(folder), dataset=str(tmp_path / "chat.jsonl")))
    assert not (tmp_path / "run").exists()
    calls = [{"role": "user", "content": "k1"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
             {"role": "tool", "content": "v1"}]
    tok = build_tokenizer(num_keys=16, num_values=8)
    tok.chat_template = CHAT_TEMPLATE
    assert parse_row({"messages": calls}, "row", tok).messages == calls
