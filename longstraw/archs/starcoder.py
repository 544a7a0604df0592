"""StarCoder 2: biased projections, LayerNorm, sliding window from `config.sliding_window`."""

from .base import Family, register

register(Family("starcoder2", "dense, sliding-window attention, biases", tiny=dict(sliding_window=5)))
