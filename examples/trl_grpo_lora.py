# TRL's GRPO with LoRA, as TRL documents it: docs/source/peft_integration.md, "PEFT with Different Trainers" > "Group
# Relative Policy Optimization (GRPO)" > "Python Example" (https://huggingface.co/docs/trl/peft_integration), read at
# huggingface/trl f2cd577 (July 2026); longstraw holds its GRPOTrainer to trl 1.16.0. Only the import line differs:
# `from trl import GRPOConfig, GRPOTrainer` became `from longstraw import GRPOConfig, GRPOTrainer`.
#
# The documented example is a fragment: it leaves `dataset` and the reward function to the reader and writes `...` in
# GRPOConfig. The lines marked "from the quick start" fill them with the GRPO quick start's dataset and reward
# (docs/source/grpo_trainer.md, examples/trl_grpo_quick_start.py), and the `...` is dropped; every other line is the
# documentation's. longstraw downloads nothing: "Qwen/Qwen2-0.5B" must be a local folder of that name, and
# trl-lib/DeepMath-103K in the hub cache or a local folder (tests/test_trl_examples.py runs this file unchanged in a
# folder holding a tiny model and two rows under those names).
from datasets import load_dataset  # from the quick start
from peft import LoraConfig
from longstraw import GRPOConfig, GRPOTrainer
from trl.rewards import accuracy_reward  # from the quick start

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")  # from the quick start

# Configure LoRA
peft_config = LoraConfig(
    r=32,
    lora_alpha=16,
    lora_dropout=0.05,
    bias="none",
    task_type="CAUSAL_LM",
)

# Configure training with higher learning rate for LoRA
training_args = GRPOConfig(
    learning_rate=1.0e-5,  # 10x the base rate for GRPO with LoRA
)

# Create trainer with PEFT config
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B",  # can pass model name or loaded model
    reward_funcs=accuracy_reward,  # from the quick start
    args=training_args,
    train_dataset=dataset,
    peft_config=peft_config,  # pass PEFT config here
)
trainer.train()
