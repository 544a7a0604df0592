"""The batched GRPO loss written from the formulas (TRL's `_compute_loss` on padded tensors).

The tests hold serial per-response accumulation (`GRPOLoss.response_loss` with the loss type's
`normalizer`) equal to this, in value and gradient.
"""

from __future__ import annotations

import torch


def batched_loss(loss_type: str, logps, old_logps, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.0,
                 ref_logps=None, importance_sampling_level="token", max_completion_length=None, group_ids=None):
    """logps, old_logps, ref_logps, mask: `[N, L]` (mask 1 on real tokens); advantages `[N]`."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + eps_high)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    if beta != 0.0:
        d = ref_logps - logps
        per_token = per_token + beta * (torch.exp(d) - d - 1)
    per_token = per_token * torch.ones_like(mask)  # sequence level: broadcast to [N, L]
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":  # one micro-batch per group, averaged over the accumulation steps
        groups = torch.as_tensor(group_ids)
        losses = [(per_token[groups == g] * mask[groups == g]).sum() / mask[groups == g].sum().clamp(min=1.0)
                  for g in groups.unique()]
        return torch.stack(losses).mean()
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    if loss_type == "dapo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    raise ValueError(f"unknown loss_type {loss_type!r}")
