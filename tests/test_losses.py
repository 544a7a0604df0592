"""The GRPO loss family: serial per-response accumulation equals the batched loss from the formulas."""

import itertools

import pytest
import torch

from longstraw.losses import LOSS_TYPES, combine_rewards, group_advantages, make_loss
from longstraw.losses.reference import batched_loss

from .conftest import rel_err

OPTIONS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(epsilon=0.1, epsilon_high=0.28), id="clip-higher"),
    pytest.param(dict(beta=0.04), id="kl"),
    pytest.param(dict(importance_sampling_level="sequence", beta=0.1), id="sequence-level-kl"),
]


def _batch(seed: int, lengths, truncated, mask_truncated: bool):
    g = torch.Generator().manual_seed(seed)
    n, lmax = len(lengths), 12
    logps = [(-torch.rand(l, generator=g) * 3).requires_grad_() for l in lengths]
    # old/ref close to current so that some ratios clip and some don't
    old = [(lp.detach() + 0.3 * torch.randn(l, generator=g)) for lp, l in zip(logps, lengths)]
    ref = [(lp.detach() + 0.5 * torch.randn(l, generator=g)) for lp, l in zip(logps, lengths)]
    adv = torch.randn(n, generator=g)
    masked = [bool(t and mask_truncated) for t in truncated]
    return logps, old, ref, adv, masked, lmax


@pytest.mark.parametrize("mask_truncated", [False, True], ids=["keep-truncated", "mask-truncated"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_serial_accumulation_equals_batched_reference(loss_type, options, mask_truncated):
    lengths = [3, 12, 7, 1, 12, 5]
    truncated = [False, True, False, False, True, False]
    groups = [0, 0, 0, 1, 1, 1]
    logps, old, ref, adv, masked, lmax = _batch(7, lengths, truncated, mask_truncated)
    loss_fn = make_loss(loss_type, **options)

    # serial: the normalizer first, then one response at a time, each with its own backward
    eff_lengths = [0 if m else l for l, m in zip(lengths, masked)]
    norm = loss_fn.normalizer(eff_lengths, groups, max_completion_length=lmax)
    total = 0.0
    for i in range(len(lengths)):
        mask = torch.zeros(lengths[i]) if masked[i] else None
        part, _ = loss_fn.response_loss(logps[i], old[i], adv[i], norm[i], ref_logps=ref[i], mask=mask)
        part.backward()
        total += part.item()
    serial_grads = [lp.grad.clone() for lp in logps]

    # batched: padded tensors and a completion mask, as TRL computes it
    def pad(xs):
        return torch.stack([torch.nn.functional.pad(x, (0, lmax - x.numel())) for x in xs])

    leaf = [lp.detach().clone().requires_grad_() for lp in logps]
    mask = pad([torch.zeros(l) if m else torch.ones(l) for l, m in zip(lengths, masked)])
    # padding positions must not matter: put finite junk there
    batched = batched_loss(loss_type, pad(leaf) + (1 - pad([torch.ones(l) for l in lengths])) * -0.5,
                           pad(old), adv, mask, ref_logps=pad(ref), max_completion_length=lmax,
                           group_ids=groups, **options)
    batched.backward()
    assert abs(total - batched.item()) <= 1e-5 * max(abs(batched.item()), 1e-6)
    for a, b in zip(serial_grads, [x.grad for x in leaf]):
        if b.abs().max() == 0:
            assert a.abs().max() == 0
        else:
            assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_doubling_the_normalizer_halves_the_loss(loss_type):
    loss_fn = make_loss(loss_type, beta=0.1)
    lp = torch.tensor([-1.0, -2.0, -0.5])
    a, _ = loss_fn.response_loss(lp, lp + 0.1, 0.7, scale=0.25, ref_logps=lp - 0.2)
    b, _ = loss_fn.response_loss(lp, lp + 0.1, 0.7, scale=0.125, ref_logps=lp - 0.2)
    assert torch.isclose(a, 2 * b)


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
    assert torch.allclose(adv.view(2, 3).sum(1), torch.zeros(2), atol=1e-6)  # zero mean per group


def test_combined_rewards_skip_nan():
    per_f = torch.tensor([[1.0, float("nan")], [0.5, 2.0]])
    torch.testing.assert_close(combine_rewards(per_f, [2.0, 0.5]), torch.tensor([2.0, 2.0]))
