"""TRL 1.16's own GRPO loss as a test oracle.

`trl_loss` calls `trl.GRPOTrainer._compute_loss` unmodified, on a stand-in for the trainer that holds
what that method reads: a real `GRPOConfig` (so TRL's defaults apply), one process, one micro-batch,
no gradient accumulation, no vLLM. The per-token log-probs come from the caller (`logps_fn`), so
the same numbers, or the same model, feed TRL and longstraw.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
from trl import GRPOConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402


class _OneProcess:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def trl_config(tmp_dir, **kw) -> GRPOConfig:
    with warnings.catch_warnings():  # transformers 5.24's TrainingArguments deprecations: not ours
        warnings.simplefilter("ignore")
        return GRPOConfig(output_dir=str(tmp_dir), report_to="none", use_cpu=True, bf16=False, **kw)


def trl_is_ratio(args: GRPOConfig, old_logps, sampling_logps, completion_mask, tool_mask=None) -> torch.Tensor:
    """`importance_sampling_ratio` as `GRPOTrainer._generate_and_score_completions` computes it in TRL 1.16 (that method
    also generates, so its ratio lines are restated here, line for line): `[N, L]` for the token modes, `[N, 1]` for
    the sequence modes."""
    mask = completion_mask if tool_mask is None else completion_mask * tool_mask
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    mode = args.vllm_importance_sampling_mode
    if mode in ["sequence_mask", "sequence_truncate"]:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=lo, max=hi)
    lo = lo if lo is not None else -math.inf
    hi = hi if hi is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)


def trl_loss(args: GRPOConfig, logps_fn, completion_mask, advantages, old_logps, ref_logps=None, tool_mask=None,
             is_ratio=None):
    """TRL's loss. `logps_fn()` → (per-token log-probs `[N, L]`, entropies `[N, L]`); masks `[N, L]`; `is_ratio`:
    vLLM's importance-sampling ratio (`trl_is_ratio`), with which TRL runs as with vLLM and its correction on."""
    n, length = completion_mask.shape
    fake = SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        aux_loss_enabled=False,
        max_completion_length=args.max_completion_length, current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True), accelerator=_OneProcess(), _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (*logps_fn(), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, length, dtype=torch.long), "completion_mask": completion_mask,
        "advantages": advantages, "old_per_token_logps": old_logps,
        "num_items_in_batch": (completion_mask if tool_mask is None else completion_mask * tool_mask).sum(),
    }
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    if tool_mask is not None:
        inputs["tool_mask"] = tool_mask
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(fake, None, inputs)
