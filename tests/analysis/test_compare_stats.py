"""Statistics of `megapkl compare` against hand-computed values, and the coverage of the interval
the verdicts use (the paired t interval) at the seed counts a comparison has."""
import math

import numpy as np
import pytest

from megapkl.analysis import compare_stats as st

T975_DF3 = 3.182446305284263  # Student t 0.975 quantile, 3 degrees of freedom (tables)


def t3_cdf(t: float) -> float:
    """Closed form of the Student t CDF with 3 degrees of freedom."""
    x = t / math.sqrt(3)
    return 0.5 + (x / (1 + x * x) + math.atan(x)) / math.pi


def test_paired_t_by_hand():
    # d = a - b = [1, 0, 2, 1]: mean 1, sd sqrt(2/3), se sd / 2, t = sqrt(6), df 3
    r = st.paired_t([1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 1.0, 3.0])
    sd = math.sqrt(2 / 3)
    assert r.diff == 1.0 and r.n == 4
    assert r.sd == pytest.approx(sd, rel=1e-12)
    assert r.effect == pytest.approx(1 / sd, rel=1e-12)
    half = T975_DF3 * sd / 2
    assert (r.low, r.high) == (pytest.approx(1 - half, rel=1e-9), pytest.approx(1 + half, rel=1e-9))
    assert r.p == pytest.approx(2 * (1 - t3_cdf(math.sqrt(6))), rel=1e-9)  # 0.0917
    assert r.boot_low <= 1.0 <= r.boot_high and r.low < r.boot_low  # BCa: narrower at n = 4


def test_pairing_uses_the_seed():
    # the same numbers unpaired would not separate; paired, every seed moves by +0.125 (exact)
    a = [0.5, 1.0, 0.75, 0.25, 0.375]
    b = [x - 0.125 for x in a]
    r = st.paired_t(a, b)
    assert (r.diff, r.low, r.high, r.p, r.effect) == (0.125, 0.125, 0.125, 0.0, math.inf)
    shuffled = st.paired_t(a, [b[i] for i in (3, 0, 4, 1, 2)])
    assert shuffled.p > 0.5
    assert st.paired_t([0.2, 0.4], [0.2, 0.4]).p == 1.0
    with pytest.raises(ValueError, match="one per seed"):
        st.paired_t([1.0, 2.0, 3.0], [1.0, 2.0])


def test_t_interval_by_hand():
    iv = st.t_interval([1.0, 2.0, 3.0, 4.0])  # mean 2.5, sd sqrt(5/3)
    half = T975_DF3 * math.sqrt(5 / 3) / 2
    assert (iv.mean, iv.low, iv.high) == (2.5, pytest.approx(2.5 - half), pytest.approx(2.5 + half))


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4 x 0.005, 3 x 0.01, 2 x 0.03, max(0.06, 1 x 0.04)
    assert st.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert st.holm([0.5, 0.6]) == [1.0, 1.0]
    assert st.holm([0.02]) == [0.02]


def test_diff_in_diff_by_hand():
    # per seed: A changes by -0.1, -0.2, 0.0; B by -0.3, -0.3, -0.3; contrast 0.2, 0.1, 0.3
    r = st.diff_in_diff([0.8, 0.6, 0.9], [0.9, 0.8, 0.9], [0.5, 0.4, 0.6], [0.8, 0.7, 0.9])
    assert r.diff == pytest.approx(0.2) and r.sd == pytest.approx(0.1)
    ref = st.paired_t([0.2, 0.1, 0.3], [0.0, 0.0, 0.0])
    assert (r.low, r.high, r.p) == (pytest.approx(ref.low), pytest.approx(ref.high), pytest.approx(ref.p))


def test_aggregates_by_hand():
    assert st.iqm([1, 2, 3, 4, 5, 6, 7, 100]) == 4.5          # mean of 3, 4, 5, 6
    # a vs b: 1 beats 0; 2 beats 0, ties 2; 3 beats 0 and 2 -> (1 + 1.5 + 2) / 9
    assert st.prob_improvement([1, 2, 3], [0, 2, 5]) == pytest.approx(0.5)
    assert st.prob_improvement([5, 6], [1, 2]) == 1.0


def test_reach_summary_censors_runs_that_never_reach():
    # Kaplan-Meier: S(10) = 3/4, S(20) = 2/4 -> median 20; the censored run is not averaged as 101
    assert st.reach_summary([10, None, 30, 20], [100] * 4) == {"reached": 3, "n": 4, "median": 20.0}
    assert st.reach_summary([10, None, None, None], [100] * 4)["median"] is None
    assert st.reach_summary([None, None], [50, 50]) == {"reached": 0, "n": 2, "median": None}


def test_reach_summary_finds_a_median_where_survival_rounds_above_one_half():
    # TETPO at tetpo_u16: S(140) = 9/10, S(150) = 9/10 * 7/9, S(160) = 9/10 * 7/9 * 5/7 = 1/2,
    # which scipy's product gives as 0.5000000000000001: the median is 160, not "not reached"
    reached = [150, None, None, None, 160, None, 160, None, 140, 150]
    assert st.reach_summary(reached, [200] * 10) == {"reached": 5, "n": 10, "median": 160.0}
    # a survival truly above 1/2 (4/7 after three of seven runs) is not taken for the median
    assert st.reach_summary([10, 20, 30, None, None, None, None], [100] * 7)["median"] is None


def test_run_curve_summaries_by_hand():
    assert st.ema([1.0, 0.0, 0.0], 0.5).tolist() == [1.0, 0.5, 0.25]
    assert st.first_reaching([0.1, 0.95, 0.2], 0.9) == 1 and st.first_reaching([0.1], 0.9) is None
    assert st.collapsed([0.0, 1.0, 0.5], 0.3) and not st.collapsed([0.0, 1.0, 0.5, 0.9], 0.3)
    mean, low, high = st.curve_band(np.array([[0.0, 1.0], [1.0, 1.0]]))
    assert mean.tolist() == [0.5, 1.0] and low[1] == high[1] == 1.0
    half = 12.706204736174704 * math.sqrt(0.5) / math.sqrt(2)  # t 0.975, 1 df
    assert (low[0], high[0]) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))


@pytest.mark.parametrize("n", [5, 10])
def test_paired_t_interval_covers_at_its_level(n):
    """Normal paired data with a known mean difference: the 95% paired t interval covers it in
    >= 93% of 2000 simulated comparisons (binomial s.e. 0.5%); a percentile or BCa bootstrap
    covers about 0.83 at n = 5 in the same simulation."""
    rng = np.random.default_rng(n)
    reps, covered = 2000, 0
    for _ in range(reps):
        shared = rng.normal(0.5, 0.2, n)                   # the seed's effect on both methods
        a = shared + 0.07 + rng.normal(0, 0.05, n)
        b = shared + rng.normal(0, 0.05, n)
        r = st.paired_t(a, b, bootstrap=False)
        covered += r.low <= 0.07 <= r.high
    assert covered / reps >= 0.93
