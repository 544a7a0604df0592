"""loss_type="bnpo": token mean over each micro-batch, averaged over micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import GRPOLoss, Normalizer, check_batch


@dataclass(frozen=True)
class BNPOLoss(GRPOLoss):
    """Token mean per micro-batch, where longstraw's micro-batch is one prompt group (its G responses).

    scale_i = 1 / (max(tokens of group(i), 1) · number of groups): TRL's bnpo with one group per
    micro-batch and the loss divided by the accumulation steps.
    """

    loss_type: str = field(default="bnpo", init=False)

    def normalizer(self, lengths, groups, max_completion_length) -> Normalizer:
        check_batch(lengths, groups, max_completion_length)
        tokens: dict[int, int] = {}
        for l, g in zip(lengths, groups):
            tokens[g] = tokens.get(g, 0) + l
        k = len(tokens)
        return Normalizer(tuple(1.0 / (max(tokens[g], 1) * k) for g in groups), f"bnpo: 1/(tokens in group·{k})")
