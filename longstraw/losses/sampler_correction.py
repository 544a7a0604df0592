"""Importance-sampling correction for a sampler that is another program (vLLM): TRL 1.16's rule and names.

An external engine samples with its own kernels (and, at low precision, its own rounding), so the distribution it drew
a response from, μ, is not exactly the trainer's policy π_old at the same weights. The per-token loss is then
weighted by a detached ratio of the two, per token or per sequence, truncated or masked:

    d_t = (old_t − sampler_t) · mask_t          old: the trainer's log-probs; sampler: the engine's (NaN → 0)
    token_*:    w_t = exp(d_t)                  sequence_*: w_t = exp(Σ_t d_t) for every t
    *_truncate: w = clamp(w, clip_min, clip_max)
    *_mask:     w = 0 where w < clip_min or w > clip_max (a missing bound is no bound)

as `trl.GRPOTrainer` computes `importance_sampling_ratio` (TRL 1.16: mode "sequence_mask", clip_min None, clip_max
3.0 by default) and multiplies `per_token_loss` by it before the KL term. The engine's log-probs must be those of the
distribution it sampled from, after temperature, top-k and top-p (vLLM's `--logprobs-mode processed_logprobs`, which
`longstraw vllm-serve` sets); the trainer's are log softmax(logits / temperature) over the whole vocabulary, so under
top-k / top-p the ratio is π_old(token) / μ(token) ≤ 1 on the kept tokens, the correction of truncated sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: TRL 1.16's `vllm_importance_sampling_mode` values
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class SamplerCorrection:
    """TRL's `vllm_importance_sampling_*` settings (validated at construction)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self):
        if self.mode not in IS_MODES:
            raise ValueError(f"vllm_importance_sampling_mode must be one of {IS_MODES}; got {self.mode!r}")
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(f"vllm_importance_sampling_clip_min {self.clip_min} > clip_max {self.clip_max}")
        if self.mode.endswith("truncate") and self.clip_max is None and self.clip_min is None:
            raise ValueError(f"{self.mode} needs vllm_importance_sampling_clip_max or clip_min")

    def weights(self, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """w `[T]` (no grad) for one response: `old` `[T]` the trainer's log-probs, `sampler` `[T]` the engine's,
        `mask` `[T]` (1: a token in the loss; None: all)."""
        return self._apply(self._ratio(old, sampler, mask))

    def _ratio(self, old, sampler, mask) -> torch.Tensor:
        with torch.no_grad():
            m = torch.ones_like(old) if mask is None else mask.to(old.dtype)
            d = torch.nan_to_num((old.detach() - sampler.to(old.dtype)) * m, nan=0.0)
            if self.mode.startswith("sequence"):
                d = d.sum().expand_as(old)
            return torch.exp(d)

    def _apply(self, ratio: torch.Tensor) -> torch.Tensor:
        if self.mode.endswith("truncate"):
            return torch.clamp(ratio, min=self.clip_min, max=self.clip_max)
        lo = -math.inf if self.clip_min is None else self.clip_min
        hi = math.inf if self.clip_max is None else self.clip_max
        return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)

    def stats(self, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict:
        """Sums over one response's unmasked tokens (no grad), for the step's metrics: Σ |old − sampler| and its max,
        Σ of the k3 estimate of KL(μ ‖ π_old) (tokens drawn from μ: exp(d) − d − 1, d = old − sampler), Σ w, the
        tokens whose weight the truncation or the mask changed, and the token count."""
        with torch.no_grad():
            ratio = self._ratio(old, sampler, mask)
            w = self._apply(ratio)
            m = mask.to(old.dtype) > 0
            d = (old.detach() - sampler.to(old.dtype))[m]
            return dict(
                abs_diff=float(d.abs().sum()),
                max_abs_diff=float(d.abs().max()) if d.numel() else 0.0,
                kl=float((torch.exp(d) - d - 1).sum()),
                weight=float(w[m].sum()),
                changed=int((w[m] != ratio[m]).sum()),
                tokens=int(m.sum()),
            )
