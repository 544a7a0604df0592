"""The GRPO loss family: serial per-response accumulation equals the batched loss from the formulas."""

import itertools

import pytest
import torch

from longstraw.losses import LOSS_TYPES, combine_rewards, group_advantages, make_loss
from longstraw.losses.reference import batched_loss

from ..conftest import rel_err

OPTIONS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(epsilon=0.1, epsilon_high=0.28), id="clip-higher"),
    pytest.param(dict(beta=0.04), id="kl-bias-corrected"),
    pytest.param(dict(beta=0.04, use_bias_correction_kl=False), id="kl-plain-k3"),
    pytest.param(dict(importance_sampling_level="sequence", beta=0.1), id="sequence-level-kl"),
]

LENGTHS = [3, 12, 7, 1, 12, 5]
GROUPS = [0, 0, 0, 1, 1, 1]
LMAX = 12

EPS = torch.finfo(torch.float32).eps
#: serial against batched loss (float32), relative: epsilon × 2^4. Each side reduces the same ≤ 6 × 12 = 72
#: per-token terms (ratios, clipping, KL) in its own order and grouping: √72 ≈ 8.5 ≤ 2^4 at random
LOSS_TOL = EPS * 2**4
#: per-token gradients, norm-wise relative per response: 4 × more, for terms that cancel (1 − e^(ref − lp) in the
#: KL's gradient, the clipped branches' ratio × advantage) and the normalizer's scale taken in another order
GRAD_TOL = LOSS_TOL * 4


def _batch(seed: int, lengths, truncated, mask_truncated: bool, env_tokens: bool, shift: float = 0.0):
    """Per-response leaves, old/ref log-probs near them (some ratios clip), advantages, and masks `[T]`:
    zeros for a masked truncated response, zeros on a few "environment" tokens with `env_tokens`."""
    g = torch.Generator().manual_seed(seed)
    logps = [(-torch.rand(l, generator=g) * 3).requires_grad_() for l in lengths]
    old = [(lp.detach() + 0.3 * torch.randn(l, generator=g)) for lp, l in zip(logps, lengths)]
    ref = [(lp.detach() + 0.5 * torch.randn(l, generator=g)) for lp, l in zip(logps, lengths)]
    adv = torch.randn(len(lengths), generator=g)
    old = [o + shift * torch.randn((), generator=g) for o in old]  # whole-response drift (sequence-level clipping)
    masks = []
    for l, t in zip(lengths, truncated):
        m = torch.zeros(l) if (t and mask_truncated) else torch.ones(l)
        if env_tokens and l > 3:
            m[1:3] = 0.0  # two tool-output tokens in the middle of the response
        masks.append(m)
    return logps, old, ref, adv, masks


def _pad(xs, value=0.0):
    return torch.stack([torch.nn.functional.pad(x, (0, LMAX - x.numel()), value=value) for x in xs])


def _serial(loss_fn, logps, old, ref, adv, masks):
    """The production path: the normalizer from unmasked counts first, then one backward per response."""
    norm = loss_fn.normalizer([int(m.sum()) for m in masks], GROUPS, max_completion_length=LMAX)
    total = 0.0
    for i in range(len(logps)):
        part, _ = loss_fn.response_loss(logps[i], old[i], adv[i], norm[i], ref_logps=ref[i], mask=masks[i])
        part.backward()
        total += part.item()
    return total, [lp.grad.clone() for lp in logps]


def _assert_grads_equal(got, want, tol=GRAD_TOL):
    for a, b in zip(got, want):
        if b.abs().max() == 0:
            assert a.abs().max() == 0
        else:
            assert rel_err(a, b) <= tol


@pytest.mark.parametrize("masks", ["keep-truncated", "mask-truncated", "env-tokens"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_serial_accumulation_equals_batched_reference(loss_type, options, masks):
    truncated = [False, True, False, False, True, False]
    logps, old, ref, adv, m = _batch(7, LENGTHS, truncated, masks == "mask-truncated", masks == "env-tokens")
    total, serial_grads = _serial(make_loss(loss_type, **options), logps, old, ref, adv, m)

    leaf = [lp.detach().clone().requires_grad_() for lp in logps]
    # padding and masked positions must not matter: finite junk there
    junk = (1 - _pad(m)) * -0.5
    batched = batched_loss(loss_type, _pad(leaf) + junk, _pad(old), adv, _pad(m), ref_logps=_pad(ref),
                           max_completion_length=LMAX, group_ids=GROUPS, **options)
    batched.backward()
    assert abs(total - batched.item()) <= LOSS_TOL * abs(batched.item())
    _assert_grads_equal(serial_grads, [x.grad for x in leaf])


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_batched_reference_and_serial_equal_trl_compute_loss(tmp_path, loss_type, options):
    """TRL 1.16's `_compute_loss` on the same per-token log-probs, old log-probs, advantages and masks
    (tool-output tokens as TRL's `tool_mask`). TRL's bnpo is one token mean over its micro-batch: the
    same as longstraw's per-group bnpo when the batch is one group."""
    from ..trl_oracle import trl_config, trl_loss

    truncated = [False] * len(LENGTHS)
    logps, old, ref, adv, m = _batch(11, LENGTHS, truncated, False, env_tokens=True, shift=0.5)
    groups = [0] * len(LENGTHS) if loss_type == "bnpo" else GROUPS
    loss_fn = make_loss(loss_type, **options)
    norm = loss_fn.normalizer([int(x.sum()) for x in m], groups, max_completion_length=LMAX)
    total = 0.0
    for i in range(len(logps)):
        part, stats = loss_fn.response_loss(logps[i], old[i], adv[i], norm[i], ref_logps=ref[i], mask=m[i])
        part.backward()
        total += part.item()
    clipped = sum(int((s := loss_fn.per_token(logps[i], old[i], adv[i], ref[i], m[i])[1]).low_clipped.sum()
                      + s.high_clipped.sum()) for i in range(len(logps)))
    assert clipped > 0  # clipping is active: the test covers both branches of the surrogate

    args = trl_config(tmp_path, loss_type=loss_type, max_completion_length=LMAX, **options)
    leaf = _pad([lp.detach() for lp in logps]).requires_grad_()
    completion = _pad([torch.ones(l) for l in LENGTHS])
    tool_mask = _pad(m, value=1.0)  # TRL pads tool_mask with 1; the completion mask zeroes padding
    trl = trl_loss(args, lambda: (leaf, torch.zeros_like(leaf)), completion, adv, _pad(old), _pad(ref), tool_mask)
    trl.backward()
    assert abs(total - trl.item()) <= LOSS_TOL * abs(trl.item())
    trl_grads = [leaf.grad[i, :l] for i, l in enumerate(LENGTHS)]
    _assert_grads_equal([lp.grad for lp in logps], trl_grads)


@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 1.5)], ids=["trl-default-clip", "both-bounds"])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sampler_correction_equals_trl_with_vllm(tmp_path, loss_type, mode, clip):
    """An external sampler's importance-sampling correction (`SamplerCorrection`, per response) gives TRL 1.16's
    `_compute_loss` run as with vLLM and its correction on, over the same batch (tool tokens masked out of the ratio as
    TRL's `tool_mask` masks them), for every mode; the sampler's log-probs drawn so that the truncation or the mask
    acts (checked), so a rule applied on the wrong side, or not at all, fails."""
    from longstraw.losses.sampler_correction import SamplerCorrection

    from ..trl_oracle import trl_config, trl_is_ratio, trl_loss

    truncated = [False] * len(LENGTHS)
    logps, old, ref, adv, m = _batch(13, LENGTHS, truncated, False, env_tokens=True, shift=0.5)
    g = torch.Generator().manual_seed(5)
    scale = 0.7 if mode.startswith("sequence") else 0.8  # a sequence's ratio sums its tokens' differences
    sampler = [o + scale * torch.randn(o.shape, generator=g) for o in old]
    correction = SamplerCorrection(mode, *clip)
    loss_fn = make_loss(loss_type, beta=0.04)
    norm = loss_fn.normalizer([int(x.sum()) for x in m], GROUPS, max_completion_length=LMAX)
    total, changed = 0.0, 0
    for i in range(len(logps)):
        w = correction.weights(old[i], sampler[i], m[i])
        changed += correction.stats(old[i], sampler[i], m[i])["changed"]
        part, _ = loss_fn.response_loss(logps[i], old[i], adv[i], norm[i], ref_logps=ref[i], mask=m[i], is_weight=w)
        part.backward()
        total += part.item()
    assert changed > 0, "the clip / mask never acted: the test would not see it misapplied"

    args = trl_config(tmp_path, loss_type=loss_type, max_completion_length=LMAX, beta=0.04,
                      vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip[0],
                      vllm_importance_sampling_clip_max=clip[1])
    leaf = _pad([lp.detach() for lp in logps]).requires_grad_()
    completion = _pad([torch.ones(l) for l in LENGTHS])
    tool_mask = _pad(m, value=1.0)
    ratio = trl_is_ratio(args, _pad(old), _pad(sampler), completion, tool_mask)
    trl = trl_loss(args, lambda: (leaf, torch.zeros_like(leaf)), completion, adv, _pad(old), _pad(ref), tool_mask,
                   is_ratio=ratio)
    trl.backward()
    assert abs(total - trl.item()) <= LOSS_TOL * abs(trl.item())
    _assert_grads_equal([lp.grad for lp in logps], [leaf.grad[i, :l] for i, l in enumerate(LENGTHS)])


def test_sampler_correction_settings_are_validated():
    from longstraw.losses.sampler_correction import SamplerCorrection

    with pytest.raises(ValueError, match="must be one of"):
        SamplerCorrection("token")
    with pytest.raises(ValueError, match="clip_min 2.0 > clip_max 1.0"):
        SamplerCorrection("token_mask", 2.0, 1.0)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_duplicating_the_batch_leaves_the_loss_unchanged(loss_type):
    """Every loss type is a mean (over tokens, responses or groups, or a fixed N · L for dr_grpo): the same
    batch twice, as two more groups, gives the same loss. A normalizer that forgets a factor of N, of the
    token count or of the group count fails this."""
    truncated = [False] * len(LENGTHS)
    logps, old, ref, adv, m = _batch(5, LENGTHS, truncated, False, env_tokens=True)
    loss_fn = make_loss(loss_type, beta=0.1)

    def parts(copies):
        n = len(LENGTHS)
        lengths = [int(x.sum()) for x in m] * copies
        groups = [g + 2 * c for c in range(copies) for g in GROUPS]
        norm = loss_fn.normalizer(lengths, groups, LMAX)
        return [float(loss_fn.response_loss(logps[i % n], old[i % n], adv[i % n], norm[i], ref_logps=ref[i % n],
                                            mask=m[i % n])[0].detach()) for i in range(copies * n)]

    twice = parts(2)
    one, two = sum(parts(1)), sum(twice)
    assert abs(one) > 1e-3  # not a loss that cancels to about 0, where a relative check would say nothing
    # twice the batch doubles N, the token count and the group count: every scale is exactly half (a power of two), so
    # is every float32 part, and the sums differ only by float64's rounding of the additions: ≤ 12 of ≤ eps/2 of
    # Σ |parts| each, × 2 to spare
    assert abs(one - two) <= 12 * torch.finfo(torch.float64).eps * sum(map(abs, twice))


def test_normalizers_are_what_their_names_say():
    lengths, groups = [2, 4, 6, 0], [0, 0, 1, 1]
    assert make_loss("dapo").normalizer(lengths, groups, 8).scales == (1 / 12,) * 4
    assert make_loss("dr_grpo").normalizer(lengths, groups, 8).scales == (1 / 32,) * 4
    assert make_loss("grpo").normalizer(lengths, groups, 8).scales == (1 / 8, 1 / 16, 1 / 24, 1 / 4)
    assert make_loss("bnpo").normalizer(lengths, groups, 8).scales == (1 / 12, 1 / 12, 1 / 12, 1 / 12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss_type="ppo"), "loss_type"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(beta=-1.0), "beta"),
        (dict(importance_sampling_level="batch"), "importance_sampling_level"),
    ],
)
def test_bad_loss_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_loss(**kwargs)


def test_beta_needs_reference_logps_and_batch_checks():
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="ref_logps"):
        make_loss(beta=0.1).response_loss(lp, lp, 1.0, 1.0)
    with pytest.raises(ValueError, match="empty"):
        make_loss().normalizer([], [], 4)
    with pytest.raises(ValueError, match="max_completion_length"):
        make_loss().normalizer([5], [0], 4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_the_formula(scale):
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, -1.0])
    adv = group_advantages(r, 3, scale)
    expected = []
    for i, j in itertools.product(range(2), range(3)):
        grp = r[3 * i : 3 * i + 3]
        a = r[3 * i + j] - grp.mean()
        if scale == "group":
            a = a / (grp.std() + 1e-4)
        elif scale == "batch":
            a = a / (r.std() + 1e-4)
        expected.append(a)
    torch.testing.assert_close(adv, torch.stack(expected))
    # zero mean per group to float32's rounding: the group mean's (≤ eps of the largest reward, over a std ≥ half of
    # it here), carried into 3 advantages, then the differences, the scaling and the 3-term sum: ≤ 2^3 epsilons of
    # the largest |advantage|
    assert torch.allclose(adv.view(2, 3).sum(1), torch.zeros(2), atol=2**3 * EPS * adv.abs().max().item(), rtol=0)


def test_combined_rewards_skip_nan():
    per_f = torch.tensor([[1.0, float("nan")], [0.5, 2.0]])
    torch.testing.assert_close(combine_rewards(per_f, [2.0, 0.5]), torch.tensor([2.0, 2.0]))
