"""The GRPO loss family, one class per algorithm (variants by subclassing), and advantages."""

from .advantages import SCALE_REWARDS, combine_rewards, group_advantages
from .base import GRPOLoss, Normalizer, TokenStats
from .bnpo import BNPOLoss
from .dapo import DAPOLoss
from .dr_grpo import DrGRPOLoss

LOSS_TYPES = {cls.loss_type: cls for cls in (GRPOLoss, BNPOLoss, DrGRPOLoss, DAPOLoss)}
DEFAULT_LOSS_TYPE = "dapo"


def make_loss(loss_type: str = DEFAULT_LOSS_TYPE, **kwargs) -> GRPOLoss:
    """The loss of `loss_type` (one of `LOSS_TYPES`) with its options."""
    try:
        cls = LOSS_TYPES[loss_type]
    except KeyError:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_TYPES)}; got {loss_type!r}") from None
    return cls(**kwargs)


__all__ = [
    "BNPOLoss",
    "DAPOLoss",
    "DEFAULT_LOSS_TYPE",
    "DrGRPOLoss",
    "GRPOLoss",
    "LOSS_TYPES",
    "Normalizer",
    "SCALE_REWARDS",
    "TokenStats",
    "combine_rewards",
    "group_advantages",
    "make_loss",
]
