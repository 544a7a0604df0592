"""verl's names for the importance-sampling correction of an external sampler, read as TRL's.

A config (YAML or dict, `TrainConfig.from_dict`) may name the correction as verl's `algorithm` section does (verl
0.6: `rollout_is`, `rollout_is_threshold`, `rollout_is_threshold_lower`, `rollout_is_level`, `rollout_is_mode`,
`rollout_is_veto_threshold`); they are translated to TRL's `vllm_importance_sampling_*` fields, with verl's meaning
where the two differ:

- `rollout_is_level` (token | sequence) and `rollout_is_mode` (truncate | mask; `clip`, verl's older name of mask)
  make TRL's mode `<level>_<mode>`; verl's defaults are token and truncate. The `geometric` level is refused.
- truncate in verl caps the ratio at the upper threshold only (TIS): `clip_max` = `rollout_is_threshold`, no lower
  bound. mask keeps tokens whose ratio is within [lower, upper], and a missing lower threshold is verl's reciprocal
  1 / upper (TRL's missing bound is no bound): `clip_min` = `rollout_is_threshold_lower` or 1 / upper.
- `rollout_is` (bool) is `vllm_importance_sampling_correction`; `rollout_is_threshold` is 2.0 when absent (the value
  of verl's example configs).
- `rollout_is_veto_threshold` (a sequence dropped when any token's ratio falls below it) is not built: refused when
  set.
A config that names a setting both ways is refused.
"""

from __future__ import annotations

from typing import Any

VERL_FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_threshold_lower",
    "rollout_is_level",
    "rollout_is_mode",
    "rollout_is_veto_threshold",
)
_TRL_FIELDS = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)


def from_verl(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with verl's correction fields replaced by TRL's (see the module doc); unchanged without them."""
    verl = {k: values[k] for k in VERL_FIELDS if k in values}
    if not verl:
        return values
    both = [k for k in _TRL_FIELDS if k in values]
    if both:
        raise ValueError(f"config: the sampler correction named both as verl ({sorted(verl)}) and as TRL ({both})")
    if verl.get("rollout_is_veto_threshold") is not None:
        raise ValueError("config: rollout_is_veto_threshold (verl's veto of a sequence) is not built; leave it null")
    level = verl.get("rollout_is_level", "token")
    mode = {"clip": "mask"}.get(verl.get("rollout_is_mode", "truncate"), verl.get("rollout_is_mode", "truncate"))
    if level not in ("token", "sequence"):
        raise ValueError(f"config: rollout_is_level {level!r}: token or sequence (verl's geometric is not built)")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"config: rollout_is_mode {verl['rollout_is_mode']!r}: truncate or mask")
    out = {k: v for k, v in values.items() if k not in VERL_FIELDS}
    upper = verl.get("rollout_is_threshold", 2.0)
    out["vllm_importance_sampling_mode"] = f"{level}_{mode}"
    out["vllm_importance_sampling_clip_max"] = upper
    if mode == "truncate":
        out["vllm_importance_sampling_clip_min"] = None
    else:
        lower = verl.get("rollout_is_threshold_lower")
        out["vllm_importance_sampling_clip_min"] = lower if lower is not None or upper is None else 1.0 / upper
    if "rollout_is" in verl:
        out["vllm_importance_sampling_correction"] = bool(verl["rollout_is"])
    return out
