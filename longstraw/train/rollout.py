"""Rollout: a step's prompts → scored responses with advantages (no gradients anywhere).

The step's rows are first grouped into contexts (`longstraw.train.sharing`): rows that share a prompt prefix (a
document asked several questions) are captured once, up to that prefix. For each context:
1. capture its durable state once (`longstraw.capture`);
2. for each of its rows, sample G responses from that one state after the row's own suffix (`prefix_ids`: their
   log-probs are the "old" ones), or let a rollout hook build them (multi-turn, tool output) through a
   `TurnSampler` that reads the suffix first;
3. score them with the reward functions (`RewardSet`);
4. with `beta > 0`, the reference policy's log-probs (adapters disabled, a second capture of the context).
Then the advantages are computed per group (one row's G responses) over the weighted rewards. The update stage
(`longstraw.train.update`) replays what this stage returns.

Memory: one context's state at a time (+ one row's suffix per response, read on top of it), except that with one
context per step it is kept for the update (no second capture).

On N processes the stage is handed its rank's part of the step (`share`, a
`longstraw.distributed.parallelize.StepShare`): the capture is context parallel among the group's ranks, sampling a
collective giving every rank the same responses, the rewards scored on the group's first rank and handed to the others,
each rank computes the reference log-probs of the responses it will replay (r, r + N, ...); with several groups each
takes its share of the step's contexts and the groups exchange their rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from ..api import capture
from ..branch import Branch
from ..distributed.parallelize import StepShare
from ..losses import combine_rewards, group_advantages
from ..model.positions import position_limit
from ..prompt_state import PromptState
from ..ragged import sample_branches, stackable
from ..replay.batched import replay_batch
from ..sampler import Samples, sample
from ..tasks import Example
from ..tasks.token_cache import TokenCache
from .memory import MemoryMeter
from .rewards import RewardSet
from .sharing import Context, shared_contexts, shared_fraction
from .staleness import StateStore
from .vllm_client import VLLMClient, VLLMSampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..distributed.ranks import Ranks

#: responses whose reference log-probs one forward takes (no autograd: the transients of one forward of this many)
REFERENCE_BATCH = 16


@dataclass
class Policy:
    """What the stages need of the model: the model (PEFT-wrapped or not), its tokenizer, the stop token,
    and the tokens sampling may choose (None: all)."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    eos_token_id: int
    allowed_token_ids: list[int] | None = None
    #: the dataset's prompts tokenized once (`token_cache`); texts it does not hold are tokenized here
    token_cache: TokenCache | None = None

    def encode(self, text: str) -> torch.Tensor:
        """Token ids `[P]` of a prompt (no special tokens added: a chat template writes its own)."""
        cached = self.token_cache.ids(text) if self.token_cache is not None else None
        ids = cached if cached is not None else self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 0:
            raise ValueError(f"prompt {text[:60]!r} encodes to no tokens")
        return ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)


@dataclass
class Response:
    """One response: `tokens` `[R]`, its old log-probs `[R]` (float32, from sampling), `mask` `[R]` float32
    (1: a token the policy wrote, in the loss; 0: a tool or environment token it only reads), whether it
    was cut at max_completion_length, and the reference log-probs `[R]` when beta > 0."""

    tokens: torch.Tensor
    #: None when another program sampled the response (vLLM): the update's first replay fills them in
    old_logprobs: torch.Tensor | None
    mask: torch.Tensor
    truncated: bool
    ref_logprobs: torch.Tensor | None = None
    #: `[R]` the external sampler's log-probs of the tokens (vLLM's), for the importance-sampling correction
    sampler_logprobs: torch.Tensor | None = None
    #: per-response columns for the reward functions (a multi-turn rollout's turns, tool calls, environment reward)
    extra: dict = field(default_factory=dict)


@dataclass
class RowGroup:
    """One prompt and its G responses; `rewards` `[G, F]` per reward function; `state` (its context's, shared by the
    context's groups) kept for the update. `shared`: how many leading prompt tokens its context captured; the rest,
    `suffix`, is the row's own, read on top of the context's state."""

    example: Example
    prompt_ids: torch.Tensor
    responses: list[Response]
    rewards: torch.Tensor
    state: PromptState | None = None
    shared: int | None = None  # None: the whole prompt

    @property
    def suffix(self) -> torch.Tensor:
        """`[P − shared]` the row's tokens after its context's shared prefix (empty when not sharing)."""
        return self.prompt_ids[self.prompt_ids.numel() if self.shared is None else self.shared :]


@dataclass
class Rollout:
    """A step's groups, their weighted rewards `[N]` and advantages `[N]` (N = groups · G, group-major)."""

    groups: list[RowGroup]
    rewards: torch.Tensor
    advantages: torch.Tensor
    durable_bytes: int = 0
    tokens: int = 0
    per_function: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    #: the step's contexts (rows captured together); default: one per group
    contexts: list[Context] = field(default_factory=list)
    #: fraction of the step's prompt tokens not captured thanks to sharing (`longstraw.train.sharing.shared_fraction`)
    shared_frac: float = 0.0
    #: the contexts this rank's context-parallel group replays (`context_parallel` groups); None: every context
    own_contexts: list[int] | None = None

    def __post_init__(self):
        if not self.contexts:
            self.contexts = [Context(g.prompt_ids.numel(), (i,)) for i, g in enumerate(self.groups)]

    @property
    def responses(self) -> list[Response]:
        return [r for g in self.groups for r in g.responses]

    @property
    def group_ids(self) -> list[int]:
        return [gi for gi, g in enumerate(self.groups) for _ in g.responses]


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are drawn (`TrainConfig`'s fields of the same names)."""

    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = False

    @classmethod
    def from_config(cls, cfg) -> SamplingSettings:
        return cls(
            cfg.num_generations, cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k, cfg.ignore_eos
        )


class TurnSampler:
    """The captured prompt's sampler, as a rollout hook receives it.

    `sample(num, max_new_tokens, prefix_ids)` continues after `prompt + prefix_ids` (the response so far:
    earlier turns and tool output; when the state is a context shared with other rows, `suffix`, the row's own end
    of the prompt, is read before it), with the run's temperature, top-p/top-k, stop token and seeded
    generator; the returned log-probs are the old log-probs of the new tokens. `tokenizer` and
    `eos_token_id` are there for hooks that decode or append text.

    On N processes (context parallelism) every rank runs the hook alike and sampling is a collective (every rank
    the same tokens); `on_main(name, fn)` runs what must happen once (an environment's tool call, anything with side
    effects or its own randomness) on rank 0 and gives its result, or its exception, to every rank.
    """

    def __init__(
        self,
        state: PromptState | Branch,
        policy: Policy,
        settings: SamplingSettings,
        generator: torch.Generator,
        ranks=None,
        suffix: torch.Tensor | None = None,
    ):
        self.state, self.settings, self.generator = state, settings, generator
        self.suffix = suffix if suffix is not None and suffix.numel() else None  # `[S]` the row's own prompt end
        self.tokenizer, self.eos_token_id = policy.tokenizer, policy.eos_token_id
        #: the tokens the policy may write (None: all); what a turn's sampler is restricted to
        self.allowed_token_ids = policy.allowed_token_ids
        self.ranks = ranks  # `longstraw.distributed.ranks.Ranks` of a multi-process run, else None

    @property
    def max_positions(self) -> int | None:
        """The model's positions (`max_position_embeddings`; None: unbounded), which a trajectory may not pass."""
        return position_limit(self.state.parts.config)

    @property
    def is_main(self) -> bool:
        """Whether this process runs what `on_main` runs (rank 0, or the only process)."""
        return self.ranks is None or self.ranks.main

    def on_main(self, name: str, fn):
        """`fn()` on rank 0 only, its result (picklable) or exception on every rank; `fn()` in one process."""
        if self.ranks is None or self.ranks.size == 1:
            return fn()
        return self.ranks.from_main(name, fn)

    def fork(self) -> Branch:
        """A `Branch` of the row's prompt: the captured state's, with the row's own `suffix` (when the state is a
        context shared with other rows) read into it. A collective on N processes, as `Branch.extend` is."""
        branch = self.state.fork()
        if self.suffix is not None:
            with torch.no_grad():
                branch.extend(self.suffix)
        return branch

    def sample(self, num: int, max_new_tokens: int | None = None, prefix_ids=None) -> Samples:
        s = self.settings
        kw: dict[str, Any] = dict(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            generator=self.generator,
            stop_token_ids=[] if s.ignore_eos else [self.eos_token_id],
            allowed_token_ids=self.allowed_token_ids,
        )
        if self.suffix is not None:
            more = torch.zeros(0, dtype=torch.long) if prefix_ids is None else torch.as_tensor(prefix_ids).reshape(-1)
            prefix_ids = torch.cat([self.suffix, more.to(self.suffix.device, torch.long)])
        group = getattr(self.state, "group", None)
        if group is not None and isinstance(self.state, PromptState):  # context parallel: a collective
            if prefix_ids is None:
                return self.state.sample(num, max_new_tokens or s.max_completion_length, **kw)
            prefix = torch.as_tensor(prefix_ids).reshape(-1).cpu()
            group.agree(
                "TurnSampler.sample",
                {
                    "prefix_ids": prefix,
                    "num": num,
                    "max_new_tokens": repr(max_new_tokens),
                    "generator state": self.generator.get_state(),
                },
            )
        return sample(self.state, num, max_new_tokens or s.max_completion_length, prefix_ids=prefix_ids, **kw)


def _context_key(ex: Example):
    """A row's `context` column as a grouping key (None: none); a JSON list or object by its canonical text."""
    key = ex.columns.get("context")
    return key if key is None or isinstance(key, str | int | float) else json.dumps(key, sort_keys=True)


def default_rollout(sampler: TurnSampler, example: Example, num_generations: int) -> list[Response]:
    """G single-turn responses sampled together from the prompt state: every token in the loss."""
    s = sampler.sample(num_generations)
    return [Response(t, lp, torch.ones(t.numel()), bool(tr)) for t, lp, tr in zip(s.tokens, s.logprobs, s.truncated)]


def _as_response(item, where: str, max_len: int, eos: int) -> Response:
    """A hook's item (a `Response`, or a dict with tokens, mask, logprobs [, truncated]) checked."""
    if isinstance(item, dict):
        tokens = torch.as_tensor(item["tokens"], dtype=torch.long).reshape(-1)
        mask = torch.as_tensor(item.get("mask", torch.ones(tokens.numel())), dtype=torch.float32).reshape(-1)
        logprobs = torch.as_tensor(item["logprobs"], dtype=torch.float32).reshape(-1)
        truncated = bool(item.get("truncated", int(tokens[-1]) != eos if tokens.numel() else True))
        item = Response(tokens, logprobs, mask, truncated)
    if not isinstance(item, Response):
        raise TypeError(f"{where}: a rollout hook returns Response objects or dicts with tokens, mask, logprobs")
    if item.old_logprobs is None:
        raise ValueError(f"{where}: a response needs the log-probs its sampler gave its tokens")
    n = item.tokens.numel()
    if n == 0 or n > max_len:
        raise ValueError(f"{where}: a response must hold 1..max_completion_length={max_len} tokens; got {n}")
    if item.mask.numel() != n or item.old_logprobs.numel() != n:
        raise ValueError(
            f"{where}: tokens, mask and logprobs differ in length ({n}, {item.mask.numel()}, "
            f"{item.old_logprobs.numel()})"
        )
    if not bool(((item.mask == 0) | (item.mask == 1)).all()):
        raise ValueError(f"{where}: the mask must hold only 0 and 1")
    if not bool(torch.isfinite(item.old_logprobs[item.mask > 0]).all()):
        raise ValueError(f"{where}: old log-probs of policy tokens must be finite")
    return item


def reference_policy_logprobs(
    model,
    prompt: torch.Tensor,
    responses: list[Response],
    temperature: float,
    chunk_size: int | None,
    state_dtype: str | None = None,
    ranks: Ranks | None = None,
    suffixes: list[torch.Tensor] | None = None,
) -> list[torch.Tensor | None]:
    """Log-probs `[R]` of each response under the reference policy: the same model, adapters disabled, after
    `prompt` (captured once) and the response's row `suffixes[i]` (None: none). On N ranks (a collective) only those of
    the responses this rank replays (`ranks.padded_share`); None for the others."""
    if not hasattr(model, "disable_adapter"):
        raise ValueError("beta > 0 needs a reference policy: train a LoRA adapter (lora: true)")
    after = suffixes if suffixes is not None else [None] * len(responses)
    parallel = ranks is not None and ranks.size > 1
    out: list[torch.Tensor | None] = [None] * len(responses)
    with torch.no_grad(), model.disable_adapter():
        group = ranks.pg if ranks is not None and parallel else None
        with capture(model, prompt, chunk_size=chunk_size, state_dtype=state_dtype, group=group) as ref_state:
            # row by row (responses with the same suffix, consecutive): the row's suffix read once into a branch (on
            # every rank: a collective), the row's responses replayed after it (spread over the ranks)
            start = 0
            while start < len(responses):
                end = start + 1
                while end < len(responses) and _same_suffix(after[end], after[start]):
                    end += 1
                suffix = after[start]
                with ref_state.fork() as branch:
                    if suffix is not None:
                        branch.extend(suffix)
                    if not parallel:  # the row's responses in batches (no graph: one forward each)
                        for first in range(start, end, REFERENCE_BATCH):
                            last = min(first + REFERENCE_BATCH, end)
                            outs = replay_batch(branch, [r.tokens for r in responses[first:last]], temperature)
                            out[first:last] = [o.logprobs for o in outs]
                        start = end
                        continue
                    # on N ranks every rank replays as often (None: padding)
                    turns = ranks.padded_share(end - start) if ranks is not None and parallel else range(end - start)
                    for i in turns:
                        j = start + (0 if i is None else i)
                        lp = branch.replay(responses[j].tokens, temperature=temperature).logprobs
                        if i is not None:
                            out[j] = lp
                start = end
    return out


def _same_suffix(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a is b or (a.shape == b.shape and torch.equal(a, b))


#: prompts at least this long show a progress bar while they are captured (minutes on a CPU past ~32K tokens)
LONG_CAPTURE = 16_384


def capture_bar(tokens: int) -> Callable[[int, int], None] | None:
    """A `capture(progress=...)` callback drawing a tqdm bar of the tokens captured ("capture: 12,288/65,000 tok"),
    closed when the capture ends; None for a prompt shorter than `LONG_CAPTURE`."""
    if tokens < LONG_CAPTURE:
        return None
    bar = tqdm(total=tokens - 1, desc="capture", unit="tok", unit_scale=True, dynamic_ncols=True)

    def show(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return show


@dataclass
class RolloutStage:
    """The rollout stage of a run: `collect(examples, step)` → `Rollout`.

    `rollout_func(sampler, example, num_generations) -> list[Response | dict]` replaces the default
    single-turn sampling (see `TurnSampler`). `generator(step, b)` seeds prompt b of step `step`.
    """

    policy: Policy
    rewards: RewardSet
    settings: SamplingSettings
    generator: Callable[[int, int], torch.Generator]
    chunk_size: int | None = None
    prompt_grad: str = "detached"
    state_dtype: str | None = None
    beta: float = 0.0
    scale_rewards: str = "group"
    rollout_func: Callable | None = None
    #: this rank's part of a step on N processes (`longstraw.distributed.parallelize.StepShare`: its context-parallel
    #: group's ranks, which of the step's contexts the group takes); the default: one process
    share: StepShare = field(default_factory=StepShare)
    #: `shared_contexts`' options (`TrainConfig.share_prefixes`, `min_shared_prefix`, `max_row_suffix`)
    share_prefixes: bool = True
    min_shared_prefix: int = 256
    max_row_suffix: int | None = 2048
    #: prompt states kept across optimizer steps (`recapture_every`, `longstraw.train.staleness`); None: none kept
    store: StateStore | None = None
    #: the vLLM server that samples the responses (`rollout_backend: vllm`); None: the own sampler
    vllm: VLLMClient | None = None
    #: a progress bar on stderr while a prompt of `LONG_CAPTURE` tokens or more is captured (`TrainConfig.progress`)
    progress: bool = False

    def contexts(self, examples: list[Example], prompts: list[torch.Tensor]) -> list[Context]:
        """How the step's rows are captured: together where they share a prefix (`longstraw.train.sharing`), else
        one by one."""
        if not self.share_prefixes:
            return [Context(p.numel(), (b,)) for b, p in enumerate(prompts)]
        keys = [_context_key(ex) for ex in examples]
        return shared_contexts(prompts, keys, self.min_shared_prefix, self.max_row_suffix)

    def collect(self, examples: list[Example], step: int, meter: MemoryMeter) -> Rollout:
        prompts = [self.policy.encode(ex.prompt) for ex in examples]
        contexts = self.contexts(examples, prompts)
        # with several context-parallel groups, this rank's group takes every `count`-th context
        own = [k for k in range(len(contexts)) if self.share.owns_context(k)]
        keep_state = len(own) == 1  # its state serves the update too (no second capture)
        groups: list[RowGroup | None] = [None] * len(examples)
        durable = 0
        if self.vllm is not None:  # the server samples every row of the step at once; nothing captured here
            self._vllm_rows(examples, prompts, contexts, step, meter, groups)
        for k in own if self.vllm is None else ():
            durable = max(durable, self._context(contexts[k], examples, prompts, step, keep_state, meter, groups))
        if self.share.several_groups:  # the other groups' rows, sampled and scored there
            mine = {b: replace(g, state=None) for b, g in enumerate(groups) if g is not None}
            for b, g in self.share.exchange("rollout: the groups' sampled rows", mine).items():
                if groups[b] is None:
                    groups[b] = g
            durable = int(self.share.max_floats("rollout: durable bytes", [float(durable)])[0])
        done = [g for g in groups if g is not None]
        assert len(done) == len(examples)  # every row is in one context
        per_f = torch.cat([g.rewards for g in done])
        total = combine_rewards(per_f, self.rewards.weights)
        adv = group_advantages(total, self.settings.num_generations, self.scale_rewards)
        tokens = sum(g.prompt_ids.numel() + sum(r.tokens.numel() for r in g.responses) for g in done)
        own_contexts = own if self.share.several_groups else None
        return Rollout(
            done, total, adv, durable, tokens, per_f, contexts, shared_fraction(prompts, contexts), own_contexts
        )

    def _context(
        self,
        ctx: Context,
        examples: list[Example],
        prompts: list[torch.Tensor],
        step: int,
        keep_state: bool,
        meter: MemoryMeter,
        groups: list[RowGroup | None],
    ) -> int:
        """Capture one context, sample and score each of its rows (into `groups`); returns its state's bytes."""
        model = self.policy.model
        prefix = prompts[ctx.rows[0]][: ctx.length]
        state: PromptState | None  # None once released (a state only sampled from)
        with meter.stage("capture"):
            mode = self.prompt_grad if keep_state else "detached"  # a state only sampled from needs no grad

            def fresh() -> PromptState:
                return capture(
                    model,
                    prefix,
                    chunk_size=self.chunk_size,
                    prompt_grad=mode,
                    state_dtype=self.state_dtype,
                    group=self.share.group,
                    progress=capture_bar(prefix.numel()) if self.progress else None,
                )

            if self.store is not None:  # a state kept from an earlier step, or captured now and kept
                state = self.store.get(prefix, fresh)
                keep_state = True  # the update reads it from the group
            else:
                state = fresh()
        nbytes = state.nbytes
        together = self._rows_together(ctx, state, prompts, step, meter)
        for b in ctx.rows:
            ex, prompt = examples[b], prompts[b]
            suffix = prompt[ctx.length :]
            with meter.stage("sample"):
                if b in together:
                    responses = together[b]
                elif suffix.numel() and not self.share.collective:
                    # the row's own question read once, into its own branch; its G responses are sampled after it
                    with state.fork() as branch:
                        with torch.no_grad():
                            branch.extend(suffix)
                        sampler = TurnSampler(branch, self.policy, self.settings, self.generator(step, b))
                        responses = self._responses(sampler, ex)
                else:  # context parallel: every sampling call reads the suffix first (a collective)
                    sampler = TurnSampler(
                        state, self.policy, self.settings, self.generator(step, b), self.share.context, suffix
                    )
                    responses = self._responses(sampler, ex)
            with meter.stage("reward"):
                rewards = self._score(ex, responses)
            groups[b] = RowGroup(ex, prompt, responses, rewards, state if keep_state else None, ctx.length)
        if self.beta > 0:
            self._reference(ctx, prompts, meter, groups)
        if not keep_state:
            state.release()
        return nbytes

    def _rows_together(
        self, ctx: Context, state: PromptState, prompts: list[torch.Tensor], step: int, meter: MemoryMeter
    ) -> dict[int, list[Response]]:
        """The G responses of every row of a shared context sampled in one decode batch (`longstraw.ragged`): each row's
        own suffix read into a branch of its own, then all rows' samples decoded together, each row drawing from its
        own generator as it would alone. Only for single-turn sampling on one process (a rollout hook runs row by
        row); {} when the context has one row or its branches cannot be stacked."""
        if len(ctx.rows) < 2 or self.rollout_func is not None or self.share.collective:
            return {}
        s = self.settings
        with meter.stage("sample"):
            branches = []
            try:
                for b in ctx.rows:
                    branch = state.fork()
                    branches.append(branch)
                    with torch.no_grad():
                        branch.extend(prompts[b][ctx.length :])
                if not stackable(branches):
                    return {}
                outs = sample_branches(
                    branches,
                    s.num_generations,
                    s.max_completion_length,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    stop_token_ids=[] if s.ignore_eos else [self.policy.eos_token_id],
                    generator=[self.generator(step, b) for b in ctx.rows],
                    allowed_token_ids=self.policy.allowed_token_ids,
                )
            finally:
                for branch in branches:
                    branch.release()
        return {
            b: [
                Response(t, lp, torch.ones(t.numel()), bool(tr)) for t, lp, tr in zip(o.tokens, o.logprobs, o.truncated)
            ]
            for b, o in zip(ctx.rows, outs)
        }

    def _vllm_rows(self, examples, prompts, contexts: list[Context], step: int, meter: MemoryMeter, groups) -> None:
        """The step's rows sampled by vLLM (into `groups`): each row's whole prompt sent as token ids (vLLM's prefix
        cache shares a context's prefix), every row at once (threads: the server batches their samples). Nothing is
        captured here: the update captures each context for its replays, the reference its own. The responses keep
        vLLM's log-probs as `sampler_logprobs`; their old log-probs are the trainer's, from the update's first
        replay."""
        client = self.vllm
        assert client is not None
        positions = position_limit(self.policy.model.config)

        def row(b: int) -> list[Response]:
            g = self.generator(step, b)  # the row's seed, as the own sampler's generator is seeded
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g, device=g.device))
            sampler = VLLMSampler(client, prompts[b], self.policy, self.settings, seed, positions)
            responses = self._responses(sampler, examples[b])  # type: ignore[arg-type]
            for r in responses:
                r.sampler_logprobs, r.old_logprobs = r.old_logprobs, None
            return responses

        def every_row() -> list[list[Response]]:
            with ThreadPoolExecutor(max_workers=len(examples), thread_name_prefix="longstraw-vllm") as pool:
                return list(pool.map(row, range(len(examples))))

        length = {b: ctx.length for ctx in contexts for b in ctx.rows}
        with meter.stage("sample"):  # on N processes rank 0 samples (environments included) and hands out the rows
            sampled = self.share.from_main("rollout: the rows vLLM sampled", every_row)
        for b, responses in enumerate(sampled):
            with meter.stage("reward"):
                rewards = self._score(examples[b], responses)
            groups[b] = RowGroup(examples[b], prompts[b], responses, rewards, None, length[b])
        if self.beta > 0:
            for ctx in contexts:
                self._reference(ctx, prompts, meter, groups)

    def _reference(self, ctx: Context, prompts: list[torch.Tensor], meter: MemoryMeter, groups) -> None:
        """The reference policy's log-probs of every response of the context's rows (`ref_logprobs`)."""
        with meter.stage("reference"):
            rows = [(prompts[b][ctx.length :], r) for b in ctx.rows for r in groups[b].responses]
            refs = reference_policy_logprobs(
                self.policy.model,
                prompts[ctx.rows[0]][: ctx.length],
                [r for _, r in rows],
                self.settings.temperature,
                self.chunk_size,
                self.state_dtype,
                ranks=self.share.context,
                suffixes=[s for s, _ in rows],
            )
        for (_, r), ref in zip(rows, refs):
            r.ref_logprobs = ref

    def _score(self, ex: Example, responses: list[Response]) -> torch.Tensor:
        """`[G, F]` the reward functions' values of one row's responses; on N ranks scored once, on rank 0 (its
        result or error on every rank)."""

        def score():
            # the text without special tokens (the end token's text), as TRL's GRPOTrainer decodes completions
            texts = self.policy.tokenizer.batch_decode([r.tokens for r in responses], skip_special_tokens=True)
            keys = sorted({k for r in responses for k in r.extra})
            extra = {k: [r.extra.get(k) for r in responses] for k in keys}
            return self.rewards.score(ex, texts, [r.tokens.tolist() for r in responses], extra)

        return self.share.from_main("rollout: rewards from rank 0", score)

    def _responses(self, sampler: TurnSampler, ex: Example) -> list[Response]:
        g = self.settings.num_generations
        if self.rollout_func is None:
            return default_rollout(sampler, ex, g)
        name = getattr(self.rollout_func, "__name__", "rollout_func")
        items = list(self.rollout_func(sampler, ex, g))
        if len(items) != g:
            raise ValueError(
                f"rollout hook {name!r} returned {len(items)} responses for num_generations={g} "
                f"on {ex.source or 'the example'}"
            )
        return [
            _as_response(
                it,
                f"rollout hook {name!r}, response {i}",
                self.settings.max_completion_length,
                self.policy.eos_token_id,
            )
            for i, it in enumerate(items)
        ]
