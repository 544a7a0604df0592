"""GRPO on long prompts with longstraw's public surface only: the executable specification.

    python examples/grpo_long_prompt.py --steps 30 --prompt-length 4096

Each step draws one long random prompt, captures it once (`longstraw.capture`: the prompt's durable
state, no activations kept), samples G responses from that one state (`state.sample`), scores them,
turns the rewards into group advantages, then replays each response alone with autograd
(`state.replay`) and back-propagates its share of the batch loss (`longstraw.losses`) before the next
one: peak memory is the prompt state plus ONE response's graph, whatever G is. One optimizer step
follows. The reward is deliberately trivial (how often a response says token `TARGET`), so that a tiny
random model visibly learns in a few seconds on a CPU; put a verifier of your task in its place.

Simplifications, on purpose: a tiny random llama instead of a pretrained model, one prompt per step,
no reference model (beta = 0), the default detached prompt gradient (`prompt_grad="exact"` would add
the prompt's share through `state.backward()`, called below either way). `longstraw train` does the
same with data, reward functions, checkpoints and metrics around it (`longstraw.train.trainer`).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import longstraw
from longstraw.losses import group_advantages, make_loss


def tiny_llama(vocab: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


TARGET = 5


def reward(prompt: torch.Tensor, responses: list[torch.Tensor]) -> torch.Tensor:
    """`[G]`: the fraction of each response's tokens equal to `TARGET`."""
    return torch.stack([(r == TARGET).float().mean() for r in responses])


def grpo_step(model, opt, loss_fn, prompt, num_generations, max_new_tokens, generator) -> float:
    """Capture → sample → reward → advantages → serial replay with backward → one optimizer step."""
    opt.zero_grad(set_to_none=True)
    with longstraw.capture(model, prompt, chunk_size=1024) as state:
        samples = state.sample(num_generations, max_new_tokens, temperature=1.0, generator=generator)
        rewards = reward(prompt, samples.tokens)
        advantages = group_advantages(rewards, num_generations)
        # the normalizer is fixed from all lengths before the first backward: serial == batched
        norm = loss_fn.normalizer([t.numel() for t in samples.tokens], [0] * num_generations, max_new_tokens)
        for i, tokens in enumerate(samples.tokens):
            out = state.replay(tokens)  # log-probs [R] with grad, reading the prompt state
            loss, _ = loss_fn.response_loss(out.logprobs, samples.logprobs[i], advantages[i], norm[i])
            loss.backward()  # frees this response's graph before the next one
        state.backward()  # exact mode: the prompt's share of the gradient; detached: nothing
    opt.step()
    return float(rewards.mean())


def main(steps: int = 30, prompt_length: int = 4096, num_generations: int = 8, max_new_tokens: int = 8,
         vocab: int = 64, lr: float = 1e-2, seed: int = 0) -> list[float]:
    """Train; returns the mean reward of every step."""
    model = tiny_llama(vocab, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = make_loss("dapo")
    g = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        prompt = torch.randint(0, vocab, (prompt_length,), generator=g)
        history.append(grpo_step(model, opt, loss_fn, prompt, num_generations, max_new_tokens, g))
        print(f"step {step + 1:3d}  reward {history[-1]:.3f}")
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-length", type=int, default=4096)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    main(args.steps, args.prompt_length, args.generations)
