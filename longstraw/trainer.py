"""The GRPO trainer: capture → sample G → reward → advantages → serial replay with backward → one step.

Per optimizer step, for each of its prompts:
1. capture the prompt's durable state (`longstraw.capture`);
2. sample G responses from that one state (`state.sample`), their log-probs being the "old" ones;
3. score them with the reward functions (TRL signature) and, with `beta > 0`, fix the reference
   log-probs (adapters disabled, a second capture);
Then advantages (per group) and the loss normalizer (whole batch) are computed, and each response
is replayed with autograd and back-propagated on its own; exactly one optimizer step follows. With
one prompt per step its state is reused for the replays; with several, each state is released before
the next prompt is captured and recaptured for its replays (memory of one state at a time).

The first `sft_warmup_steps` steps are supervised (cross-entropy of the answer tokens, same
capture/replay machinery). Data and sampling are drawn from (seed, step), so a resumed run repeats
exactly what an uninterrupted one does. Checkpoints are written atomically; an interrupted step
leaves the last checkpoint intact.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import capture
from .config import TrainConfig
from .losses import combine_rewards, group_advantages, make_loss
from .memory import peak_rss_mb, reset_peak, rss_mb
from .logprobs import chunked_logprobs
from .models import TINY_CONFIGS, model_parts, tiny_config
from .tasks import REWARD_FUNCTIONS, TASKS, Example, build_tokenizer, load_jsonl

EVAL_SEED_OFFSET = 1_000_000
#: `evaluate()` key of the accuracy on held-out JSONL rows
HELD_OUT_KEY = "held-out rows"


class RewardFunctionError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- setup


def build_model_and_tokenizer(cfg: TrainConfig):
    """(model, tokenizer): a built-in tiny model with the task tokenizer, or a local folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.model in TINY_CONFIGS:
        opts = cfg.task_options
        tok = build_tokenizer(num_keys=opts.get("num_keys", 64), num_values=opts.get("num_values", 16),
                              num_filler=opts.get("num_filler", 32))
        mcfg = tiny_config(cfg.model, **{**cfg.model_overrides, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                                         "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id})
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)
    else:
        path = Path(cfg.model)
        if not path.is_dir():
            raise ValueError(f"model {cfg.model!r} is neither a built-in tiny architecture {sorted(TINY_CONFIGS)} "
                             "nor a local folder")
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if tok.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: responses could never stop")
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        extra = ["embed_tokens", "lm_head"] if cfg.train_embeddings else None
        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                 target_modules=cfg.lora_target_modules, modules_to_save=extra))
    return model.train(), tok


@dataclass
class Data:
    """Where examples come from: a built-in task (made from (seed, index, length); evaluation draws its own
    indices) or JSONL rows, training and held-out (`eval_rows`) apart."""

    task: object | None
    rows: list[Example] | None
    seed: int
    eval_rows: list[Example] | None = None

    def example(self, index: int, length: int, sft: bool = False) -> Example:
        if self.rows is not None:
            return self.rows[index % len(self.rows)]
        if sft:
            return self.task.sft_example(self.seed, index, length)
        return self.task.example(self.seed, index, length)


def split_rows(rows: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(training rows, held-out rows): ceil(fraction · n) rows chosen by `seed`, the rest in their file order."""
    if fraction == 0:
        return rows, rows
    n_eval = math.ceil(fraction * len(rows))
    if n_eval >= len(rows):
        raise ValueError(f"the dataset has {len(rows)} row(s): too few to hold out eval_fraction={fraction}; "
                         "give an eval_dataset or set eval_fraction: 0")
    held = set(random.Random(seed).sample(range(len(rows)), n_eval))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def build_data(cfg: TrainConfig) -> Data:
    if cfg.dataset is not None:
        rows = load_jsonl(cfg.dataset)
        if cfg.eval_dataset is not None:
            return Data(None, rows, cfg.seed, load_jsonl(cfg.eval_dataset))
        train, held = split_rows(rows, cfg.eval_fraction, cfg.seed)
        return Data(None, train, cfg.seed, held)
    task = TASKS[cfg.task](**cfg.task_options)
    for length in [cfg.prompt_length, *cfg.curriculum, *cfg.eval_lengths]:
        if int(length) < task.min_length():
            raise ValueError(f"prompt length {length} is shorter than {cfg.task} needs ({task.min_length()} tokens)")
    return Data(task, None, cfg.seed)


def reward_functions(cfg: TrainConfig, data: Data, custom=None):
    """[(name, fn)] and weights: `custom` callables (TRL signature) if given, else the config's names,
    else the task's own reward."""
    if custom:
        funcs = [(getattr(f, "__name__", f"reward_{i}"), f) for i, f in enumerate(custom)]
    else:
        names = cfg.reward_funcs or [data.task.reward if data.task is not None else "exact_match"]
        funcs = [(n, REWARD_FUNCTIONS[n]) for n in names]
    weights = cfg.reward_weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"{len(weights)} reward_weights for {len(funcs)} reward functions")
    return funcs, weights


def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(cfg.num_steps - cfg.warmup_steps, 1)
        return max(0.0, 1 - progress) if cfg.lr_scheduler == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _generator(seed: int, *parts: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + hash(parts)) % (2**63))
    return g


# ---------------------------------------------------------------------------------------------- trainer


class Trainer:
    """Runs `TrainConfig`: `train()` for the whole run (resuming from the latest checkpoint).

    `reward_funcs`: callables `(prompts, completions, **kwargs) -> list[float]` (TRL's signature; the
    data's `answer` column comes as a keyword) to use instead of the config's named ones.
    """

    def __init__(self, cfg: TrainConfig, reward_funcs=None):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.data = build_data(cfg)
        self.model, self.tok = build_model_and_tokenizer(cfg)
        self._parts = model_parts(self.model)
        self.rewards, self.reward_weights = reward_functions(cfg, self.data, reward_funcs)
        self.loss_fn = make_loss(cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                 importance_sampling_level=cfg.importance_sampling_level,
                                 use_bias_correction_kl=cfg.use_bias_correction_kl)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas),
                                     weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(cfg))
        self.out = Path(cfg.output_dir)
        self.step = 0
        self.eos = self.tok.eos_token_id
        self.allowed = None
        if cfg.restrict_to_answer_tokens and self.data.task is not None:
            ids = self.tok.convert_tokens_to_ids(self.data.task.answer_words())
            self.allowed = sorted(set(ids) | {self.eos})

    # ------------------------------------------------------------------ pieces
    def encode(self, text: str) -> torch.Tensor:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"prompt {text[:60]!r} encodes to no tokens")
        return torch.tensor(ids, dtype=torch.long)

    def answer_ids(self, answer: str) -> torch.Tensor:
        return torch.cat([self.encode(answer), torch.tensor([self.eos])])

    def score(self, prompts, completions, answers) -> torch.Tensor:
        """`[N, F]` rewards of the F reward functions; an exception names its function."""
        cols = []
        for name, fn in self.rewards:
            try:
                r = fn(prompts=prompts, completions=completions, answer=answers)
            except Exception as e:  # noqa: BLE001 - re-raised with the function named
                raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
            if len(r) != len(completions):
                raise RewardFunctionError(f"reward function {name!r} returned {len(r)} rewards for "
                                          f"{len(completions)} completions")
            cols.append(torch.tensor([float("nan") if x is None else float(x) for x in r]))
        return torch.stack(cols, dim=1)

    def examples(self, step: int, sft: bool = False) -> list[Example]:
        length = self.cfg.stage_length(step)
        return [self.data.example(step * self.cfg.prompts_per_step + b, length, sft=sft)
                for b in range(self.cfg.prompts_per_step)]

    # ------------------------------------------------------------------ steps
    def sft_step(self, step: int) -> dict:
        """Supervised: − mean log-prob of the answer tokens (and the stop token) over the step's prompts.

        `sft_full_sequence` (default): ordinary forwards of [prompt + answer] with grad, so the prompt
        positions learn too (what retrieval needs from a random start); examples of equal length go
        in one batch. Otherwise each prompt is captured and its answer replayed (detached, like GRPO).
        """
        t0, cap_t, rep_t = time.perf_counter(), 0.0, 0.0
        exs = self.examples(step, sft=True)
        pairs = [(self.encode(ex.prompt), self.answer_ids(ex.answer)) for ex in exs]
        n_tok = sum(a.numel() + len(ex.supervised) for (_, a), ex in zip(pairs, exs))
        tokens = sum(p.numel() + a.numel() for p, a in pairs)
        loss_total, durable = 0.0, 0
        if self.cfg.sft_full_sequence:
            by_shape: dict[tuple[int, int, int], list] = {}
            for (p, a), ex in zip(pairs, exs):
                by_shape.setdefault((p.numel(), a.numel(), len(ex.supervised)), []).append((p, a, ex.supervised))
            for (plen, alen, nsup), group in by_shape.items():
                t = time.perf_counter()
                seqs = torch.stack([torch.cat([p, a]) for p, a, _ in group])
                # positions whose token is a target: the supervised prompt positions, then the answer
                pos = torch.tensor([list(sup) + list(range(plen, plen + alen)) for _, _, sup in group])
                targets = seqs.gather(1, pos)
                hidden = self._parts.decoder(input_ids=seqs).last_hidden_state
                hidden = hidden.gather(1, (pos - 1)[..., None].expand(-1, -1, hidden.shape[-1]))
                lp, _ = chunked_logprobs(hidden.reshape(-1, hidden.shape[-1]), self._parts.lm_head, targets.reshape(-1),
                                         softcap=self._parts.final_logit_softcapping)
                loss = -lp.sum() / n_tok
                loss.backward()
                loss_total += loss.item()
                rep_t += time.perf_counter() - t
        else:
            for prompt, ans in pairs:
                t = time.perf_counter()
                with capture(self.model, prompt, chunk_size=self.cfg.chunk_size) as state:
                    cap_t += time.perf_counter() - t
                    durable = max(durable, state.nbytes)
                    t = time.perf_counter()
                    loss = -state.replay(ans).logprobs.sum() / n_tok
                    loss.backward()
                    rep_t += time.perf_counter() - t
                loss_total += loss.item()
        return dict(phase="sft", loss=loss_total, time_capture=cap_t, time_sample=0.0, time_replay=rep_t,
                    durable_bytes=durable, tokens=tokens, time_step=time.perf_counter() - t0)

    def grpo_step(self, step: int) -> dict:
        cfg, G = self.cfg, self.cfg.num_generations
        t0 = time.perf_counter()
        times = dict(time_capture=0.0, time_sample=0.0, time_replay=0.0)
        groups, durable, tokens = [], 0, 0
        keep_state = cfg.prompts_per_step == 1
        for b, ex in enumerate(self.examples(step)):
            prompt = self.encode(ex.prompt)
            t = time.perf_counter()
            mode = cfg.prompt_grad if keep_state else "detached"  # a state only sampled from needs no grad
            state = capture(self.model, prompt, chunk_size=cfg.chunk_size, prompt_grad=mode)
            times["time_capture"] += time.perf_counter() - t
            durable = max(durable, state.nbytes)
            t = time.perf_counter()
            s = state.sample(G, cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                             top_k=cfg.top_k, stop_token_ids=[] if cfg.ignore_eos else [self.eos],
                             generator=_generator(cfg.seed, step, b),
                             allowed_token_ids=self.allowed)
            times["time_sample"] += time.perf_counter() - t
            texts = self.tok.batch_decode(s.tokens, skip_special_tokens=False)
            rewards = self.score([ex.prompt] * G, texts, [ex.answer] * G)
            ref = None
            if cfg.beta > 0:
                ref = self._reference_logprobs(prompt, s.tokens, times)
            if not keep_state:
                state.release()
                state = None
            groups.append(dict(prompt=prompt, samples=s, rewards=rewards, ref=ref, state=state))
            tokens += prompt.numel() + sum(x.numel() for x in s.tokens)
        per_f = torch.cat([g["rewards"] for g in groups])
        total = combine_rewards(per_f, self.reward_weights)
        adv = group_advantages(total, G, cfg.scale_rewards)
        lengths, masked, group_ids = [], [], []
        for gi, g in enumerate(groups):
            for tok, trunc in zip(g["samples"].tokens, g["samples"].truncated):
                m = bool(trunc) and cfg.mask_truncated_completions
                masked.append(m)
                lengths.append(0 if m else tok.numel())
                group_ids.append(gi)
        norm = self.loss_fn.normalizer(lengths, group_ids, cfg.max_completion_length)
        stats = dict(loss=0.0, kl=0.0, clipped=0.0, entropy=0.0, tokens=0)
        i = 0
        for g in groups:
            state = g["state"]
            t = time.perf_counter()
            if state is None:
                state = capture(self.model, g["prompt"], chunk_size=cfg.chunk_size, prompt_grad=cfg.prompt_grad)
                times["time_capture"] += time.perf_counter() - t
                t = time.perf_counter()
            for j, (tok, old) in enumerate(zip(g["samples"].tokens, g["samples"].logprobs)):
                out = state.replay(tok, temperature=cfg.temperature, checkpoint_layers=cfg.checkpoint_layers)
                mask = torch.zeros(tok.numel()) if masked[i] else None
                ref = None if g["ref"] is None else g["ref"][j]
                loss, st = self.loss_fn.response_loss(out.logprobs, old, adv[i], norm[i], ref_logps=ref, mask=mask)
                if cfg.entropy_coef > 0:
                    ent = out.entropy if mask is None else out.entropy * mask
                    loss = loss - cfg.entropy_coef * norm[i] * ent.sum()
                loss.backward()
                n = 0 if masked[i] else tok.numel()
                stats["loss"] += loss.item()
                stats["tokens"] += n
                stats["entropy"] += float(out.entropy.detach().sum()) if n else 0.0
                stats["clipped"] += float((st.low_clipped | st.high_clipped).sum()) if n else 0.0
                if st.kl is not None and n:
                    stats["kl"] += float(st.kl.sum())
                i += 1
            state.backward()  # exact mode: the prompt's share of the gradient (nothing when detached)
            state.release()
            times["time_replay"] += time.perf_counter() - t
        n = max(stats["tokens"], 1)
        m = dict(phase="grpo", loss=stats["loss"], entropy=stats["entropy"] / n, clip_ratio=stats["clipped"] / n,
                 completion_length=sum(x.numel() for g in groups for x in g["samples"].tokens) / (len(groups) * G),
                 truncated_frac=float(torch.cat([g["samples"].truncated for g in groups]).float().mean()),
                 reward=float(total.mean()), reward_std=float(total.std()) if total.numel() > 1 else 0.0,
                 durable_bytes=durable, tokens=tokens, time_step=time.perf_counter() - t0, **times)
        if cfg.beta > 0:
            m["kl"] = stats["kl"] / n
        for f, (name, _) in enumerate(self.rewards):
            col = per_f[:, f]
            m[f"rewards/{name}/mean"] = float(col.nanmean())
            m[f"rewards/{name}/std"] = float(col[~col.isnan()].std()) if (~col.isnan()).sum() > 1 else 0.0
        return m

    def _reference_logprobs(self, prompt, responses, times) -> list[torch.Tensor]:
        """Log-probs of the reference policy: the same model with its adapters disabled."""
        if not hasattr(self.model, "disable_adapter"):
            raise ValueError("beta > 0 needs a reference policy: train a LoRA adapter (lora: true)")
        t = time.perf_counter()
        with torch.no_grad(), self.model.disable_adapter():
            with capture(self.model, prompt, chunk_size=self.cfg.chunk_size) as ref_state:
                out = [ref_state.replay(r, temperature=self.cfg.temperature).logprobs for r in responses]
        times["time_capture"] += time.perf_counter() - t
        return out

    def train_step(self, step: int) -> dict:
        """One optimizer step (supervised during warm-up); a non-finite loss skips the update."""
        before = rss_mb()
        reset_peak()
        self.opt.zero_grad(set_to_none=True)
        m = self.sft_step(step) if step < self.cfg.sft_warmup_steps else self.grpo_step(step)
        grads_ok = all(p.grad is None or torch.isfinite(p.grad).all() for p in self.params)
        if not math.isfinite(m["loss"]) or not grads_ok:
            self.opt.zero_grad(set_to_none=True)
            m["skipped"] = "non-finite loss or gradient: update skipped"
            m["grad_norm"] = float("nan")
        else:
            if self.cfg.max_grad_norm > 0:
                m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
            self.opt.step()
        m["lr"] = self.sched.get_last_lr()[0]
        self.sched.step()
        m["step_mem_mb"] = round(peak_rss_mb() - before, 1)
        m["tokens_per_s"] = m["tokens"] / max(m["time_step"], 1e-9)
        m["step"] = step + 1
        m["prompt_length"] = self.cfg.stage_length(step)
        return m

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, lengths=None, n: int | None = None) -> dict:
        """Greedy accuracy (mean task reward) on held-out examples per prompt length (`{"64": ...}`); for JSONL
        data, on up to `n` held-out rows (`{"held-out rows": ...}`: their prompts have their own lengths)."""
        if self.data.task is None and self.data.rows is None:
            raise ValueError("nothing to evaluate")
        cfg = self.cfg
        lengths = [str(int(x)) for x in (lengths or cfg.eval_lengths or [cfg.prompt_length])]
        n = n or cfg.eval_examples
        held = self.data.eval_rows
        if held is not None:  # JSONL: each held-out row once
            n, lengths = min(n, len(held)), [HELD_OUT_KEY]
        was_training = self.model.training
        self.model.eval()
        result = {}
        for length in lengths:
            hits = 0.0
            for k in range(n):
                ex = held[k] if held is not None else self.data.example(EVAL_SEED_OFFSET + k, int(length))
                with capture(self.model, self.encode(ex.prompt), chunk_size=cfg.chunk_size) as state:
                    s = state.sample(1, cfg.max_completion_length, temperature=0, stop_token_ids=[self.eos],
                                     allowed_token_ids=self.allowed)
                text = self.tok.batch_decode(s.tokens, skip_special_tokens=False)
                hits += float(combine_rewards(self.score([ex.prompt], text, [ex.answer]), self.reward_weights)[0])
            result[length] = hits / n
        self.model.train(was_training)
        return result

    def baselines(self) -> dict:
        """Accuracies without real retrieval: context-blind 1/V and positional shortcut 1/K."""
        t = self.data.task
        if t is None:
            return {}
        return {"context_blind": 1 / t.num_values, "positional": 1 / t.num_pairs}

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Write checkpoint `step-N` atomically (temporary folder, then rename) and point `latest` at it."""
        root = self._ckpt_dir()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{self.step}"
        tmp = root / f".step-{self.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        self._save_weights(tmp / "weights")
        torch.save({"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({"step": self.step, "data_position": self.step *
                                                            self.cfg.prompts_per_step, "config": self.cfg.to_dict()}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _atomic_write(root / "latest", final.name)
        for old in sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _save_weights(self, path: Path) -> None:
        if hasattr(self.model, "peft_config"):
            self.model.save_pretrained(path)
        else:
            from safetensors.torch import save_file

            path.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, path / "model.safetensors")

    def load_checkpoint(self) -> bool:
        """Resume from `latest` if there is one; returns whether it did."""
        latest = self._ckpt_dir() / "latest"
        if not latest.exists():
            return False
        ckpt = self._ckpt_dir() / latest.read_text().strip()
        weights = ckpt / "weights"
        if hasattr(self.model, "peft_config"):
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(self.model, load_file(weights / "adapter_model.safetensors"))
        else:
            from safetensors.torch import load_file

            self.model.load_state_dict(load_file(weights / "model.safetensors"))
        state = torch.load(ckpt / "optimizer.pt", weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        self.step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        return True

    # ------------------------------------------------------------------ the run
    def train(self, on_step=None) -> list[dict]:
        """Run (or resume) to `num_steps`; metrics go to output_dir/metrics.jsonl. Returns this call's metrics."""
        self.out.mkdir(parents=True, exist_ok=True)
        resumed = self.load_checkpoint()
        metrics_path = self.out / "metrics.jsonl"
        _trim_metrics(metrics_path, self.step if resumed else 0)
        import yaml

        _atomic_write(self.out / "config.yaml", yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        done = []
        bar = None
        if self.cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.cfg.num_steps, initial=self.step, desc="longstraw", unit="step", dynamic_ncols=True)
        try:
            while self.step < self.cfg.num_steps:
                m = self.train_step(self.step)
                self.step += 1
                if self.cfg.eval_every and self.step % self.cfg.eval_every == 0 and self.step < self.cfg.num_steps:
                    m["eval"] = self.evaluate()
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                if self.step % self.cfg.save_every == 0 or self.step == self.cfg.num_steps:
                    self.save_checkpoint()
                done.append(m)
                if bar is not None:
                    bar.update(1)
                    post = {"loss": f"{m['loss']:.3f}", "len": m["prompt_length"]}
                    if "reward" in m:
                        post["reward"] = f"{m['reward']:.2f}"
                    bar.set_postfix(post, refresh=False)
                if on_step is not None:
                    on_step(m)
        finally:
            if bar is not None:
                bar.close()
        self._save_weights(self.out / ("adapter" if hasattr(self.model, "peft_config") else "model"))
        self.tok.save_pretrained(self.out / "tokenizer")
        return done


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _trim_metrics(path: Path, last_step: int) -> None:
    """Keep the metrics of steps ≤ last_step (the ones a resumed run does not redo)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by an interruption
        if row.get("step", 0) <= last_step:
            keep.append(line)
    _atomic_write(path, "".join(x + "\n" for x in keep))
