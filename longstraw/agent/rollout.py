"""Multi-turn rollouts: G trajectories from one captured prompt, each growing on its own branch by tool output.

`EnvironmentRollout(factory, settings)` is a rollout hook (`longstraw.train.rollout.RolloutStage`: `(sampler, example,
num_generations) -> responses`). For each of the G trajectories it makes an environment (`factory()`), resets it
with the example's columns, forks a `Branch` from the prompt state and alternates:

1. sample a policy turn from the branch (up to the stop token, `max_turn_tokens`, or the tokens the trajectory has
   left of `max_completion_length`);
2. read its tool calls; none: the trajectory is done (the turn is the answer, or, without a stop token, a truncated
   end);
3. call each tool (`call_tool`: an unknown tool, bad arguments, an exception, an empty reply each become an error
   message for the policy, never the end of the run); a tool that sets the environment's `done` (a final answer)
   ends the trajectory there; cut each reply to `max_tool_tokens`, and `extend` the branch by
   the chat template's tool messages. A reply that would pass the trajectory's budget or the model's positions ends
   the trajectory (truncated), as TRL drops an overlong tool result.

Each trajectory becomes one `Response`: its tokens, mask 1 on the policy's turns and 0 on the tool messages, the
turns' old log-probs (0 on tool tokens), and `extra` columns the reward functions receive as keyword lists (TRL
forwards a rollout's extra fields the same way): `turns`, `tool_calls`, `tool_failures`, `stopped` (answer,
done, max_turns, budget, no_stop) and `environment_reward` (`env.get_reward()`, None when the environment has none).

Work per turn: the turn's tokens and the tool reply, once. The G trajectories of a row advance in rounds: each round
decodes the next turn of every trajectory still running in one batch (`longstraw.ragged`: branches of different
lengths), then each runs its tool calls; the order of draws from the row's generator depends only on the rounds.
Memory: the prompt state + the G branches' growth (a finished trajectory keeps only its tokens).

On N processes (a prompt captured with context parallelism) every rank grows the same trajectories on collective
branches; the environment exists on rank 0 only, and its reset, tool calls and reward reach the other ranks from
there (`TurnSampler.on_main`), so a tool runs once per call, not once per rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch

from ..branch import Branch
from ..ragged import sample_branches
from ..sampler import Samples
from ..tasks import Example
from ..train.rollout import Response, TurnSampler
from .environment import ToolCall, call_tool, environment_tools, parse_tool_calls, tool_message_ids


@dataclass(frozen=True)
class AgentSettings:
    """Budgets of a multi-turn rollout (`TrainConfig` fields of the same names; `max_completion_length` bounds the
    whole trajectory after the prompt, tool tokens included, as in TRL)."""

    max_turns: int = 8
    max_turn_tokens: int | None = None
    max_tool_tokens: int = 1024

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1; got {self.max_turns}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1 or None; got {self.max_turn_tokens}")
        if self.max_tool_tokens < 1:
            raise ValueError(f"max_tool_tokens must be >= 1; got {self.max_tool_tokens}")


#: tokens a chat template puts around one tool reply (role markers, the next turn's header): room kept beside the
#: reply's own budget; a longer reply is written by one copy of the branch's own K/V instead of in place
REPLY_TEMPLATE_TOKENS = 64


class EnvironmentRollout:
    """The multi-turn rollout hook of an environment factory (see the module doc). `parse`: text → tool calls."""

    def __init__(
        self,
        factory: Callable[[], Any],
        settings: AgentSettings | None = None,
        parse: Callable[[str], list[ToolCall]] = parse_tool_calls,
    ):
        if not callable(factory):
            raise TypeError(f"environment factory must be callable; got {type(factory).__name__}")
        self.factory, self.settings, self.parse = factory, settings or AgentSettings(), parse
        #: one tokenizer call at a time when trajectories run in threads (a fast tokenizer is not safe to share)
        self._tokenizing = threading.Lock()
        self.__name__ = getattr(factory, "__name__", type(factory).__name__)
        #: room each branch keeps after a decoded turn for the tool replies that follow (`sample_branches`'
        #: `room_after`): a reply's budget and its chat template at first, then the longest replies seen
        self._reply_room = self.settings.max_tool_tokens + REPLY_TEMPLATE_TOKENS

    def __call__(self, sampler: TurnSampler, example: Example, num_generations: int) -> list[Response]:
        split = getattr(sampler, "split", None)
        if split is None:  # the own sampler: the G trajectories' turns decoded together (`longstraw.ragged`)
            return self.together(sampler, example, num_generations)
        # a sampler that is a server (vLLM): the G trajectories run at once, so that the server batches their turns
        # (tool calls run as their trajectory's turn ends); trajectory i draws from its own seeded sampler, so the
        # result does not depend on the threads' order
        with ThreadPoolExecutor(max_workers=num_generations, thread_name_prefix="longstraw-agent") as pool:
            futures = [pool.submit(self.trajectory, split(i), example) for i in range(num_generations)]
            return [f.result() for f in futures]

    def trajectory(self, sampler: TurnSampler, example: Example) -> Response:
        """One trajectory from the sampler's prompt state, its turns decoded one after another (its branch is freed
        on return)."""
        s = sampler.settings
        run = self._turns(sampler, example)
        try:
            branch, room = next(run)
            while True:
                out = branch.sample(
                    room,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    stop_token_ids=[] if s.ignore_eos else [sampler.eos_token_id],
                    generator=sampler.generator,
                    allowed_token_ids=sampler.allowed_token_ids,
                )
                branch, room = run.send(out)
        except StopIteration as done:
            return done.value
        finally:
            run.close()

    def together(self, sampler: TurnSampler, example: Example, num_generations: int) -> list[Response]:
        """G trajectories whose turns are decoded in one batch (`longstraw.ragged.sample_branches`, each branch with
        its own length): every round decodes the next turn of every trajectory still running, then each runs its
        tool calls and reads their replies; a trajectory that ends leaves the rounds. Where the branches cannot be
        stacked (`longstraw.ragged.stackable`: a layer kind it does not serve, context parallelism) each turn is
        decoded on its own, in the same order. Memory: the prompt state + the G branches' growth."""
        s = sampler.settings
        # trajectory i draws from a generator of its own, seeded from the row's: what it samples does not depend on
        # which trajectories share its rounds, or on whether they are batched (one process) or not (N processes)
        device = sampler.generator.device
        seeds = torch.randint(0, 2**62, (num_generations,), generator=sampler.generator, device=device).tolist()
        gens = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        runs = [self._turns(sampler, example) for _ in range(num_generations)]
        results: list[Response | None] = [None] * num_generations
        pending: dict[int, tuple[Branch, int]] = {}

        def advance(i: int, out: Samples | None) -> None:
            try:
                pending[i] = next(runs[i]) if out is None else runs[i].send(out)
            except StopIteration as done:
                results[i] = done.value

        try:
            for i in range(num_generations):
                advance(i, None)
            while pending:
                rows = sorted(pending)
                outs = sample_branches(
                    [pending[i][0] for i in rows],
                    1,
                    [pending[i][1] for i in rows],
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    stop_token_ids=[] if s.ignore_eos else [sampler.eos_token_id],
                    generator=[gens[i] for i in rows],
                    allowed_token_ids=sampler.allowed_token_ids,
                    keep=True,
                    room_after=self._reply_room,
                )
                for i, out in zip(rows, outs):
                    del pending[i]
                    advance(i, out)
        finally:
            for run in runs:  # frees the branches of trajectories an error left unfinished
                run.close()
        assert all(r is not None for r in results)  # every trajectory ran to its end
        return cast(list[Response], results)

    def _turns(self, sampler: TurnSampler, example: Example) -> Generator[tuple[Branch, int], Samples, Response]:
        """One trajectory as a generator: it yields (its branch, the turn's token budget) when it needs a policy turn,
        receives that turn sampled into the branch (`Samples` of one sequence), and returns the `Response`."""
        s, tok, eos = sampler.settings, sampler.tokenizer, sampler.eos_token_id
        env: Any  # the factory's environment (duck-typed: `reset` and its tool methods), on rank 0 only
        env = tools = None
        if sampler.is_main:  # on N processes the environment lives on rank 0 (`TurnSampler.on_main`)
            env = self.factory()
            tools = environment_tools(env)
        first = sampler.on_main("agent: environment reset", lambda: env.reset(**example.reward_columns()))
        budget = s.max_completion_length
        turn_cap = self.settings.max_turn_tokens or budget
        limit = sampler.max_positions or float("inf")
        pieces: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (tokens, old log-probs, policy)
        added = 0
        calls = failures = turns = 0
        stopped, truncated = "max_turns", False
        with sampler.fork() as branch:  # the row's prompt: its shared prefix's state and its own suffix
            if first:  # the environment's first observation: a tool message before the first turn
                with self._tokenizing:
                    obs = torch.tensor([eos, *tool_message_ids(tok, "reset", str(first))])
                if obs.numel() < budget and branch.length + obs.numel() < limit:
                    branch.extend(obs)
                    pieces.append((obs, torch.zeros(obs.numel()), False))
                    added += obs.numel()
            for _ in range(self.settings.max_turns):
                room = min(budget - added, turn_cap)
                if room < 1 or branch.length >= limit:
                    stopped, truncated = "budget", True
                    break
                out = yield branch, room
                turn, lp = out.tokens[0], out.logprobs[0]
                pieces.append((turn, lp, True))
                added += turn.numel()
                turns += 1
                with self._tokenizing:
                    text = cast(str, tok.decode(turn, skip_special_tokens=True))  # one sequence: a str
                requested = self.parse(text)
                if not requested:  # the answer, or a turn that ran out of tokens without one
                    stopped, truncated = ("no_stop", True) if bool(out.truncated[0]) else ("answer", False)
                    break
                if turns == self.settings.max_turns:
                    break
                obs, failed, done = sampler.on_main(
                    "agent: tool calls", partial(self._call_tools, env, tools, tok, requested)
                )
                calls += len(requested)
                failures += failed
                if done:  # the environment ended the trajectory (a final answer tool)
                    stopped = "done"
                    break
                if added + len(obs) >= budget or branch.length + len(obs) >= limit:
                    stopped, truncated = "budget", True
                    break
                obs_ids = torch.tensor(obs, dtype=torch.long)
                self._reply_room = max(self._reply_room, obs_ids.numel())
                branch.extend(obs_ids)
                pieces.append((obs_ids, torch.zeros(obs_ids.numel()), False))
                added += obs_ids.numel()
        tokens = torch.cat([p[0] for p in pieces])
        mask = torch.cat([torch.full((p[0].numel(),), float(p[2])) for p in pieces])
        old = torch.cat([p[1] for p in pieces])

        def env_reward():
            reward = getattr(env, "get_reward", None)
            return None if reward is None else float(reward())

        extra = dict(
            turns=turns,
            tool_calls=calls,
            tool_failures=failures,
            stopped=stopped,
            environment_reward=sampler.on_main("agent: environment reward", env_reward),
        )
        return Response(tokens, old, mask, truncated, extra=extra)

    def _call_tools(self, env, tools, tok, requested: list[ToolCall]) -> tuple[list[int], int, bool]:
        """Run a turn's tool calls: (the replies' chat-template token ids, how many failed, whether the environment
        is done)."""
        obs, failures = [], 0
        for call in requested:
            reply, failed = call_tool(tools, call)
            failures += failed
            with self._tokenizing:
                obs += tool_message_ids(tok, call.name, self._cut(tok, reply))
        return obs, failures, bool(getattr(env, "done", False))

    def _cut(self, tok, text: str) -> str:
        """`text` cut to `max_tool_tokens` tokens, saying how much was left out."""
        ids = tok(text, add_special_tokens=False)["input_ids"]
        n = self.settings.max_tool_tokens
        if len(ids) <= n:
            return text
        return tok.decode(ids[:n]) + f"\n[cut: {len(ids) - n} more tokens]"
