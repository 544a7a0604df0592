"""verl's names of the sampler correction (`longstraw.train.verl_names`), held to verl's rule written out here: truncate
caps the ratio at the upper threshold (no lower bound); mask keeps a token whose ratio is within [lower, upper],
lower defaulting to 1 / upper; token level: each token's ratio, sequence level: the product over the response."""

import math

import pytest
import torch

from longstraw.losses.sampler_correction import SamplerCorrection
from longstraw.train.config import TrainConfig


def _verl_weights(old, sampler, level, mode, upper, lower=None):
    d = old - sampler
    ratio = torch.exp(d.sum()).expand_as(d) if level == "sequence" else torch.exp(d)
    if mode == "truncate":
        return torch.clamp(ratio, max=upper)
    lower = 1.0 / upper if lower is None else lower
    return torch.where((ratio >= lower) & (ratio <= upper), ratio, torch.zeros_like(ratio))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "clip"])
@pytest.mark.parametrize("lower", [None, 0.2])
def test_verl_names_weight_tokens_as_verl_does(level, mode, lower):
    values = dict(model="llama", rollout_is=True, rollout_is_threshold=1.5, rollout_is_level=level,
                  rollout_is_mode=mode)
    if lower is not None:
        values["rollout_is_threshold_lower"] = lower
    cfg = TrainConfig.from_dict(values)
    assert cfg.vllm_importance_sampling_correction is True
    correction = SamplerCorrection(cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_min,
                                   cfg.vllm_importance_sampling_clip_max)
    # ratios from 0.05 to 20: below and above both bounds, and inside them
    old = torch.log(torch.tensor([0.05, 0.3, 0.6, 1.0, 1.4, 2.5, 20.0]))
    sampler = torch.zeros_like(old)
    for shift in (0.0, -0.4) if level == "sequence" else (0.0,):  # a sequence ratio inside and outside the bounds
        o = old + shift / old.numel() - (old.sum() / old.numel() if level == "sequence" else 0.0)
        want = _verl_weights(o, sampler, level, "mask" if mode == "clip" else mode, 1.5, lower)
        got = correction.weights(o, sampler)
        assert torch.allclose(got, want, rtol=1e-6), (got, want)


def test_verl_names_refused_where_not_built_or_named_twice():
    with pytest.raises(ValueError, match="geometric"):
        TrainConfig.from_dict(dict(model="llama", rollout_is_level="geometric"))
    with pytest.raises(ValueError, match="veto"):
        TrainConfig.from_dict(dict(model="llama", rollout_is_veto_threshold=1e-4))
    with pytest.raises(ValueError, match="both as verl"):
        TrainConfig.from_dict(dict(model="llama", rollout_is_threshold=2.0, vllm_importance_sampling_clip_max=3.0))
    cfg = TrainConfig.from_dict(dict(model="llama", rollout_is_mode="mask", rollout_is_threshold=4.0))
    assert cfg.vllm_importance_sampling_mode == "token_mask"
    assert math.isclose(cfg.vllm_importance_sampling_clip_min, 0.25) and cfg.vllm_importance_sampling_clip_max == 4.0
    assert TrainConfig.from_dict(dict(model="llama")).vllm_importance_sampling_mode == "sequence_mask"  # TRL's
