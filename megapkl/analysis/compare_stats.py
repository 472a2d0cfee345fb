"""Statistics for comparing methods over seeds, paired by seed.

A seed fixes the model initialisation, the data order and the sampling, so the runs of two methods
with the same seed are correlated: every difference between methods is taken per seed and analysed
as one sample of n paired differences.

- `paired_t`: mean difference, its Student-t interval and two-sided p-value (scipy.stats.ttest_rel),
  the standardised effect d_z = mean / sd, and a BCa bootstrap interval of the mean difference
  (scipy.stats.bootstrap) printed beside it. Verdicts use the t test: at n = 5-10 the percentile
  and BCa bootstraps cover less than their nominal level (they cannot show more spread than the
  seeds they saw), the t interval covers at its level on normal data.
- `holm`: Holm's step-down adjustment of the p-values of one declared family of comparisons.
- `diff_in_diff`: "A degrades less than B as X grows" as a paired test of the per-seed contrast
  (A_hi - A_lo) - (B_hi - B_lo) against 0.
- `t_interval`: one method's mean with its t interval (tables and curve bands).
- `iqm`, `prob_improvement`: the aggregates of Agarwal et al. (2021, rliable): the interquartile
  mean and P(a run of A beats a run of B) (the Mann-Whitney U statistic / (n m), ties count 1/2).
- `reach_summary`: updates to a threshold as "k of n reached" and the Kaplan-Meier median with runs
  that never reach it censored at their length (scipy.stats.ecdf), not averaged as a made-up value.
- `collapsed`: a run whose smoothed curve ends more than `drop` below its best (it fell and did not
  recover).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95
N_BOOT = 9999
KM_TOL = 1e-9    # slack of the Kaplan-Meier median's S(t) <= 1/2 (see reach_summary)


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


@dataclass(frozen=True)
class PairedTest:
    """mean(a - b) over seeds with its t interval, p-value, effect size and bootstrap interval."""

    diff: float
    low: float
    high: float
    p: float
    n: int
    sd: float
    effect: float          # d_z = mean / sd of the differences (inf when sd = 0 and diff != 0)
    boot_low: float
    boot_high: float

    def row(self) -> dict:
        return {"diff": self.diff, "low": self.low, "high": self.high, "p": self.p, "n": self.n,
                "sd": self.sd, "effect": self.effect, "boot_low": self.boot_low,
                "boot_high": self.boot_high}


def _array(x: Sequence[float], what: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or len(a) < 2:
        raise ValueError(f"{what}: need at least 2 values, got {len(a)}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what}: values must be finite, got {a.tolist()}")
    return a


def t_interval(x: Sequence[float], *, level: float = LEVEL) -> Interval:
    """mean(x) +- t_{n-1, (1+level)/2} sd / sqrt(n)."""
    a = _array(x, "t interval")
    n, m = len(a), float(a.mean())
    half = stats.t.ppf((1 + level) / 2, n - 1) * a.std(ddof=1) / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def bca_interval(d: Sequence[float], *, level: float = LEVEL, seed: int = 0) -> tuple[float, float]:
    """BCa bootstrap interval of mean(d) (scipy.stats.bootstrap, N_BOOT resamples, seeded);
    a sample without spread has the point interval."""
    a = _array(d, "bootstrap")
    if np.ptp(a) == 0:
        return float(a[0]), float(a[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BCa warns on degenerate jackknife; handled below
        res = stats.bootstrap((a,), np.mean, confidence_level=level, n_resamples=N_BOOT,
                              method="BCa", random_state=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):  # BCa undefined: percentile instead
        q = (1 - level) / 2
        low, high = (float(v) for v in np.quantile(res.bootstrap_distribution, [q, 1 - q]))
    return low, high


def paired_t(a: Sequence[float], b: Sequence[float], *, level: float = LEVEL, seed: int = 0,
             bootstrap: bool = True) -> PairedTest:
    """Paired t test of mean(a - b) = 0; a[i] and b[i] are the same seed. Without `bootstrap`
    the BCa interval is left as NaN (simulations that only need the t interval)."""
    a, b = _array(a, "paired test"), _array(b, "paired test")
    if len(a) != len(b):
        raise ValueError(f"paired test: {len(a)} values against {len(b)} (one per seed each)")
    d = a - b
    n, m, sd = len(d), float(d.mean()), float(d.std(ddof=1))
    if np.allclose(d, d[0], rtol=1e-12, atol=1e-15):
        # every seed moved by the same amount (up to rounding): t is 0/0 or infinite
        return PairedTest(m, m, m, 1.0 if m == 0 else 0.0, n, 0.0,
                          0.0 if m == 0 else math.copysign(math.inf, m), m, m)
    res = stats.ttest_rel(a, b)
    ci = res.confidence_interval(confidence_level=level)
    boot = bca_interval(d, level=level, seed=seed) if bootstrap else (math.nan, math.nan)
    return PairedTest(m, float(ci.low), float(ci.high), float(res.pvalue), n, sd, m / sd, *boot)


def diff_in_diff(a_hi: Sequence[float], a_lo: Sequence[float], b_hi: Sequence[float],
                 b_lo: Sequence[float], *, level: float = LEVEL, seed: int = 0) -> PairedTest:
    """Paired test of (a_hi - a_lo) - (b_hi - b_lo) = 0 per seed: does A change less (or more)
    than B between two settings? Positive: A's value rises more (falls less) than B's."""
    a = _array(a_hi, "a_hi") - _array(a_lo, "a_lo")
    b = _array(b_hi, "b_hi") - _array(b_lo, "b_lo")
    return paired_t(a, b, level=level, seed=seed)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values: the i-th smallest p becomes max_{j <= i} min(1, (m - j + 1) p_(j))
    (1-based j), returned in the input order. Reject at level alpha where adjusted p <= alpha."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def iqm(x: Sequence[float]) -> float:
    """Interquartile mean: the mean of the middle 50% (scipy.stats.trim_mean, 25% cut each side)."""
    return float(stats.trim_mean(np.asarray(x, dtype=np.float64), 0.25))


def prob_improvement(a: Sequence[float], b: Sequence[float]) -> float:
    """P(X > Y) + P(X = Y) / 2 for X a run of A and Y a run of B (rliable's probability of
    improvement for one task): the Mann-Whitney U statistic of a against b over n m."""
    a, b = _array(a, "probability of improvement"), _array(b, "probability of improvement")
    u = stats.mannwhitneyu(a, b, alternative="two-sided").statistic
    return float(u) / (len(a) * len(b))


def reach_summary(updates: Sequence[Optional[float]], lengths: Sequence[float]) -> dict:
    """Updates to a threshold over runs: k of n reached, and the Kaplan-Meier median where runs
    that never reached it are censored at their length (None when fewer than half reached)."""
    reached = [u for u in updates if u is not None]
    censored = [float(t) for u, t in zip(updates, lengths) if u is None]
    out = {"reached": len(reached), "n": len(updates), "median": None}
    if reached:
        sf = stats.ecdf(stats.CensoredData(uncensored=reached, right=censored)).sf
        # Where S(t) is exactly 1/2 scipy's product of (1 - d_i / n_i) can round to 0.5000000000000001
        # (TETPO at tetpo_u16: 0.9 * 7/9 * 5/7), and an exact `<= 0.5` then misses the median. The
        # rounding of a product of at most n factors is below n * 2.3e-16 (< 1e-12 for any run
        # count in use); a survival truly above 1/2 exceeds it by at least 1 / (2 * prod n_i)
        # >= 1 / (2 n!), which is > KM_TOL for n <= 12 runs (10 per arm in the study).
        below = np.nonzero(sf.probabilities <= 0.5 + KM_TOL)[0]
        if len(below):
            out["median"] = float(sf.quantiles[below[0]])
    return out


# ---------------------------------------------------------------- one run's curve

def ema(values: Sequence[float], alpha: float) -> np.ndarray:
    """s_0 = x_0, s_t = alpha x_t + (1 - alpha) s_{t-1} (the papers' smoothing)."""
    out = np.empty(len(values))
    s = None
    for i, x in enumerate(values):
        s = float(x) if s is None else alpha * float(x) + (1 - alpha) * s
        out[i] = s
    return out


def final_value(values: Sequence[float], window: int) -> float:
    """Mean of the raw metric over the last `window` points."""
    return float(np.mean(np.asarray(values, dtype=np.float64)[-window:]))


def area_under_curve(values: Sequence[float]) -> float:
    """Mean of the raw metric over all points (area normalised by the run length)."""
    return float(np.mean(np.asarray(values, dtype=np.float64)))


def first_reaching(smoothed: Sequence[float], threshold: float) -> Optional[int]:
    """Index of the first point of the smoothed curve at or above `threshold`, None if never."""
    for i, s in enumerate(smoothed):
        if s >= threshold:
            return i
    return None


def collapsed(smoothed: Sequence[float], drop: float) -> bool:
    """The smoothed curve ends more than `drop` below its running best: it fell and did not
    recover (a dip it climbs back from is not a collapse)."""
    s = np.asarray(smoothed, dtype=np.float64)
    return bool(len(s) and s.max() - s[-1] > drop)


def curve_band(curves: np.ndarray, *, level: float = LEVEL
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) per point of [seeds, points] curves: the t interval of the mean curve."""
    c = np.asarray(curves, dtype=np.float64)
    n = c.shape[0]
    mean = c.mean(axis=0)
    if n < 2:
        return mean, mean, mean
    half = stats.t.ppf((1 + level) / 2, n - 1) * c.std(axis=0, ddof=1) / math.sqrt(n)
    return mean, mean - half, mean + half
