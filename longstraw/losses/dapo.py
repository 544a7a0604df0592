"""loss_type="dapo" (the default, as in TRL ≥ 0.22): token mean over the whole batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import GRPOLoss, Normalizer, check_batch


@dataclass(frozen=True)
class DAPOLoss(GRPOLoss):
    """scale_i = 1 / (unmasked tokens in the whole step's batch): every token weighs the same,
    whatever response or prompt group it belongs to (TRL's `num_items_in_batch`)."""

    loss_type: str = field(default="dapo", init=False)

    def normalizer(self, lengths, groups, max_completion_length) -> Normalizer:
        check_batch(lengths, groups, max_completion_length)
        total = max(sum(lengths), 1)
        return Normalizer((1.0 / total,) * len(lengths), f"dapo: 1/{total} tokens")
