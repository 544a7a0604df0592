"""The GRPO trainer: wires the stages of a run, one optimizer step per batch.

    build      (`build`)       the model and tokenizer, the reward functions, the learning-rate schedule
    rollout    (`rollout`)     capture each prompt → sample G → reward → reference log-probs → advantages
    update     (`update`)      loss normalizer → serial replay, loss, backward per response
    optimizer                  clip, one AdamW step (skipped on a non-finite loss or gradient); trainable bf16
                               weights step on float32 masters (`precision`)
    checkpoint (`checkpoint`)  atomic, resumable; the final model via `export`
    evaluation (`evaluation`)  held-out greedy accuracy per prompt length (`Trainer.evaluate`)

(modules of `longstraw.train`)

The first `sft_warmup_steps` steps are supervised (`update.sft_update`). Data and sampling are drawn
from (seed, step), so a resumed run repeats exactly what an uninterrupted one does. Metrics of every
step, with memory and time per stage (`longstraw.train.memory.MemoryMeter`), go to `metrics.jsonl` (and to
TensorBoard with `report_to: tensorboard`).

On N processes (torchrun, `longstraw train --nproc N`; `longstraw.distributed.ranks`) the run is spread once, when
the trainer starts (`self.parallel`, `longstraw.distributed.parallelize`): rank 0's weights on every rank, the
context-parallel groups (`context_parallel: C`: N / C groups of C ranks, each taking every (N / C)-th context of a
step, their sampled rows exchanged so that every rank holds the step's rewards and advantages), the experts spread
(`expert_parallel`), the decoder layers sharded (`fsdp`: FSDP2, 1/N of their weights, gradients and AdamW moments per
rank, their gradients reduce-scattered in the step's last backward, bf16 layers kept as float32 shards). The stages
take the group's ranks (`parallel.context`); a step's gradients are summed over all N ranks (`reduce_gradients`), one
clipping norm covers shards, spread experts and replicated weights, and rank 0 alone writes files. Checkpoints of
partitioned weights hold them whole with one optimizer file per rank (`save_sharded_checkpoint`); rank 0 exports the
final model from the last checkpoint into a model of its own.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from ..agent.rollout import AgentSettings, EnvironmentRollout
from ..distributed.fsdp import full_tensors
from ..distributed.parallelize import parallelize
from ..distributed.ranks import setup_ranks
from ..losses import make_loss
from ..model.positions import position_limit
from ..paths import cache_dir
from ..tasks import Example
from ..tasks.token_cache import TokenCache
from . import vllm_server
from .build import build_model_and_tokenizer, generator, lr_lambda, reward_set
from .config import TrainConfig
from .data import build_data
from .devices import resolve_device
from .evaluation import HELD_OUT_KEY, Evaluation
from .memory import MemoryMeter
from .metrics import MetricsWriter
from .precision import MasterWeights
from .rewards import RewardFunctionError, resolve_callable
from .rollout import Policy, RolloutStage, SamplingSettings
from .row_check import RowReport, RowRules, check_rows
from .run_checkpoints import RunCheckpoints
from .run_record import (
    IN_MEMORY,
    data_record,
    describe_reward,
    importable,
    model_fingerprint,
    resume_problem,
    schedule_over,
)
from .staleness import StateStore, kv_drift_probe
from .update import UpdateSettings, policy_update, prompt_length_metrics, sft_update
from .vllm_client import VLLMClient

__all__ = ["HELD_OUT_KEY", "RewardFunctionError", "Trainer", "build_model_and_tokenizer", "check_output_dir"]


def check_output_dir(path: str | Path) -> None:
    """Refuse an `output_dir` that cannot be a folder (a file, or a path under one), before any work is spent."""
    folder = Path(path)
    for p in (folder, *folder.parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(
                    f"output_dir {folder}: {p} is a file, not a folder; give a folder (a new one, or a run's to resume)"
                )
            return


class Trainer:
    """Runs `TrainConfig`: `train()` for the whole run (resuming from the latest checkpoint).

    `reward_funcs`: callables `(prompts, completions, **kwargs) -> list[float]` (TRL's signature) to use
    instead of the config's. `rollout_func`: a rollout hook (`longstraw.train.rollout.RolloutStage`) instead of
    the config's `rollout_func` import path. `model`, `tokenizer`, `peft_config`: a model object (its folder in
    `cfg.model`, which a resumed run's export and an FSDP export rebuild it from), its tokenizer and a PEFT config,
    instead of the config's model and `lora_*` fields; `rows`, `eval_rows`: parsed examples instead of the config's
    `dataset`, `eval_dataset` (`longstraw.train.build.build_model_and_tokenizer`, `longstraw.train.data.build_data`;
    the TRL-shaped `longstraw.train.trl_shape.GRPOTrainer` passes them).
    """

    #: keyword arguments of the command line's evaluation table (`before`, `counts`), set by
    #: `longstraw.commands.training.run_training`
    eval_summary: dict

    def __init__(
        self,
        cfg: TrainConfig,
        reward_funcs=None,
        rollout_func=None,
        *,
        model=None,
        tokenizer=None,
        peft_config=None,
        rows: list[Example] | None = None,
        eval_rows: list[Example] | None = None,
        dropped: list[str] | None = None,
        data_source: str | None = None,
    ):
        self.cfg = cfg
        self.peft_config = peft_config
        check_output_dir(cfg.output_dir)
        # one process, or a rank of a process group (the default group, or one started from torchrun's environment)
        self.ranks = setup_ranks(cfg.dist_timeout, resolve_device(cfg.device))
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        elif self.ranks.size > 1 and resolve_device(cfg.device).type == "cpu":
            torch.set_num_threads(1)
        self.model, self.tok = build_model_and_tokenizer(cfg, model, tokenizer, peft_config)
        #: how the run is spread over its processes (`longstraw.distributed.parallelize`): rank 0's weights on every
        #: rank, context-parallel groups, spread experts, sharded layers
        self.parallel = parallelize(
            self.model,
            self.ranks,
            context_parallel=cfg.context_parallel,
            expert_parallel=cfg.expert_parallel,
            fsdp=cfg.fsdp,
            timeout_s=cfg.dist_timeout,
        )
        if self.parallel.groups.count > 1 and cfg.rollout_backend == "vllm":
            raise ValueError(
                f"context_parallel: {cfg.context_parallel} of {self.ranks.size} processes with rollout_backend: vllm: "
                "the server's rows are not handed to several groups yet; use context_parallel: 0 (one group of all "
                "ranks)"
            )
        if cfg.replay_order == "layers" and self.ranks.size > 1:
            raise ValueError(
                f"replay_order: layers on {self.ranks.size} processes: layer-major replay runs in one process; "
                "use replay_order: segments (segmented replay runs on N processes)"
            )
        hook = rollout_func is not None or bool(cfg.rollout_func) or bool(cfg.environment)
        dataset_run = rows is not None or cfg.dataset is not None
        rewards = reward_set(cfg, None, reward_funcs) if dataset_run else None
        self._cache: TokenCache | None = None
        #: what the start found in the dataset's rows (None: a built-in task), printed by rank 0
        self.row_report: RowReport | None = None
        #: what `config.yaml` records beside the config fields (`longstraw.train.run_record`)
        self.record: dict[str, Any] = {
            "data": {"source": f"the built-in task {cfg.task}"},
            "reward_funcs": [describe_reward(e) for e in (reward_funcs or cfg.reward_funcs or [])],
            "model": {"source": cfg.model, "sha256": model_fingerprint(cfg.model)},
        }
        self._source = data_source or cfg.dataset or IN_MEMORY[1]
        self._custom_rewards = bool(reward_funcs)

        def check(train: list[Example], held: list[Example] | None, dropped_early: list[str]):
            return self._check_rows(train, held, dropped_early, None if hook or rewards is None else rewards, hook)

        self.data = build_data(cfg, self.tok, rows, eval_rows, check=check, dropped=dropped)
        self.rewards = rewards if rewards is not None else reward_set(cfg, self.data.task, reward_funcs)
        if not self.record["reward_funcs"]:  # the task's own, or exact_match
            self.record["reward_funcs"] = list(self.rewards.names)
        if rollout_func is None and cfg.rollout_func:
            rollout_func = resolve_callable(cfg.rollout_func, "rollout_func")
        if rollout_func is None and cfg.environment:
            kw = {"parse": resolve_callable(cfg.tool_parser, "tool_parser")} if cfg.tool_parser else {}
            rollout_func = EnvironmentRollout(
                resolve_callable(cfg.environment, "environment"),
                AgentSettings(cfg.max_turns, cfg.max_turn_tokens, cfg.max_tool_tokens),
                **kw,
            )
        self.loss_fn = make_loss(
            cfg.loss_type,
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            beta=cfg.beta,
            importance_sampling_level=cfg.importance_sampling_level,
            use_bias_correction_kl=cfg.use_bias_correction_kl,
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if any(p.dtype == torch.float16 for p in self.params):  # `dtype: auto` on a GPU without bf16
            raise ValueError(
                "trainable fp16 weights (full fine-tuning, or train_embeddings with LoRA) would need loss "
                "scaling, which the trainer does not do: use dtype bf16 or fp32, or a LoRA adapter"
            )
        # what the optimizer steps on: the float32 parameters themselves, float32 masters of the bf16 ones
        self.masters = MasterWeights(self.params)
        if any(self.parallel.is_spread(p) for p, _ in self.masters.pairs):
            raise ValueError(
                "expert_parallel with trainable bf16 experts (full fine-tuning in bf16): their float32 master copies "
                "are not checkpointed per rank yet; use dtype fp32, or a LoRA adapter"
            )
        self.opt = torch.optim.AdamW(
            self.masters.params, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.out = Path(cfg.output_dir)
        #: the run's checkpoints and final model (`longstraw.train.run_checkpoints`)
        self.checkpoints = RunCheckpoints(
            cfg, self.out, self.model, self.tok, self.opt, self.sched, self.masters, self.parallel, peft_config
        )
        self.step = 0
        self._rollout: tuple[int, Any] | None = None  # (generation, Rollout) reused by its `num_iterations` steps
        self.eos = self.tok.eos_token_id
        allowed = None
        if cfg.restrict_to_answer_tokens and self.data.task is not None:
            ids = self.tok.convert_tokens_to_ids(self.data.task.answer_words())
            allowed = sorted(set(ids) | {self.eos})
        self.policy = Policy(self.model, self.tok, self.eos, allowed, self._token_cache())
        #: held-out evaluation of the policy (`evaluate`)
        self.evaluation = Evaluation(cfg, self.policy, self.data, self.rewards, self.ranks)
        device = next(self.model.parameters()).device
        if cfg.recapture_every > 1 and self.ranks.size > 1:
            raise ValueError(
                f"recapture_every: {cfg.recapture_every} on {self.ranks.size} processes: kept prompt states are "
                "one process's for now; set recapture_every: 1, or train in one process"
            )
        #: prompt states kept across steps (`recapture_every`)
        self.store = None
        if cfg.recapture_every > 1:
            probe = None
            if cfg.recapture_drift is not None:
                model = self.model
                probe = lambda state, prefix: kv_drift_probe(model, state, prefix)  # noqa: E731
            self.store = StateStore(cfg.recapture_every, cfg.recapture_drift, probe)
        self.rollout_stage = RolloutStage(
            self.policy,
            self.rewards,
            SamplingSettings.from_config(cfg),
            lambda step, b: generator(cfg.seed, step, b, device=device),
            chunk_size=cfg.chunk_size,
            prompt_grad=cfg.prompt_grad,
            state_dtype=cfg.state_dtype,
            beta=cfg.beta,
            scale_rewards=cfg.scale_rewards,
            rollout_func=rollout_func,
            share=self.parallel.step_share(self.model),
            share_prefixes=cfg.share_prefixes,
            min_shared_prefix=cfg.min_shared_prefix,
            max_row_suffix=cfg.max_row_suffix,
            store=self.store,
            vllm=self._vllm_client(),
            progress=cfg.progress and self.ranks.main,
        )
        settings = UpdateSettings.from_config(cfg)
        # the replay order, chosen once for the run (`longstraw.replay.order`): at most a step's responses together
        # (the rows of one document share their batches)
        most = cfg.num_generations * cfg.prompts_per_step
        order = settings.choose(self.model, most, self.parallel.step_share(self.model))
        self.update_settings = dataclasses.replace(settings, order=order)
        self.record["replay_order"] = order.name
        self.meter = MemoryMeter(next(self.model.parameters()).device)
        #: seconds of this step's adapter sync to vLLM (None: no sync this step)
        self.sync_seconds: float | None = None

    def _vllm_client(self):
        """`rollout_backend: vllm`: the client of `vllm_url`, or of a server started here on the model
        (`vllm_server.serve_policy`, stopped by `close`); None with the own sampler."""
        self.vllm_server = None
        if self.cfg.rollout_backend != "vllm":
            return None

        def url() -> str:
            if self.cfg.vllm_url is not None:
                return self.cfg.vllm_url
            self.vllm_server = vllm_server.serve_policy(self.cfg, self.model, self.tok, self.out)
            return self.vllm_server.url

        # on N processes rank 0 alone talks to the server (it samples every row and hands the rows to the others)
        client = VLLMClient(self.ranks.from_main("vLLM: the server's URL", url), timeout_s=self.cfg.vllm_timeout_s)
        if self.ranks.main:
            client.health()
        return client

    def close(self) -> None:
        """Stop what the trainer started (a vLLM server); idempotent."""
        server = getattr(self, "vllm_server", None)
        if server is not None:
            server.stop()

    # ------------------------------------------------------------------ pieces
    @property
    def allowed(self) -> list[int] | None:
        return self.policy.allowed_token_ids

    def encode(self, text: str) -> torch.Tensor:
        return self.policy.encode(text)

    def evaluate(self, lengths=None, n: int | None = None, samples: list | None = None) -> dict:
        """Greedy accuracy on held-out examples per prompt length (`Evaluation.evaluate`; on N ranks a collective)."""
        return self.evaluation.evaluate(lengths, n, samples)

    def score_examples(self, examples: list[Example], bar=None) -> list[dict]:
        """The current model's greedy completion of each example and its weighted reward
        (`Evaluation.score_examples`)."""
        return self.evaluation.score_examples(examples, bar)

    def baselines(self) -> dict:
        """Accuracies without real retrieval, where they apply (`Evaluation.baselines`)."""
        return self.evaluation.baselines()

    def examples(self, step: int, sft: bool = False) -> list[Example]:
        length = self.cfg.stage_length(step)
        return [
            self.data.example(step * self.cfg.prompts_per_step + b, length, sft=sft)
            for b in range(self.cfg.prompts_per_step)
        ]

    # ------------------------------------------------------------------ steps
    def generation(self, step: int) -> int:
        """The rollout batch GRPO step `step` trains on: with `num_iterations` μ (TRL's), μ optimizer steps share one
        (the first of them draws it); the step itself when μ = 1."""
        warm = self.cfg.sft_warmup_steps
        return warm + (step - warm) // self.cfg.num_iterations

    def rollout(self, step: int):
        """The rollout of GRPO step `step` (`longstraw.train.rollout.Rollout`): drawn for its `generation`, and kept
        for the following steps of the same generation (`num_iterations`), which replay it against the moved policy
        with its sampling-time old log-probs (the prompt states captured again: the weights changed)."""
        g = self.generation(step)
        cached = self._rollout
        if cached is not None and cached[0] == g:
            return cached[1]
        self._rollout = None
        client = self.rollout_stage.vllm
        if client is not None:  # vLLM samples with the policy as it is now (rank 0 syncs it)
            with self.meter.stage("sync"):
                state = None
                if self.parallel.sharded:  # every rank: the sharded layers gathered whole, rank 0 keeps them
                    named = self.checkpoints.trainable() if self.cfg.lora else list(self.model.state_dict().items())
                    state = full_tensors(named, keep=self.ranks.main)
                if self.ranks.main:
                    self.sync_seconds = client.sync(self.model, self.out / "vllm-weights", g, state)
        r = self.rollout_stage.collect(self.examples(g), g, self.meter)
        if self.cfg.num_iterations > 1:
            self._rollout = (g, r)
        return r

    def update(self, rollout) -> dict:
        """Accumulate the gradient of `rollout`'s GRPO loss (no optimizer step)."""
        return policy_update(
            self.model,
            rollout,
            self.loss_fn,
            self.update_settings,
            self.meter,
            self.parallel.step_share(self.model),
            store=self.store,
        )

    def grpo_step(self, step: int) -> dict:
        store = self.store
        if store is not None:
            store.begin(step)
            before = store.captures, store.reuses
        self.sync_seconds = None
        r = self.rollout(step)
        m = dict(phase="grpo", **self.update(r))
        if self.sync_seconds is not None:
            m["vllm/sync_s"] = self.sync_seconds
        if store is not None:
            store.end()
            m.update(state_captures=store.captures - before[0], state_reuses=store.reuses - before[1])
            if store.bound is not None and store.last_drift is not None:
                m["state_drift"] = store.last_drift
        m.update(
            completion_length=sum(x.tokens.numel() for x in r.responses) / len(r.responses),
            truncated_frac=sum(x.truncated for x in r.responses) / len(r.responses),
            reward=float(r.rewards.mean()),
            reward_std=float(r.rewards.std()) if r.rewards.numel() > 1 else 0.0,
            durable_bytes=r.durable_bytes,
            tokens=r.tokens,
            contexts=len(r.contexts),
            prompt_shared_frac=r.shared_frac,
            **prompt_length_metrics([g.prompt_ids.numel() for g in r.groups]),
        )
        for key in ("turns", "tool_calls", "tool_failures"):  # multi-turn rollouts (`environment`): per trajectory
            values = [x.extra[key] for x in r.responses if key in x.extra]
            if values:
                m[f"agent/{key}"] = sum(values) / len(values)
        # TRL's `frac_reward_zero_std`: the share of groups whose rewards are all equal, whose advantages are all 0
        grouped = r.rewards.view(-1, self.cfg.num_generations)
        m["frac_reward_zero_std"] = float(torch.isclose(grouped.std(dim=1), torch.zeros(())).float().mean())
        if r.per_function.isnan().all():
            warnings.warn(
                f"step {step + 1}: every reward function returned None for all {r.per_function.shape[0]} completions: "
                "the step trains on zero advantage; check the columns the reward functions read",
                stacklevel=2,
            )
        for f, name in enumerate(self.rewards.names):
            col = r.per_function[:, f]
            m[f"rewards/{name}/mean"] = float(col.nanmean())
            m[f"rewards/{name}/std"] = float(col[~col.isnan()].std()) if (~col.isnan()).sum() > 1 else 0.0
        # decoded only where they are written or printed (rank 0, log_completions / num_completions_to_print)
        wanted = self.ranks.main and (self.cfg.log_completions or self.cfg.num_completions_to_print)
        self.completions = self._completion_rows(r, step + 1) if wanted else []
        return m

    #: tokens of the prompt's end shown beside each completion
    PROMPT_TAIL = 48

    def _completion_rows(self, r, step: int) -> list[dict]:
        """What the model wrote at GRPO step `step`: one row per completion (the prompt's last `PROMPT_TAIL` tokens,
        the completion, each reward function's value, the weighted reward and the advantage)."""
        decode = self.policy.tokenizer.decode
        rows = []
        for i, (gi, resp) in enumerate(zip(r.group_ids, r.responses)):
            g = r.groups[gi]
            rows.append(
                dict(
                    step=step,
                    group=gi,
                    prompt_tokens=g.prompt_ids.numel(),
                    prompt_tail=decode(g.prompt_ids[-self.PROMPT_TAIL :].tolist(), skip_special_tokens=False),
                    completion=decode(resp.tokens.tolist(), skip_special_tokens=False),
                    truncated=bool(resp.truncated),
                    **({"agent": resp.extra} if resp.extra else {}),
                    rewards={name: float(r.per_function[i, f]) for f, name in enumerate(self.rewards.names)},
                    reward=float(r.rewards[i]),
                    advantage=float(r.advantages[i]),
                )
            )
        return rows

    def sft_step(self, step: int) -> dict:
        m = sft_update(
            self.policy,
            self.examples(step, sft=True),
            self.update_settings,
            self.cfg.sft_full_sequence,
            self.meter,
            self.parallel.step_share(self.model, context=self.ranks),
        )
        return dict(phase="sft", **m)

    def train_step(self, step: int) -> dict:
        """One optimizer step (supervised during warm-up); a non-finite loss or gradient skips the update."""
        self.meter.start_step()
        self.opt.zero_grad(set_to_none=True)
        self.parallel.begin_step(self.model)
        m = self.sft_step(step) if step < self.cfg.sft_warmup_steps else self.grpo_step(step)
        if self.ranks.size > 1:
            with self.meter.stage("all_reduce"):  # the gradients of every rank's replays, summed: once per step
                # (where the gradients are: the float32 parameters, float32 masters of bf16 ones)
                self.parallel.reduce_gradients(self.masters.params)
            m["world_size"] = self.ranks.size
        if self.parallel.experts is not None:
            m.update(self.parallel.experts.load_metrics())
        with self.meter.stage("optimizer"):
            self._optimizer_step(m)
        m.update(self.meter.results())
        m["time_step"] = sum(v for k, v in m.items() if k.startswith("time_") and k != "time_step")
        m["tokens_per_s"] = m["tokens"] / max(m["time_step"], 1e-9)
        m["step"] = step + 1
        # the built-in task's curriculum length; the prompts' real token counts are `prompt_length` (sft_update,
        # grpo_step)
        m["stage_length"] = self.cfg.stage_length(step)
        return m

    def _optimizer_step(self, m: dict) -> None:
        params = self.masters.params  # where the gradients are (float32)
        # partitioned weights: one norm over every rank's shards, experts and replicated gradients, one verdict
        norm = self.parallel.clip_grad_norm(params, self.cfg.max_grad_norm)
        if norm is not None:
            grads_ok = math.isfinite(norm)
        else:
            grads_ok = all(p.grad is None or torch.isfinite(p.grad).all() for p in params)
        m["lr"] = self.sched.get_last_lr()[0]
        if not math.isfinite(m["loss"]) or not grads_ok:
            self.opt.zero_grad(set_to_none=True)
            m["skipped"] = "non-finite loss or gradient: update skipped"
            m["grad_norm"] = float("nan")
            self.opt.step()  # no gradients: a no-op that keeps the scheduler's step count in order
        else:
            if self.cfg.max_grad_norm > 0:
                m["grad_norm"] = (
                    norm if norm is not None else float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
                )
            self.opt.step()
            self.masters.copy_to_model()
        self.sched.step()

    # ------------------------------------------------------------------ checkpoints and outputs
    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0; `RunCheckpoints.save`)."""
        return self.checkpoints.save(self.step)

    def has_checkpoint(self) -> bool:
        """Whether the output folder holds a checkpoint to resume from."""
        return self.checkpoints.exists()

    def load_checkpoint(self) -> bool:
        """Resume from the latest checkpoint if there is one; returns whether it did (`RunCheckpoints.load`)."""
        step = self.checkpoints.load()
        if step is None:
            return False
        self.step = step
        return True

    def export(self) -> dict[str, Path]:
        """The final model folders (`RunCheckpoints.export`)."""
        return self.checkpoints.export(self.step)

    def _token_cache(self) -> TokenCache | None:
        """The dataset's prompts tokenized once (`token_cache`; None for a built-in task, whose prompts are drawn),
        built by the row check (`_check_rows`)."""
        return self._cache

    def _check_rows(
        self, rows: list[Example], eval_rows: list[Example] | None, dropped: list[str], rewards, hook: bool
    ) -> tuple[list[Example], list[Example] | None]:
        """Every row tokenized once (into the token cache, when the run has one) and checked before step 1
        (`longstraw.train.row_check`); rank 0 prints what it found. `dropped`: rows dropped while they were read."""
        cfg = self.cfg
        if cfg.token_cache is not None:
            folder = cache_dir("tokens") if cfg.token_cache == "auto" else Path(cfg.token_cache)
            texts = [ex.prompt for ex in [*rows, *(eval_rows or [])] if ex.prompt]
            self._cache = TokenCache(folder, self.tok, texts, progress=cfg.progress and self.ranks.main)
        cache = self._cache

        def encode(text: str) -> torch.Tensor:
            ids = cache.ids(text) if cache is not None else None
            return ids if ids is not None else torch.tensor(self.tok(text, add_special_tokens=False)["input_ids"])

        # a rollout hook's trajectories stop at the positions: its prompt needs one position left
        completion = 1 if hook else cfg.max_completion_length
        funcs = None if rewards is None else rewards.funcs
        unk = getattr(self.tok, "unk_token_id", None)
        rules = RowRules(position_limit(self.model.config), completion, funcs, cfg.drop_invalid_rows, unk)
        kept, held, report = check_rows(rows, eval_rows, encode, rules, cfg.min_shared_prefix)
        report.dropped = [*dropped, *report.dropped]
        self.row_report = report
        self.record["data"] = data_record(self._source, rows)
        if eval_rows is not None and eval_rows is not rows:
            self.record["eval_data"] = data_record(cfg.eval_dataset or self._source, eval_rows)
        median = statistics.median(report.lengths)
        self.record["prompt_tokens"] = {
            "min": min(report.lengths),
            "median": int(median) if median == int(median) else float(median),
            "max": max(report.lengths),
        }
        if self.ranks.main:
            print("\n".join(report.lines()), flush=True)
        return kept, held

    # ------------------------------------------------------------------ the run
    def train(self, on_step=None) -> list[dict]:
        """Run (or resume) to `num_steps`, then export the model. Returns this call's metrics (every rank's list
        holds the same values; rank 0 alone writes files). `on_step(metrics)`, after each step (and its checkpoint):
        True stops the run there, its model exported."""
        self.out.mkdir(parents=True, exist_ok=True)
        resumed = self.load_checkpoint()
        done: list[dict] = []
        if resumed and not self._resume_checked():
            self.close()
            return done
        writer_cm = MetricsWriter(self.out, self.step if resumed else 0, self.cfg) if self.ranks.main else _NoWriter()
        try:
            self._run(writer_cm, done, on_step)
        finally:
            self.close()
        return done

    def _run(self, writer_cm, done: list, on_step) -> None:
        with writer_cm as writer:
            while self.step < self.cfg.num_steps:
                m = self.train_step(self.step)
                if not done:  # written once a step ran: a config that fails at its first step leaves the record
                    self._write_config()
                self.step += 1
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.num_steps:
                    m["eval"] = self.evaluate()
                writer.write(m)
                if m["phase"] == "grpo":
                    writer.write_completions(m["step"], self.completions)
                # checkpoints fall between rollout batches (`num_iterations`): a resumed run draws its next batch
                boundary = self.step <= self.cfg.sft_warmup_steps or self.generation(self.step) != self.generation(
                    self.step - 1
                )
                if (self.step % self.cfg.save_every == 0 and boundary) or self.step == self.cfg.num_steps:
                    if self.store is not None:
                        self.store.clear()  # states are not saved: a resumed run captures afresh, as this one now
                    self.save_checkpoint()
                done.append(m)
                if on_step is not None and on_step(m):  # True: stop after this step (a callback's request)
                    break
        if self.store is not None:
            self.store.clear()
        if self.ranks.main:
            self.export()

    def _resume_checked(self) -> bool:
        """After loading a checkpoint: refuse a run that is not the recorded one (its data, model or
        `model_overrides` changed) unless `force_resume`, and a schedule that ended; False when the run is finished
        (nothing to train). The learning rate is set from the schedule at the resumed step (the checkpoint's is the
        last step's, 0.0 at the end of a decayed schedule)."""
        path = self.out / "config.yaml"
        # rank 0's record, on every rank: all ranks decide alike (another node may not see rank 0's files)
        old = self.ranks.from_main(
            "resume: the run's record", lambda: (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
        )
        record, cfg = old.get("record") or {}, self.cfg
        problem = resume_problem(record, self.record, old.get("model_overrides"), cfg.model_overrides)
        if problem is not None and not cfg.force_resume:
            raise ValueError(
                f"resume: {self.out} is another run: {problem}; give a new output_dir, or pass --force-resume "
                "(force_resume: true) to resume it anyway"
            )
        if self.step >= cfg.num_steps:
            if self.ranks.main:
                print(
                    f"{self.out}: finished at step {self.step} of num_steps {cfg.num_steps}: nothing to train; raise "
                    "num_steps (max_steps) to train further",
                    flush=True,
                )
            return False
        if old and schedule_over(old, self.step) and not cfg.force_resume:
            raise ValueError(
                f"resume: {self.out} finished its {old['lr_scheduler']} schedule at step {old['num_steps']} (learning "
                f"rate 0.0); to train on to num_steps {cfg.num_steps} from its model start a new run, or pass "
                f"--force-resume (force_resume: true) to follow the schedule of num_steps {cfg.num_steps}"
            )
        # the schedule of this config at the resumed step (the same as the checkpoint's when the config is the same)
        lrs = [base * f(self.sched.last_epoch) for base, f in zip(self.sched.base_lrs, self.sched.lr_lambdas)]
        for group, lr in zip(self.opt.param_groups, lrs):
            group["lr"] = lr
        self.sched._last_lr = lrs  # what get_last_lr() reports
        return True

    def _write_config(self) -> None:
        """`config.yaml`: the config of the run and its record (`longstraw.train.run_record`; rank 0)."""
        if self.ranks.main:
            values = self.cfg.to_dict()
            values["force_resume"] = False  # a setting of one resume, not of the run
            if self._custom_rewards:  # callables: their import paths, when every one has one
                names = self.record["reward_funcs"]
                values["reward_funcs"] = names if all(importable(n) for n in names) else []
            values["record"] = self.record
            tmp = self.out / ".config.yaml.tmp"
            tmp.write_text(yaml.safe_dump(values, sort_keys=False))
            os.replace(tmp, self.out / "config.yaml")


class _NoWriter:
    """The metrics sink of ranks other than 0."""

    def __enter__(self):
        return self

    def write(self, m: dict) -> None:
        pass

    def write_completions(self, step: int, rows: list[dict]) -> None:
        pass

    def __exit__(self, *exc) -> None:
        pass
