"""The GRPO surrogate per token, and how a batch of responses is normalized (TRL's `loss_type`).

Per token t of response i (TRL ≥ 0.22 conventions):

    ρ_it = exp(logp_it − old_it)                    importance_sampling_level="token"
    ρ_it = exp(mean_t(logp_it − old_it))            importance_sampling_level="sequence" (GSPO)
    k_it = exp(ref_it − logp_it) − (ref_it − logp_it) − 1           (k3 estimator of KL(π‖π_ref))
    l_it = −min(ρ_it·A_i, clip(ρ_it, 1 − ε, 1 + ε_high)·A_i) + β·ρ_it·k_it   use_bias_correction_kl=True
    l_it = −min(ρ_it·A_i, clip(ρ_it, 1 − ε, 1 + ε_high)·A_i) + β·k_it        use_bias_correction_kl=False

The ρ·k form is TRL 1.16's default (`use_bias_correction_kl=True`, from DeepSeek-V3.2): the ratio is
differentiable, so it changes the KL gradient even on-policy where its value is 1 (the unbiased
reverse-KL gradient); without it the k3 gradient is biased for samples of the old policy.

A response mask `[T]` (1: a token the policy wrote; 0: a tool or environment token it only reads, or
a whole truncated response masked out) removes tokens from the loss, from the sequence-level ratio's
mean and, through the lengths the caller passes, from the normalizer.

The batch loss is Σ_i Σ_t scale_i · mask_it · l_it, where `scale_i` comes from the loss type's
normalizer (`Normalizer`), computed from all responses' unmasked token counts *before* the first
backward, so that backpropagating each response on its own (serial replay) gives the gradient of the
batched loss exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class Normalizer:
    """Per-response scales `scale[i]`: the batch loss is Σ_i scale[i] · Σ_t l_it.

    lengths: unmasked completion tokens of each response (0 for a masked truncated one);
    groups: the prompt group of each response; max_completion_length: the sampling budget.
    """

    scales: tuple[float, ...]
    description: str

    def __getitem__(self, i: int) -> float:
        return self.scales[i]

    def __len__(self) -> int:
        return len(self.scales)


@dataclass(frozen=True)
class TokenStats:
    """Per-token diagnostics of one response (no grad): clipped flags and KL, as TRL logs them."""

    low_clipped: torch.Tensor
    high_clipped: torch.Tensor
    kl: torch.Tensor | None


@dataclass(frozen=True)
class GRPOLoss:
    """loss_type="grpo": each response's token mean, averaged over responses.

    scale_i = 1 / (max(|o_i|, 1) · N). Favours short responses per token (the length bias Dr. GRPO
    removes); kept for compatibility with the original GRPO.
    """

    epsilon: float = 0.2
    #: upper clip ε_high (DAPO's "clip higher"); None means ε.
    epsilon_high: float | None = None
    #: KL coefficient against the reference policy (k3 estimator); 0 skips the reference entirely.
    beta: float = 0.0
    importance_sampling_level: str = "token"
    #: multiply the per-token KL by the importance ratio ρ (TRL 1.16's default); False: plain k3.
    use_bias_correction_kl: bool = True
    loss_type: str = field(default="grpo", init=False)

    def __post_init__(self):
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"epsilon must be in [0, 1); got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ValueError(f"epsilon_high must be >= 0; got {self.epsilon_high}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0; got {self.beta}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}; "
                f"got {self.importance_sampling_level!r}"
            )

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    # ------------------------------------------------------------------ normalizer
    def normalizer(self, lengths: list[int], groups: list[int], max_completion_length: int) -> Normalizer:
        """Per-response scales for this loss type (see the class docstring)."""
        check_batch(lengths, groups, max_completion_length)
        n = len(lengths)
        return Normalizer(tuple(1.0 / (max(l, 1) * n) for l in lengths), f"grpo: 1/(|o_i|·{n})")

    # ------------------------------------------------------------------ per token
    def per_token(
        self, logps, old_logps, advantage, ref_logps=None, mask=None, is_weight=None
    ) -> tuple[torch.Tensor, TokenStats]:
        """l_t `[T]` for one response and its diagnostics. `advantage` is a float or 0-d tensor; `mask` `[T]`
        (None: all ones) only matters here for the sequence-level ratio, a mean over unmasked tokens. `is_weight`
        `[T]` (no grad): an external sampler's importance-sampling correction
        (`longstraw.losses.sampler_correction`), multiplying the surrogate before the KL term is added, as TRL does."""
        log_ratio = logps - old_logps
        if self.importance_sampling_level == "sequence":
            m = torch.ones_like(logps) if mask is None else mask.to(logps.dtype)
            log_ratio = ((log_ratio * m).sum() / m.sum().clamp(min=1.0)).expand_as(logps)
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon, 1 + self.eps_high)
        adv = torch.as_tensor(advantage, dtype=logps.dtype, device=logps.device)
        loss = -torch.minimum(coef_1 * adv, coef_2 * adv)
        if is_weight is not None:
            loss = loss * is_weight.to(loss.dtype)
        kl = None
        if self.beta != 0.0:
            if ref_logps is None:
                raise ValueError("beta > 0 needs the reference policy's log-probs (ref_logps)")
            d = ref_logps - logps
            kl = torch.exp(d) - d - 1
            if self.use_bias_correction_kl:
                kl = kl * coef_1
            loss = loss + self.beta * kl
        with torch.no_grad():
            stats = TokenStats(
                low_clipped=(coef_1 < 1 - self.epsilon) & (adv < 0),
                high_clipped=(coef_1 > 1 + self.eps_high) & (adv > 0),
                kl=None if kl is None else kl.detach(),
            )
        return loss, stats

    def response_loss(self, logps, old_logps, advantage, scale: float, ref_logps=None, mask=None, is_weight=None):
        """scale · Σ_t mask_t · l_t: one response's share of the batch loss (`mask` `[T]`, None: all ones;
        `is_weight` as `per_token`)."""
        loss, stats = self.per_token(logps, old_logps, advantage, ref_logps, mask, is_weight)
        if mask is not None:
            loss = loss * mask.to(loss.dtype)
        return loss.sum() * scale, stats


def check_batch(lengths, groups, max_completion_length) -> None:
    if len(lengths) == 0:
        raise ValueError("empty batch: no responses to normalize over")
    if len(groups) != len(lengths):
        raise ValueError(f"groups has {len(groups)} entries for {len(lengths)} responses")
    if max_completion_length < 1 or any(l < 0 or l > max_completion_length for l in lengths):
        raise ValueError(f"lengths must lie in [0, max_completion_length={max_completion_length}]; got {lengths}")
