"""compute_advantages (docs/spec.md section 3) vs the naive reference and hand-computed values."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference.naive import naive_advantages  # noqa: E402


def adv(rewards, gidx, mode, perturb=False, **kw):
    from megapkl.objectives.advantages import compute_advantages
    return compute_advantages(torch.as_tensor(rewards, dtype=torch.float64), torch.as_tensor(gidx, dtype=torch.int64),
                              mode=mode, perturb_baseline=perturb, **kw)


def test_group_mean_hand():
    got = adv([1, -1, -1, -1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1], "group_mean")
    assert got.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], abs=1e-15)


def test_group_std_hand_sample_std():
    # rewards 1/0, G = 4 with one correct: mean .25, s = sqrt((.75^2 + 3 * .25^2) / 3) = 0.5
    got = adv([1, 0, 0, 0], [0, 0, 0, 0], "group_std")
    s = 0.5
    assert got.tolist() == pytest.approx([0.75 / (s + 1e-5)] + [-0.25 / (s + 1e-5)] * 3, rel=1e-14)
    # population std (G denominator) would give sqrt(.1875) = .433: must not be used
    assert got[0].item() != pytest.approx(0.75 / (math.sqrt(0.1875) + 1e-5), rel=1e-6)


def test_group_std_eps_and_constant_group():
    got = adv([1, 1, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1], "group_std", std_eps=0.5)
    s = math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    assert got[3:].tolist() == pytest.approx([-(1 / 3) / (s + 0.5)] * 2 + [(2 / 3) / (s + 0.5)], rel=1e-14)


def test_raw():
    got = adv([0.3, -2.0, 5.0], [0, 0, 1], "raw")
    assert got.tolist() == [0.3, -2.0, 5.0]


@pytest.mark.parametrize("mode", ["group_mean", "group_std", "raw"])
def test_perturb_baseline_only_nonconstant_groups_after_normalization(mode):
    r = [1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 2, 0, 1, 1]
    g = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    base = adv(r, g, mode)
    pert = adv(r, g, mode, perturb=True)
    shift = (pert - base).tolist()
    assert shift == pytest.approx([1] * 4 + [0] * 8 + [1] * 4, abs=1e-14)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", ["group_mean", "group_std", "raw"])
@pytest.mark.parametrize("perturb", [False, True])
def test_matches_reference_random(seed, mode, perturb):
    gen = torch.Generator().manual_seed(seed)
    M = 30
    # uneven, non-contiguous group ids, including singletons
    gidx = torch.randint(0, 9, (M,), generator=gen) * 7 + 3
    if seed % 2:
        rewards = torch.randint(0, 2, (M,), generator=gen).double()
    else:
        rewards = torch.randn(M, generator=gen, dtype=torch.float64)
    got = adv(rewards, gidx, mode, perturb)
    ref = naive_advantages(rewards, gidx, mode, perturb_baseline=perturb)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(ref, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("mode", ["group_mean", "group_std"])
def test_single_member_group_gives_zero(mode):
    """G = 1: the group mean is the reward itself; the sample std is undefined -> advantage 0 (our
    definition for group_std), finite, never NaN/inf."""
    got = adv([3.0, 1.0, 0.0, 1.0], [5, 6, 6, 7], mode)
    assert bool(torch.isfinite(got).all())
    assert got[0].item() == 0.0 and got[3].item() == 0.0
    got = adv([3.0, 1.0], [5, 6], mode, perturb=True)
    assert got.tolist() == [0.0, 0.0]  # a one-member group is constant: no shift


def test_float32_rewards_keep_dtype_and_int_rewards_work():
    got = adv(torch.tensor([1.0, 0.0, 0.0, 1.0]), [0, 0, 1, 1], "group_std")
    from megapkl.objectives.advantages import compute_advantages
    g32 = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float32), torch.tensor([0, 0, 1, 1]),
                             mode="group_std")
    assert g32.dtype == torch.float32
    torch.testing.assert_close(g32.double(), got, rtol=1e-6, atol=1e-6)
    gi = compute_advantages(torch.tensor([1, 0, 0, 1]), torch.tensor([0, 0, 1, 1]), mode="group_mean")
    assert gi.is_floating_point()
    assert gi.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
