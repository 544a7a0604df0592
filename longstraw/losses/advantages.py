"""Rewards → advantages, as TRL's GRPOTrainer computes them.

rewards `[N]` = Σ_f weight_f · reward_f (NaN rewards skipped: a reward function may abstain),
A_i = r_i − mean(r of i's group), divided by (std + 1e-4) of i's group (`scale_rewards="group"`),
of the whole batch (`"batch"`), or not at all (`"none"`, Dr. GRPO). std is the unbiased one
(`torch.std`); a group of one has std NaN in TRL, here 0.
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")
EPS = 1e-4


def combine_rewards(per_function: torch.Tensor, weights=None) -> torch.Tensor:
    """`[N, F]` rewards of F functions → `[N]` weighted sum, ignoring NaN entries."""
    if per_function.dim() != 2:
        raise ValueError(f"per_function must be [N, F]; got {tuple(per_function.shape)}")
    w = torch.ones(per_function.shape[1]) if weights is None else torch.as_tensor(weights, dtype=per_function.dtype)
    if w.numel() != per_function.shape[1]:
        raise ValueError(f"{w.numel()} weights for {per_function.shape[1]} reward functions")
    return (per_function * w.to(per_function)).nansum(dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages `[N]` of rewards `[N]` laid out as consecutive groups of `group_size`."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}; got {scale_rewards!r}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "none":
        return adv
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        std = std.expand_as(grouped).reshape(-1)
    else:
        std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
    return adv / (std + EPS)
