"""Typed training configuration, validated at construction, documented once (field `help`).

`longstraw train CONFIG.yaml --field value` reads these fields; `--help` prints every field with its
help and default. Names follow TRL's `GRPOConfig` where TRL has the concept.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..losses import LOSS_TYPES, SCALE_REWARDS
from ..losses.base import IMPORTANCE_SAMPLING_LEVELS
from ..losses.sampler_correction import SamplerCorrection
from ..replay.layer_major import LayerMajor
from ..tasks import REWARD_FUNCTIONS, TASKS
from ..testing.models import TINY_CONFIGS
from .verl_names import from_verl


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class TrainConfig:
    # ------------------------------------------------------------------ model
    model: str = _f(
        "llama",
        "a built-in tiny architecture (llama, qwen3, gemma3_text, qwen3_next, glm_moe_dsa, ...) "
        "or a local folder with a transformers model and its tokenizer",
    )
    model_overrides: dict = _f(
        {},
        "config fields over the model's: of a built-in tiny model over "
        "`longstraw.testing.models.TINY_CONFIGS` (vocab_size comes from the task tokenizer), or of "
        "a local model over its config.json — e.g. RoPE scaling for prompts past its "
        "positions: {rope_parameters: {rope_type: yarn, factor: 4, "
        "original_max_position_embeddings: 8192, rope_theta: 100000}, "
        "max_position_embeddings: 32768}",
    )
    lora: bool = _f(True, "train a PEFT LoRA adapter (False: full fine-tuning)")
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha")
    lora_target_modules: str | list = _f("all-linear", "PEFT target_modules (a name pattern or a list)")
    train_embeddings: bool | None = _f(
        None,
        "with LoRA, also train the embeddings and LM head in full (`modules_to_save`). Default: true for a built-in "
        "tiny model (random-initialised, it needs them to learn anything), false for a checkpoint (the adapter "
        "alone, as PEFT's LoRA: on Gemma 3 270M the two 262K-token matrices are 2 × 168M parameters, more than the "
        "model, with their gradients and AdamW moments)",
    )
    chat_template_path: str | None = _f(
        None,
        "a chat template for the tokenizer, as TRL's SFTConfig: a Jinja file, or a tokenizer folder whose template "
        "to take — for a base model without one (Gemma 3 270M: `longstraw.tools.real_models.chat_format('gemma3')` "
        "gives this field and `eos_token`) or to replace the model's; the saved tokenizer keeps it",
    )
    eos_token: str | None = _f(
        None,
        "the token that ends a response, as TRL's SFTConfig (null: the tokenizer's eos_token): a chat template's "
        "end-of-turn token, one token of the vocabulary; the saved model's generation config stops there too",
    )
    # ------------------------------------------------------------------ data
    task: str = _f("kv_retrieval", f"built-in task: one of {sorted(TASKS)}; ignored when `dataset` is set")
    task_options: dict = _f({"num_pairs": 16, "num_values": 16}, "options of the built-in task")
    dataset: str | None = _f(
        None,
        "user data (a JSONL, parquet or Arrow file, or a `datasets` save_to_disk folder): each row a text "
        '"prompt" or a chat "messages" (formatted with the tokenizer\'s chat template, generation prompt added); '
        'every other field ("answer", ...) goes to the reward functions as a keyword list',
    )
    eval_dataset: str | None = _f(
        None, "held-out rows for evaluation, in any `dataset` format (default: hold out `eval_fraction` of `dataset`)"
    )
    eval_fraction: float = _f(
        0.1,
        "fraction of `dataset` rows held out for evaluation, chosen by `seed`, when no "
        "`eval_dataset` is given (0: evaluate on the training rows)",
    )
    token_cache: str | None = _f(
        "auto",
        "folder where a dataset's prompts are tokenized once, into a memory-mapped Arrow file keyed by tokenizer and "
        "rows (longstraw.tasks.token_cache): auto = $LONGSTRAW_CACHE/tokens (~/.cache/longstraw/tokens); null: "
        "tokenize a prompt at every step that draws it",
    )
    force_resume: bool = _f(
        False,
        "resume an output_dir whose record (config.yaml) names other data, another model or other model_overrides, "
        "or whose learning-rate schedule has ended (the command line's --force-resume); such a resume is refused "
        "otherwise (longstraw.train.run_record)",
    )
    drop_invalid_rows: bool = _f(
        False,
        "a dataset row that cannot train (its prompt + max_completion_length past the model's positions, a column its "
        "reward function reads missing, a chat message without text) is dropped, named at the start with the count, "
        "instead of stopping the run before step 1 (longstraw.train.row_check)",
    )
    prompt_length: int = _f(256, "prompt length in tokens of built-in task examples (the last curriculum stage)")
    curriculum: list = _f(
        [],
        "prompt lengths to grow through, e.g. [64, 256, 1024]: stage i lasts "
        "curriculum_steps[i] steps; the last stage runs to the end",
    )
    curriculum_steps: list = _f([], "steps per curriculum stage (one entry per stage but the last)")
    # ------------------------------------------------------------------ GRPO
    num_steps: int = _f(100, "optimizer steps")
    prompts_per_step: int = _f(1, "prompts per optimizer step (each with num_generations responses)")
    num_generations: int = _f(8, "G: responses per prompt")
    num_iterations: int = _f(
        1,
        "TRL's μ: optimizer steps per rollout batch; each replays the same responses against the moved policy "
        "(old log-probs from sampling, the ratio clipped by epsilon), the prompt states captured again",
    )
    recapture_every: int = _f(
        1,
        "k: keep a context's captured prompt state for up to k optimizer steps (a document asked questions over "
        "several steps, or the iterations of `num_iterations`) instead of capturing it every step; its K/V then "
        "come from weights up to k - 1 steps old (longstraw.train.staleness); detached mode, one process; 1: "
        "capture every step",
    )
    recapture_drift: float | None = _f(
        None,
        "with recapture_every > 1: before a kept state is read again, probe its drift (the document's first 512 "
        "tokens captured again by the current weights, their full-attention K/V against the kept state's) and "
        "capture anew when the log-prob drift it predicts, DRIFT_PER_KV (2.5) x the probe's relative K/V change, "
        "passes this mean |delta log p| (e.g. 0.02: the importance ratio moved 2 %); null: reuse for recapture_every "
        "steps whatever the drift (longstraw.train.staleness)",
    )
    share_prefixes: bool = _f(
        True,
        "capture a prefix the step's rows share once (a document asked several questions; rows with equal "
        "`context` columns, or consecutive rows sharing >= min_shared_prefix tokens): longstraw.train.sharing",
    )
    min_shared_prefix: int = _f(256, "shortest common token prefix consecutive rows without a `context` column share")
    max_row_suffix: int = _f(
        2048, "longest remainder of a sharing row after the shared prefix (read once per response); longer: own capture"
    )
    rows_per_context: int | None = _f(
        None,
        "draw a step's rows document by document, Q rows per document: a built-in task asks Q questions of one "
        "document, a dataset's rows are ordered by their `context` column (None: rows in dataset order)",
    )
    max_completion_length: int = _f(4, "longest response in tokens (stop token included)")
    temperature: float = _f(1.0, "sampling temperature (log-probs use logits / temperature, as in TRL)")
    top_p: float = _f(1.0, "nucleus sampling")
    top_k: int = _f(0, "top-k sampling (0: off)")
    restrict_to_answer_tokens: bool = _f(False, "sample only the task's answer tokens and the stop token")
    ignore_eos: bool = _f(
        False, "always sample max_completion_length tokens (benchmarks): the stop token does not end a response"
    )
    loss_type: str = _f("dapo", f"one of {sorted(LOSS_TYPES)}")
    epsilon: float = _f(0.2, "lower clip of the importance ratio")
    epsilon_high: float | None = _f(None, "upper clip (None: epsilon)")
    beta: float = _f(0.0, "KL coefficient against the reference policy (adapters disabled); 0 skips it")
    importance_sampling_level: str = _f("token", f"one of {IMPORTANCE_SAMPLING_LEVELS}")
    use_bias_correction_kl: bool = _f(
        True,
        "multiply the per-token KL by the importance ratio (TRL 1.16's default, "
        "the unbiased reverse-KL gradient of DeepSeek-V3.2); false: plain k3",
    )
    scale_rewards: str = _f("group", f"one of {SCALE_REWARDS}")
    mask_truncated_completions: bool = _f(False, "exclude responses without a stop token from the loss")
    reward_funcs: list = _f(
        [],
        f"reward functions: built-in names ({sorted(REWARD_FUNCTIONS)}), "
        "'package.module:function' or 'path/to/file.py:function', TRL's signature "
        "(prompts, completions, **columns) -> list[float]; empty: the task's own",
    )
    rollout_func: str | None = _f(
        None,
        "rollout hook 'package.module:function' or 'path/to/file.py:function': "
        "(sampler, example, num_generations) -> responses with token ids, mask and "
        "old log-probs (multi-turn, tool output; see longstraw.train.rollout)",
    )
    environment: str | None = _f(
        None,
        "agent environment factory 'package.module:Class' or 'path/to/file.py:Class' "
        "(TRL's environment_factory: reset(**columns), public methods as tools, "
        "optional get_reward()): multi-turn rollouts whose tool replies grow each "
        "trajectory's own state (longstraw.agent); max_completion_length bounds a "
        "whole trajectory, tool tokens included",
    )
    rollout_backend: str = _f(
        "own",
        "who samples the rollouts: 'own' (longstraw's sampler, decoding from the captured prompt state: the prompt "
        "prefilled once per step) or 'vllm' (a vLLM server: token ids in, token ids and its log-probs out; the LoRA "
        "adapter hot-loaded every step, or with full fine-tuning the weights reloaded; longstraw.train.vllm_client)",
    )
    vllm_url: str | None = _f(
        None,
        "with rollout_backend: vllm, the server's URL (e.g. http://127.0.0.1:8000, started by `longstraw vllm-serve "
        "MODEL`); null: the trainer starts one on the model for the run and stops it after",
    )
    vllm_timeout_s: float = _f(600.0, "with rollout_backend: vllm, seconds one request may take before it is an error")
    vllm_importance_sampling_correction: bool = _f(
        True,
        "with rollout_backend: vllm, weight each token's loss by the detached ratio of the trainer's old log-probs to "
        "vLLM's (TRL's names and defaults; longstraw.losses.sampler_correction)",
    )
    vllm_importance_sampling_mode: str = _f(
        "sequence_mask", "token_truncate, token_mask, sequence_truncate or sequence_mask (TRL 1.16's default)"
    )
    vllm_importance_sampling_clip_min: float | None = _f(None, "lower bound of the ratio (null: none)")
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "upper bound of the ratio (null: none)")
    tool_parser: str | None = _f(
        None,
        "with `environment`: 'package.module:function' reading a policy turn's text "
        "into tool calls (longstraw.agent.ToolCall); null: the <tool_call>{json}"
        "</tool_call> blocks chat templates write",
    )
    max_turns: int = _f(8, "with `environment`: policy turns per trajectory at most")
    max_turn_tokens: int | None = _f(
        None, "with `environment`: tokens per policy turn at most (null: what the trajectory has left)"
    )
    max_tool_tokens: int = _f(
        1024, "with `environment`: tokens of one tool reply at most (a longer one is cut, with a note saying how much)"
    )
    segment_replay: bool | None = _f(
        None,
        "replay a multi-turn response one segment at a time (one segment's graph, the trajectory's own K/V and "
        "their gradient held once) with the gradient of replaying it whole: the prompt a constant (detached) or "
        "not (exact), everything after it differentiated; null: on with `environment` (on N processes too: the ranks "
        "replay their trajectories' segments in lockstep), off otherwise (the whole response in one graph: the "
        "same gradient)",
    )
    replay_order: str = _f(
        "segments",
        "how a response is replayed for its gradient (the same gradient either way): 'segments' (segment-major, with "
        "segment_replay: each segment through every decoder layer; holds every layer's own K/V of the trajectory and "
        "their gradient, 2x its own K/V) or 'layers' (layer-major, every response: one decoder layer at a time over "
        "the whole response; holds one layer's own K/V and the hidden states entering the layers `keep_hidden` keeps; "
        "one process; docs/agents.md, 'Cost')",
    )
    keep_hidden: str = _f(
        "2/3",
        "with replay_order: layers, 'k/n': the hidden states entering k of every n decoder layers are kept from the "
        "forward, the others recomputed (fewer kept: less memory, 1 - k/n of a forward more; 2/3 on SmolLM2 with "
        "LoRA: 1.09x the own K/V in 1.44x the whole replay's time)",
    )
    replay_batch: str | int = _f(
        "auto",
        "responses replayed together, in one forward and one backward (longstraw.replay.batched: the prompt "
        "state and the weights read once for them; the same gradient): an integer >= 1 (1: one at a time), or "
        "'auto': as many as `replay_memory_mb` holds of one replay's graph "
        "(longstraw.model.chunking.replay_graph_bytes). A row's G go together; the rows of one document share "
        "the batches (detached: where every layer is plain attention, replay_branches; exact: any layer). Responses "
        "replayed in segments or layer by layer go one at a time; on N processes each rank replays its share of a row "
        "k at a time, one collective per batch (DSA layers one at a time)",
    )
    replay_memory_mb: float = _f(
        1024.0,
        "with replay_batch: auto, what the graphs of the responses replayed together may take (MiB); independent "
        "of the prompt's length",
    )
    skip_zero_advantage: bool = _f(
        False,
        "do not replay responses whose advantage is 0 (every response of a group with equal rewards): with beta 0 and "
        "entropy_coef 0 their loss and gradient are 0, so the gradient is unchanged; the step's entropy and "
        "clip_ratio metrics then cover the replayed responses only. Not under context parallelism or FSDP2 (their "
        "replays go in step across ranks)",
    )
    reward_weights: list = _f([], "weight per reward function (empty: all 1)")
    entropy_coef: float = _f(0.0, "entropy bonus: subtract entropy_coef · mean token entropy from the loss")
    sft_warmup_steps: int = _f(0, "supervised steps on the answers before GRPO (cross-entropy of answer tokens)")
    sft_full_sequence: bool = _f(
        True,
        "supervised steps back-propagate through the whole [prompt + answer] "
        "(False: capture the prompt, replay the answer, detached like GRPO)",
    )
    prompt_grad: str = _f(
        "detached",
        "gradient through the prompt: 'detached' (LongStraw as published: the "
        "prompt state is a constant) or 'exact' (equal to full-sequence GRPO)",
    )
    chunk_size: int | None = _f(
        None,
        "capture chunk size in tokens (null: chosen for the model, 4,096 unless "
        "one chunk's transients would pass 512 MiB; longstraw.model.chunking.auto_chunk_size)",
    )
    state_dtype: str | None = _f(
        None,
        "keep the prompt's growing state (K/V, MLA latents) in 8 bits: 'fp8' or "
        "'int8' (per-block scales; detached prompt_grad only); null: the model's dtype",
    )
    checkpoint_layers: bool = _f(
        False,
        "recompute each decoder layer in backward during replay (activation "
        "checkpointing: less memory for long responses and MoE, one more forward)",
    )
    # ------------------------------------------------------------------ optimizer
    learning_rate: float = _f(3e-3, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_betas: list = _f([0.9, 0.99], "AdamW betas")
    lr_scheduler: str = _f("constant", "constant, linear or cosine (decay to 0 after warmup)")
    warmup_steps: int = _f(0, "linear learning-rate warmup steps")
    max_grad_norm: float = _f(1.0, "gradient clipping (0: off)")
    seed: int = _f(0, "seed of the model initialisation, the data and the sampler")
    # ------------------------------------------------------------------ output
    output_dir: str = _f(
        "runs/longstraw", "where metrics, checkpoints, the final model (model/ or adapter/) and plots go"
    )
    merge_adapter: bool = _f(
        False,
        "with LoRA, also write the merged model to OUTPUT/model (a plain transformers folder) beside OUTPUT/adapter",
    )
    report_to: list = _f(
        [],
        "extra metric sinks besides metrics.jsonl: tensorboard (needs the tensorboard package; event files in "
        "OUTPUT/tensorboard), wandb (needs the wandb package; its run files in OUTPUT/wandb, WANDB_MODE=offline "
        "keeps them there)",
    )
    log_completions: bool = _f(
        True,
        "write each GRPO step's completions (the prompt's tail, the text, each reward "
        "and the advantage) to OUTPUT/completions/step-N.jsonl, and to TensorBoard as "
        "text when it is on (TRL's `log_completions`)",
    )
    num_completions_to_print: int = _f(
        2, "completions printed to the console after each GRPO step (0: none; TRL's name)"
    )
    save_every: int = _f(1, "checkpoint every N steps (the last step is always saved)")
    eval_every: int = _f(0, "held-out evaluation every N steps (0: only at the end)")
    eval_lengths: list = _f([], "prompt lengths of the held-out evaluation (empty: prompt_length)")
    eval_examples: int = _f(64, "held-out examples per length")
    eval_at_start: bool = _f(
        True,
        "also evaluate the starting model before the first step, so that eval.json and "
        "the final table show the gain (kept across a resume in OUTPUT/eval_start.json)",
    )
    threads: int = _f(
        0, "torch threads per process (0: torch's default; 1 per rank on the CPU when the run has several processes)"
    )
    dist_timeout: float = _f(
        600.0,
        "seconds a rank waits in a collective (runs of several processes: torchrun or "
        "--nproc) before it raises an error naming the collective, instead of hanging on "
        "a rank that died or hangs",
    )
    fsdp: bool = _f(
        False,
        "runs of several processes: shard the decoder layers' weights, gradients and optimizer "
        "state over the ranks (FSDP2; 1/N per rank); checkpoints keep one optimizer file per rank "
        "and resume on as many processes",
    )
    context_parallel: int = _f(
        0,
        "runs of several processes: ranks per context-parallel group, which capture, sample and replay a prompt "
        "together (each holds a slice of its positions); the run's N / C groups of C consecutive ranks take the "
        "step's prompts in turn (data parallel) and sum their gradients. 0: one group of all ranks; 1: each rank "
        "takes whole prompts",
    )
    expert_parallel: int = _f(
        1,
        "runs of several processes with a mixture-of-experts model: spread each MoE layer's routed experts over "
        "this many ranks (it divides the process count; each rank holds 1/N of the experts and their LoRA "
        "adapters, tokens go to their experts' rank and back by all-to-all); 1: every rank holds every expert",
    )
    device: str = _f("auto", "where the model runs: auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    dtype: str = _f(
        "auto",
        "model dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32; LoRA adapters and "
        "all accumulations stay fp32, trainable bf16 weights step on fp32 master copies",
    )
    progress: bool = _f(True, "show a progress bar")

    @property
    def replays_segments(self) -> bool:
        """Whether multi-turn responses are replayed one segment at a time (`segment_replay`, on by default with an
        `environment`; the gradient is the whole replay's either way)."""
        if self.segment_replay is not None:
            return self.segment_replay
        # vLLM trajectories replay whole: their old log-probs are the first replay's (`longstraw.train.update`)
        return self.environment is not None and self.rollout_backend != "vllm"

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"config: {msg}")

        if self.train_embeddings is None:  # a random-initialised tiny model needs them; a checkpoint does not
            self.train_embeddings = self.model in TINY_CONFIGS

        need(self.rollout_backend in ("own", "vllm"), "rollout_backend must be 'own' or 'vllm'")
        if self.rollout_backend == "vllm":
            SamplerCorrection(  # validates the mode and bounds
                self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min,
                self.vllm_importance_sampling_clip_max,
            )
            need(
                not (self.lora and self.train_embeddings),
                "rollout_backend: vllm with lora: true hot-loads the adapter every step, and vLLM's runtime LoRA "
                "loading takes adapters of linear layers only: set train_embeddings: false (or lora: false: full "
                "fine-tuning, whose weights are reloaded into the server every step)",
            )
            need(
                not self.segment_replay,
                "segment_replay: true with rollout_backend: vllm: the trainer's old log-probs of a vLLM trajectory "
                "come from its first replay, whole (the same gradient as segments, the whole trajectory's graph); "
                "leave segment_replay unset",
            )
            need(self.vllm_timeout_s > 0, "vllm_timeout_s must be > 0")
        need(self.num_steps >= 1, "num_steps must be >= 1")
        need(self.prompts_per_step >= 1, "prompts_per_step must be >= 1")
        need(self.min_shared_prefix >= 1 and self.max_row_suffix >= 0, "min_shared_prefix >= 1, max_row_suffix >= 0")
        need(self.num_iterations >= 1, "num_iterations must be >= 1")
        need(self.recapture_every >= 1, "recapture_every must be >= 1")
        need(
            self.recapture_drift is None or (self.recapture_drift > 0 and self.recapture_every > 1),
            "recapture_drift must be > 0 and needs recapture_every > 1 (it decides when a kept state is captured anew)",
        )
        need(
            self.recapture_every == 1 or self.prompt_grad == "detached",
            "recapture_every > 1 keeps detached prompt states (prompt_grad: detached); an exact prompt gradient is "
            "the gradient of the prompt read by the current weights",
        )
        need(self.rows_per_context is None or self.rows_per_context >= 1, "rows_per_context must be >= 1 or null")
        need(self.num_generations >= 2, "num_generations must be >= 2 (GRPO compares responses within a group)")
        need(self.max_completion_length >= 1, "max_completion_length must be >= 1")
        need(self.temperature > 0, "temperature must be > 0 for GRPO sampling")
        need(self.loss_type in LOSS_TYPES, f"loss_type must be one of {sorted(LOSS_TYPES)}")
        need(self.scale_rewards in SCALE_REWARDS, f"scale_rewards must be one of {SCALE_REWARDS}")
        need(
            self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS,
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}",
        )
        need(self.dataset is not None or self.task in TASKS, f"task must be one of {sorted(TASKS)}")
        need(0.0 <= self.eval_fraction < 1.0, "eval_fraction must be in [0, 1)")
        need(self.eval_dataset is None or self.dataset is not None, "eval_dataset needs a `dataset` to train on")
        need(
            all(isinstance(r, str) and (r in REWARD_FUNCTIONS or ":" in r) for r in self.reward_funcs),
            f"reward_funcs entries must be built-in names {sorted(REWARD_FUNCTIONS)} or import paths "
            "'package.module:function' / 'path/to/file.py:function'",
        )
        need(
            self.rollout_func is None or ":" in self.rollout_func,
            "rollout_func must be an import path 'package.module:function' or 'path/to/file.py:function'",
        )
        need(
            self.environment is None or ":" in self.environment,
            "environment must be an import path 'package.module:Class' or 'path/to/file.py:Class'",
        )
        need(self.environment is None or self.rollout_func is None, "set `environment` or `rollout_func`, not both")
        need(
            self.max_turns >= 1
            and self.max_tool_tokens >= 1
            and (self.max_turn_tokens is None or self.max_turn_tokens >= 1),
            "max_turns, max_turn_tokens and max_tool_tokens must be >= 1",
        )
        need(
            not self.replays_segments or self.importance_sampling_level == "token",
            "segment_replay needs importance_sampling_level: token (a sequence-level ratio couples the turns)",
        )
        need(
            self.replay_order in ("segments", "layers"),
            f"replay_order must be 'segments' or 'layers', not {self.replay_order!r}",
        )
        if isinstance(self.replay_batch, str) and self.replay_batch.strip().isdigit():
            self.replay_batch = int(self.replay_batch)  # from the command line or a quoted YAML value
        need(
            self.replay_batch == "auto"
            or (
                isinstance(self.replay_batch, int)
                and not isinstance(self.replay_batch, bool)
                and self.replay_batch >= 1
            ),
            f"replay_batch must be 'auto' or an integer >= 1, not {self.replay_batch!r}",
        )
        need(self.replay_memory_mb > 0, f"replay_memory_mb must be > 0, not {self.replay_memory_mb}")
        try:
            LayerMajor.parse(self.keep_hidden)
        except ValueError as e:
            need(False, str(e))
        need(
            self.replay_order != "layers"
            or (self.importance_sampling_level == "token" and self.rollout_backend != "vllm" and not self.fsdp),
            "replay_order: layers needs importance_sampling_level: token (each policy segment's loss is taken apart), "
            "the own sampler (a vLLM trajectory's old log-probs are its first replay's) and no fsdp (one process)",
        )
        need(
            set(self.report_to) <= {"tensorboard", "wandb"},
            f"report_to {self.report_to}: it may hold 'tensorboard' and 'wandb'",
        )
        need(self.num_completions_to_print >= 0, "num_completions_to_print must be ≥ 0")
        # with no `reward_funcs` here the functions come from elsewhere (callables passed to the trainer, or the
        # task's own reward): `RewardSet` checks the weights against those
        need(
            not self.reward_weights or not self.reward_funcs or len(self.reward_weights) == len(self.reward_funcs),
            f"reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs: give "
            "one weight per reward function, in reward_funcs' order",
        )
        need(self.lr_scheduler in ("constant", "linear", "cosine"), "lr_scheduler must be constant, linear or cosine")
        need(self.prompt_grad in ("detached", "exact"), "prompt_grad must be 'detached' or 'exact'")
        need(self.state_dtype in (None, "fp8", "int8"), "state_dtype must be 'fp8', 'int8' or null")
        need(self.dtype in ("auto", "fp32", "bf16", "fp16"), "dtype must be 'auto', 'fp32', 'bf16' or 'fp16'")
        need(
            self.dtype != "fp16" or (self.lora and not self.train_embeddings),
            "trainable fp16 weights (full fine-tuning, or train_embeddings with LoRA) would need loss scaling, which "
            "the trainer does not do: use dtype bf16 (trained on float32 master weights) or fp32",
        )
        need(
            self.state_dtype is None or self.prompt_grad == "detached",
            "state_dtype (a quantized prompt state) needs prompt_grad: detached",
        )
        need(
            len(self.curriculum_steps) == max(len(self.curriculum) - 1, 0),
            "curriculum_steps needs one entry per curriculum stage but the last",
        )
        need(self.prompt_length >= 2 and all(int(x) >= 2 for x in self.curriculum), "prompt lengths must be >= 2")
        need(
            (self.chunk_size is None or self.chunk_size >= 1) and self.save_every >= 1 and self.eval_examples >= 1,
            "sizes must be >= 1",
        )
        need(self.dist_timeout > 0, "dist_timeout must be > 0 seconds")
        need(self.expert_parallel >= 1, "expert_parallel must be >= 1")
        need(self.context_parallel >= 0, "context_parallel must be >= 0 (0: one group of all ranks)")
        need(
            self.expert_parallel == 1
            or self.context_parallel == 0
            or self.context_parallel % self.expert_parallel == 0,
            f"expert_parallel: {self.expert_parallel} needs a context_parallel group it divides (context_parallel: "
            f"{self.context_parallel}): an expert group's ranks must run every forward together",
        )
        need(
            self.expert_parallel == 1 or self.rollout_backend == "own",
            "expert_parallel with rollout_backend: vllm: the server would need the spread experts gathered every "
            "step, which is not built; use the own sampler",
        )
        need(
            self.entropy_coef >= 0 and self.sft_warmup_steps >= 0 and self.warmup_steps >= 0,
            "entropy_coef, sft_warmup_steps and warmup_steps must be >= 0",
        )
        need(
            not self.skip_zero_advantage or (self.beta == 0 and self.entropy_coef == 0),
            "skip_zero_advantage needs beta: 0 and entropy_coef: 0 (a KL or entropy term has a gradient where the "
            "advantage is 0)",
        )

    # ------------------------------------------------------------------ io
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """A config from `values` (field: value); verl's names of the sampler correction are read as TRL's
        (`longstraw.train.verl_names`)."""
        values = from_verl(values)
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            hints = {k: closest(k, cls.field_names()) for k in unknown}
            named = ", ".join(f"{k!r}" + (f" (did you mean {c!r}?)" if c else "") for k, c in hints.items())
            raise ValueError(f"config: unknown field(s) {named}; valid fields: {', '.join(cls.field_names())}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
        """The config of a YAML file; a run's `config.yaml` has a `record:` of what ran beside the fields
        (`longstraw.train.run_record`), which is not a setting and is left out here."""
        values = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a config file must hold a mapping of field: value")
        values.pop("record", None)
        return cls.from_dict({**values, **(overrides or {})})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def stage_length(self, step: int) -> int:
        """Prompt length at optimizer step `step` (0-based) under the curriculum."""
        if not self.curriculum:
            return self.prompt_length
        end = 0
        for length, steps in zip(self.curriculum, self.curriculum_steps):
            end += steps
            if step < end:
                return int(length)
        return int(self.curriculum[-1])


def closest(name: str, names: list[str]) -> str | None:
    """The one of `names` a mistyped `name` most likely means (difflib's ratio ≥ 0.75), else None: `num_step` →
    `num_steps`, while `lr` means no field (`lora` scores 0.67)."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    return close[0] if close else None
