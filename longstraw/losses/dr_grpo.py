"""loss_type="dr_grpo" (Dr. GRPO): sum over tokens divided by a constant, N · max_completion_length."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import GRPOLoss, Normalizer, check_batch


@dataclass(frozen=True)
class DrGRPOLoss(GRPOLoss):
    """scale_i = 1 / (N · max_completion_length): no length bias, a fixed normalizer."""

    loss_type: str = field(default="dr_grpo", init=False)

    def normalizer(self, lengths, groups, max_completion_length) -> Normalizer:
        check_batch(lengths, groups, max_completion_length)
        n = len(lengths)
        return Normalizer((1.0 / (n * max_completion_length),) * n, f"dr_grpo: 1/({n}·{max_completion_length})")
