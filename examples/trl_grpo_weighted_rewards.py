# TRL's GRPO on conversational data with several weighted reward functions, from TRL's documentation:
# docs/source/grpo_trainer.md (https://huggingface.co/docs/trl/grpo_trainer), read at huggingface/trl f2cd577 (July
# 2026); longstraw holds its GRPOTrainer to trl 1.16.0. Only the import line differs: `from trl import GRPOConfig,
# GRPOTrainer` became `from longstraw import GRPOConfig, GRPOTrainer`.
#
# The page has no one script for this; its pieces, each as documented: "Quick start" (the conversational dataset
# trl-lib/DeepMath-103K, the model, `accuracy_reward`), "Example 2: Reward completions with a specific format"
# (`format_reward_func`, "designed for a conversational format"), and "Passing the reward function to the trainer"
# (several reward functions as a list, "the weighted sum if `reward_weights` is provided in the config"): the
# `args=GRPOConfig(reward_weights=...)` line is that sentence written out. longstraw downloads nothing:
# "Qwen/Qwen2.5-0.5B-Instruct" must be a local folder of that name, and trl-lib/DeepMath-103K in the hub cache or a
# local folder (tests/test_trl_examples.py runs this file unchanged in a folder holding a tiny model and two rows under
# those names).
import re

from datasets import load_dataset
from longstraw import GRPOConfig, GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=[accuracy_reward, format_reward_func],
    args=GRPOConfig(reward_weights=[1.0, 0.5]),
    train_dataset=dataset,
)
trainer.train()
