# TRL's GRPO quick start, as TRL documents it: docs/source/grpo_trainer.md, "Quick start"
# (https://huggingface.co/docs/trl/grpo_trainer#quick-start; docs/source/quickstart.md holds the same script), read at
# huggingface/trl f2cd577 (July 2026); longstraw holds its GRPOTrainer to trl 1.16.0. Only the import line differs:
# `from trl import GRPOTrainer` became `from longstraw import GRPOTrainer`.
#
# longstraw downloads nothing: "Qwen/Qwen2.5-0.5B-Instruct" must be a local folder of that name (e.g.
# `hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir Qwen/Qwen2.5-0.5B-Instruct`), and `load_dataset` reads
# trl-lib/DeepMath-103K from the hub cache or a local folder of that name. tests/test_trl_examples.py runs this file
# unchanged in a folder holding a tiny model and two rows under those names. TRL's reward `accuracy_reward` needs
# `pip install math-verify`.
# train_grpo.py
from datasets import load_dataset
from longstraw import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
