"""The trainer and its stages: what `longstraw train` runs, in the order a step runs them.

- `config`: `TrainConfig`, every YAML field, validated at construction;
- `data`: the prompts (built-in tasks, a JSONL file, a dataset), `rewards`: reward functions by name or import path;
- `rollout`: capture each prompt, sample G responses (or a rollout hook's, `longstraw.agent`'s), score them;
- `update`: replay each response, back-propagate its share of the GRPO loss (`longstraw.losses`);
- `precision`: float32 master weights of bf16 parameters; `trainer`: `Trainer`, the loop around these, built by
  `build` (model, tokenizer, rewards, schedule), its held-out `evaluation` a stage of its own;
- `checkpoint`, `export`: resumable checkpoints and the final model, `run_checkpoints` a run's own on 1 or N
  processes; `metrics`, `memory`, `plots`, `devices`: what a
  run reports and where it runs.

Below it: `longstraw.capture` and the prompt state (`longstraw.api`, `longstraw.prompt_state`), `longstraw.distributed`;
above it only the command line (`longstraw.cli`, `longstraw.commands`) and the tools.
"""
