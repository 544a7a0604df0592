"""A plain batched GRPO loss on padded tensors, written independently of `losses/base.py`.

The production path (`GRPOLoss.response_loss` with a `Normalizer`) scores one response at a time so
that each can be replayed and back-propagated on its own. This reference scores the whole batch at
once from padded `[N, L]` tensors and writes every piece in a different form, so that a slip in one
is not copied into the other:

- the clipped surrogate piecewise by the advantage's sign (A ≥ 0: −A·min(ρ, 1 + ε_high);
  A < 0: −A·max(ρ, 1 − ε)) instead of `−min(ρ·A, clip(ρ)·A)`;
- the bias-corrected KL ρ·k3 in log space, exp(log ρ + d) − ρ·(d + 1) with d = ref − logp;
- each loss type's normalizer as a weight matrix `W [N, L]` over tokens, the loss being Σ W·l, built
  from the definitions in TRL 1.16's `GRPOTrainer._compute_loss` (one micro-batch, no accumulation):
  grpo: per-sequence token mean, averaged over sequences; dapo: token mean over the batch;
  dr_grpo: token sum / (N · max_completion_length); bnpo: token mean per prompt group (longstraw's
  micro-batch), averaged over groups.

The tests hold serial accumulation equal to this, and this equal to TRL's own `_compute_loss`.
"""

from __future__ import annotations

import torch


def _token_weights(loss_type: str, mask: torch.Tensor, max_completion_length, group_ids) -> torch.Tensor:
    """`W [N, L]`: the weight of each token in the batch loss (0 on masked and padded positions)."""
    n = mask.shape[0]
    if loss_type == "grpo":
        return mask / (n * mask.sum(1, keepdim=True).clamp(min=1.0))
    if loss_type == "dapo":
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (n * max_completion_length)
    if loss_type == "bnpo":
        groups = torch.as_tensor(group_ids)
        onehot = (groups[:, None] == groups.unique()[None, :]).to(mask.dtype)  # [N, K]
        per_group_tokens = onehot.T @ mask.sum(1)  # [K]
        tokens_of_my_group = onehot @ per_group_tokens  # [N]
        return mask / (onehot.shape[1] * tokens_of_my_group.clamp(min=1.0))[:, None]
    raise ValueError(f"unknown loss_type {loss_type!r}")


def batched_loss(
    loss_type: str,
    logps,
    old_logps,
    advantages,
    mask,
    *,
    epsilon=0.2,
    epsilon_high=None,
    beta=0.0,
    ref_logps=None,
    importance_sampling_level="token",
    use_bias_correction_kl=True,
    max_completion_length=None,
    group_ids=None,
):
    """The batch loss (a scalar). logps, old_logps, ref_logps, mask: `[N, L]` (mask 1 on tokens in the loss,
    0 on padding and on masked tokens); advantages `[N]`. Values at masked positions must be finite."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    log_rho = logps - old_logps
    if importance_sampling_level == "sequence":
        seq = (log_rho * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        log_rho = seq[:, None].expand_as(logps)
    rho = log_rho.exp()
    a = advantages[:, None].expand_as(logps)
    surrogate = torch.where(a >= 0, -a * torch.clamp(rho, max=1 + eps_high), -a * torch.clamp(rho, min=1 - epsilon))
    per_token = surrogate
    if beta != 0.0:
        d = ref_logps - logps
        if use_bias_correction_kl:
            kl = torch.exp(log_rho + d) - rho * (d + 1)
        else:
            kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    weights = _token_weights(loss_type, mask, max_completion_length, group_ids)
    return (weights * per_token).sum()
