"""TRL's documented GRPO scripts (examples/trl_grpo_*.py, each TRL's text with only its import changed) run unchanged.

A script names hub ids ("Qwen/Qwen2.5-0.5B-Instruct", "trl-lib/DeepMath-103K"); nothing is downloaded here: each
runs as a file (`runpy.run_path`) in a folder that holds local folders of those names, as a user's working directory
would after `hf download ... --local-dir`: a tiny Qwen2 model (a byte-level tokenizer with a chat template, taught to
answer "<think>…</think><answer>\\boxed{2}</answer>" or "…\\boxed{3}" about half the time each, then its end token:
TRL's `accuracy_reward` and the documentation's format reward then vary within a group, and completions stay short)
and a parquet file of two conversational rows with DeepMath's columns (`prompt`, `solution`). The scripts keep TRL's
defaults: 8 completions a step, G = 8, 3 epochs, so 2 rows are 6 steps; `output_dir` is TRL's `trainer_output`.
"""

import functools
import json
import runpy
from pathlib import Path

import pytest
import torch

pytest.importorskip("math_verify", reason="TRL's accuracy_reward needs math-verify (the [test] extra installs it)")

EXAMPLES = Path(__file__).parent.parent / "examples"
ROWS = [  # DeepMath-103K's columns; the tiny model answers 2 or 3 to both
    {"prompt": [{"role": "user", "content": "What is 1+1?"}], "solution": "2"},
    {"prompt": [{"role": "user", "content": "What is 1+2?"}], "solution": "3"},
]
ANSWERS = ["<think>a</think><answer>\\boxed{2}</answer>", "<think>a</think><answer>\\boxed{3}</answer>"]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STEPS = 6  # TRL's defaults: 3 epochs x 2 rows, one prompt (8 completions, G = 8) a step


def _tokenizer():
    """A byte-level BPE tokenizer without merges (every text encodes, nothing is unknown), Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT
    return tok


def _taught_model(tok):
    """A tiny Qwen2 taught (cross-entropy on the answers' tokens) to answer either of ANSWERS to either row."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    seqs, masks = [], []
    for row in ROWS:
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        for answer in ANSWERS:
            a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    labels = ids.masked_fill(torch.tensor([m + [0] * (width - len(m)) for m in masks]) == 0, -100)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        model(ids, labels=labels).loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A folder holding what the scripts name: the models and the dataset, under their hub names."""
    import pandas as pd

    root = tmp_path_factory.mktemp("hub")
    tok = _tokenizer()
    model = _taught_model(tok)
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2-0.5B"):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    data = root / "trl-lib" / "DeepMath-103K" / "data"
    data.mkdir(parents=True)
    pd.DataFrame(ROWS).to_parquet(data / "train-00000-of-00001.parquet")
    return root


@pytest.fixture
def workdir(hub, tmp_path, monkeypatch):
    """A fresh working directory with the hub names in it; the script's `trainer_output` lands here."""
    for top in ("Qwen", "trl-lib"):
        (tmp_path / top).symlink_to(hub / top)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path


def _run(script: str) -> dict:
    """The example run as a file, its module globals (`trainer` among them)."""
    return runpy.run_path(str(EXAMPLES / script), run_name="__main__")


def _steps(trainer) -> list[dict]:
    return [m for m in trainer.state.log_history if "step" in m and "reward" in m]


@pytest.fixture
def scored(monkeypatch) -> list[tuple[list, list, list]]:
    """TRL's `accuracy_reward` as the scripts import it (`from trl.rewards import ...`), wrapped to record each call:
    (completions, solutions, rewards) as it got and returned them."""
    import trl.rewards
    from trl.rewards import accuracy_reward

    calls = []

    @functools.wraps(accuracy_reward)
    def recorded(completions, solution, **kwargs):
        out = accuracy_reward(completions, solution, **kwargs)
        calls.append((completions, list(solution), out))
        return out

    monkeypatch.setattr(trl.rewards, "accuracy_reward", recorded)
    return calls


def test_each_example_names_longstraw_only_in_the_import_that_replaced_trls():
    """No example uses longstraw but through the one `from longstraw import ...` line that replaced TRL's (the rest
    of its code is TRL's documented text; its header comment says where from)."""
    for path in sorted(EXAMPLES.glob("trl_grpo_*.py")):
        lines = [ln for ln in path.read_text().splitlines() if "longstraw" in ln and not ln.startswith("#")]
        assert lines in (["from longstraw import GRPOTrainer"], ["from longstraw import GRPOConfig, GRPOTrainer"]), (
            path.name,
            lines,
        )


def test_trl_quick_start_trains_three_epochs_on_trls_accuracy_reward(workdir, scored):
    """TRL's quick start: 6 steps (3 epochs of 2 rows at TRL's defaults); each step's reward the mean of what TRL's
    `accuracy_reward` returned for that step's 8 completions, which it got as TRL passes them to a conversational
    row's reward (`[{"role": "assistant", "content": ...}]`) with the row's `solution`; some group's rewards differ
    (so a reward taken from another step or function would show)."""
    trainer = _run("trl_grpo_quick_start.py")["trainer"]
    steps = _steps(trainer)
    assert trainer.state.global_step == STEPS and [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert len(scored) == STEPS
    for m, (completions, solutions, out) in zip(steps, scored, strict=True):
        assert len(completions) == 8 and len(set(solutions)) == 1 and solutions[0] in {r["solution"] for r in ROWS}
        assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
        assert m["reward"] == pytest.approx(sum(out) / len(out), abs=1e-6), (m["step"], out)
    assert any(0 < sum(out) < len(out) for _, _, out in scored)


def test_trl_lora_script_writes_an_adapter_peft_loads_from_trls_checkpoint_folder(workdir):
    """TRL's LoRA example: 6 steps; `trainer_output/checkpoint-6` (where TRL's trainer saves at the last step) is a
    PEFT adapter that PEFT loads onto the base named in its adapter_config.json, giving the trained model's logits,
    which the training moved away from the base's."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    trainer = _run("trl_grpo_lora.py")["trainer"]
    assert trainer.state.global_step == STEPS
    folder = Path("trainer_output") / f"checkpoint-{STEPS}"
    base_path = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base_path).resolve() == Path("Qwen/Qwen2-0.5B").resolve()
    ids = torch.tensor([[5, 60, 71, 99, 12, 200, 33, 7]])
    with torch.no_grad():
        loaded = AutoPeftModelForCausalLM.from_pretrained(folder)(ids).logits
        base = AutoModelForCausalLM.from_pretrained("Qwen/Qwen2-0.5B")(ids).logits
        trained = trainer.model.eval()(ids).logits  # eval: the script's LoRA has dropout
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)
    assert (loaded - base).abs().max() > 1e-5  # the adapter trained


def test_weighted_rewards_script_sums_each_functions_reward_by_its_weight(workdir):
    """TRL's conversational data with two reward functions and `reward_weights=[1.0, 0.5]`: each step's reward is
    1.0 x accuracy_reward's mean + 0.5 x format_reward_func's (TRL's weighted sum, the functions' own means as the run
    logs them), the functions got TRL's conversational completions (`completion[0]["content"]`: format_reward_func
    reads it), and some step's two means differ (so swapped or missing weights give another sum)."""
    trainer = _run("trl_grpo_weighted_rewards.py")["trainer"]
    steps = _steps(trainer)
    assert trainer.state.global_step == STEPS
    for m in steps:
        acc, fmt = m["rewards/accuracy_reward/mean"], m["rewards/format_reward_func/mean"]
        assert m["reward"] == pytest.approx(1.0 * acc + 0.5 * fmt, abs=1e-6), m
    assert any(m["rewards/format_reward_func/mean"] > 0 for m in steps)
    assert any(m["rewards/accuracy_reward/mean"] != m["rewards/format_reward_func/mean"] for m in steps)
