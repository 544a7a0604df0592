"""Held-out evaluation: the greedy completion of each held-out example and its reward, the accuracy per prompt
length (`Evaluation.evaluate`), and the baselines a retrieval task's accuracy is read against. `Trainer` holds one
(`Trainer.evaluation`, `Trainer.evaluate`: every `eval_every` steps and at the end of `longstraw train`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..api import capture
from ..losses import combine_rewards
from ..tasks import Example

if TYPE_CHECKING:
    from ..distributed.ranks import Ranks
    from .config import TrainConfig
    from .data import Data
    from .rewards import RewardSet
    from .rollout import Policy

EVAL_SEED_OFFSET = 1_000_000
#: `evaluate()` key of the accuracy on held-out JSONL rows
HELD_OUT_KEY = "held-out rows"


class Evaluation:
    """Held-out evaluation of a run's policy (`longstraw.train.trainer.Trainer.evaluate` calls it): greedy completions
    of the current model, scored by the run's reward functions; on N ranks a collective (context-parallel captures),
    every rank the same result."""

    def __init__(self, cfg: TrainConfig, policy: Policy, data: Data, rewards: RewardSet, ranks: Ranks):
        self.cfg, self.policy, self.data, self.rewards, self.ranks = cfg, policy, data, rewards, ranks

    @property
    def model(self):
        return self.policy.model

    @torch.no_grad()
    def greedy_completions(self, examples: list[Example], bar=None) -> list[list[int]]:
        """Greedy responses (token ids, stop token included) of the current model, one per example (`bar`: a
        progress bar advanced per example)."""
        out = []
        # greedy draws nothing; a generator of its own keeps the ranks' global RNGs (rank 0 alone exports) out of it
        unused = torch.Generator(device=next(self.model.parameters()).device) if self.ranks.size > 1 else None
        for ex in examples:
            with capture(
                self.model,
                self.policy.encode(ex.prompt),
                chunk_size=self.cfg.chunk_size,
                state_dtype=self.cfg.state_dtype,
                group=self.ranks.pg,
            ) as state:
                s = state.sample(
                    1,
                    self.cfg.max_completion_length,
                    temperature=0,
                    stop_token_ids=[self.policy.eos_token_id],
                    allowed_token_ids=self.policy.allowed_token_ids,
                    generator=unused,
                )
            out.append(s.tokens[0].tolist())
            if bar is not None:
                bar.update(1)
        return out

    def score_examples(self, examples: list[Example], bar=None) -> list[dict]:
        """The current model's greedy completion of each example and its weighted reward: {prompt, completion,
        completion_ids, reward} per example (eval mode is the caller's)."""
        out = []
        for ex, ids in zip(examples, self.greedy_completions(examples, bar)):
            text = self.policy.tokenizer.decode(ids, skip_special_tokens=True)  # as training's rewards read it
            score = float(combine_rewards(self.rewards.score(ex, [text], [ids]), self.rewards.weights)[0])
            out.append(dict(prompt=ex.prompt, completion=text, completion_ids=ids, reward=score))
        return out

    def eval_examples(self, length: str, n: int) -> list[Example]:
        held = self.data.eval_rows
        if held is not None:
            return held[:n]
        return [self.data.example(EVAL_SEED_OFFSET + k, int(length)) for k in range(n)]

    def evaluate(self, lengths=None, n: int | None = None, samples: list | None = None) -> dict:
        """Greedy accuracy (mean weighted reward) on held-out examples per prompt length (`{"64": ...}`); for
        JSONL data, on up to `n` held-out rows (`{"held-out rows": ...}`). `samples`, if a list, receives
        {length, prompt, completion, completion_ids, reward} per example. With `progress`, rank 0 shows a bar over
        the examples."""
        cfg = self.cfg
        lengths = [str(int(x)) for x in (lengths or cfg.eval_lengths or [cfg.prompt_length])]
        n = n or cfg.eval_examples
        if self.data.eval_rows is not None:
            lengths = [HELD_OUT_KEY]
        was_training = self.model.training
        self.model.eval()
        result = {}
        todo = {length: self.eval_examples(length, n) for length in lengths}
        bar = None
        if cfg.progress and self.ranks.main:
            bar = tqdm(
                total=sum(len(v) for v in todo.values()), desc="held-out evaluation", unit="example", dynamic_ncols=True
            )
        for length, examples in todo.items():
            seen = self.score_examples(examples, bar)
            if samples is not None:
                samples.extend(dict(length=length, **s) for s in seen)
            result[length] = sum(s["reward"] for s in seen) / len(seen)
        if bar is not None:
            bar.close()
        self.model.train(was_training)
        return result

    def baselines(self) -> dict:
        """Accuracies without real retrieval, where they apply (built-in retrieval tasks with exact-match
        rewards): context-blind 1/V and positional shortcut 1/K."""
        t = self.data.task
        if t is None or t.reward != "exact_match" or self.cfg.reward_funcs not in ([], [t.reward]):
            return {}
        return {"context_blind": 1 / t.num_values, "positional": 1 / t.num_pairs}
