"""MiniMax-M2: full attention with per-layer QK-norm, MoE."""

from .base import Family, register

register(Family("minimax_m2", "full attention, QK-norm, MoE", moe=True, tiny=dict(intermediate_size=32)))
