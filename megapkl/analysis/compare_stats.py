"""Statistics for comparing methods over seeds: per-run summaries of a learning curve, percentile
bootstrap intervals for a method's mean and for the difference of two methods' means, and a
bootstrap band for the mean curve.

Numpy only. Every interval is a percentile bootstrap: resample the seeds of a method with
replacement, take the mean, and read the (alpha/2, 1 - alpha/2) quantiles of that distribution.
With few seeds the distribution is enumerated exactly (all n^n resamples, equally likely), so the
interval is a deterministic function of the numbers; beyond `EXACT_LIMIT` resamples it is drawn by
Monte Carlo from a fixed seed. Quantiles of a discrete distribution use the inverted CDF: the
q-quantile is the smallest value v with P(X <= v) >= q.

Caveat stated in every report: a percentile bootstrap over 3-5 seeds is narrower than the truth
(it cannot show more spread than the seeds it saw), so an interval that excludes 0 is evidence,
not proof, and one that includes 0 says the seeds cannot separate the methods.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

EXACT_LIMIT = 200_000   # enumerate every resample (or pair of resamples) up to this many
N_BOOT = 20_000         # Monte Carlo draws beyond it
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


# ---------------------------------------------------------------- discrete distributions

def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Smallest v with P(X <= v) >= q for the distribution putting `weights` on `values`."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cdf = np.cumsum(w) / w.sum()
    i = int(np.searchsorted(cdf, q - 1e-12, side="left"))
    return float(v[min(i, len(v) - 1)])


def bootstrap_means(x: Sequence[float], *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(values, weights) of the bootstrap distribution of the mean of `x`."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if n == 0:
        raise ValueError("bootstrap of an empty sample")
    if n ** n <= EXACT_LIMIT:
        idx = np.array(list(itertools.product(range(n), repeat=n)), dtype=np.int64)
    else:
        idx = np.random.default_rng(seed).integers(0, n, size=(N_BOOT, n))
    means = x[idx].mean(axis=1)
    return means, np.ones_like(means)


def mean_interval(x: Sequence[float], *, level: float = LEVEL, seed: int = 0) -> Interval:
    """The mean of `x` with its percentile-bootstrap interval."""
    vals, w = bootstrap_means(x, seed=seed)
    a = (1 - level) / 2
    return Interval(float(np.mean(x)), weighted_quantile(vals, w, a),
                    weighted_quantile(vals, w, 1 - a), len(x))


def difference_interval(a: Sequence[float], b: Sequence[float], *, level: float = LEVEL,
                        seed: int = 0) -> Interval:
    """mean(a) - mean(b) with the percentile interval of the bootstrap of that difference, each
    method's seeds resampled independently."""
    va, wa = bootstrap_means(a, seed=seed)
    vb, wb = bootstrap_means(b, seed=seed + 1)
    if len(va) * len(vb) <= EXACT_LIMIT:
        diff = (va[:, None] - vb[None, :]).ravel()
        w = (wa[:, None] * wb[None, :]).ravel()
    else:
        rng = np.random.default_rng(seed + 2)
        diff = va[rng.integers(0, len(va), N_BOOT)] - vb[rng.integers(0, len(vb), N_BOOT)]
        w = np.ones_like(diff)
    q = (1 - level) / 2
    return Interval(float(np.mean(a) - np.mean(b)), weighted_quantile(diff, w, q),
                    weighted_quantile(diff, w, 1 - q), min(len(a), len(b)))


def curve_band(curves: np.ndarray, *, level: float = LEVEL, seed: int = 0
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) per step of [seeds, steps] curves: the bootstrap band of the mean curve
    (whole curves resampled together, so the band respects each seed's trajectory)."""
    curves = np.asarray(curves, dtype=np.float64)
    n = curves.shape[0]
    if n ** n <= EXACT_LIMIT:
        idx = np.array(list(itertools.product(range(n), repeat=n)), dtype=np.int64)
    else:
        idx = np.random.default_rng(seed).integers(0, n, size=(N_BOOT, n))
    means = curves[idx].mean(axis=1)                      # [resamples, steps]
    a = (1 - level) / 2
    low = np.quantile(means, a, axis=0, method="inverted_cdf")
    high = np.quantile(means, 1 - a, axis=0, method="inverted_cdf")
    return curves.mean(axis=0), low, high


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
    """Mean of the raw metric over the last `window` updates."""
    return float(np.mean(np.asarray(values, dtype=np.float64)[-window:]))


def updates_to(smoothed: Sequence[float], threshold: float) -> Optional[int]:
    """Updates until the smoothed curve first reaches `threshold` (index + 1), None if never."""
    for i, s in enumerate(smoothed):
        if s >= threshold:
            return i + 1
    return None


def area_under_curve(values: Sequence[float]) -> float:
    """Mean of the raw metric over all updates (area normalised by the run length)."""
    return float(np.mean(np.asarray(values, dtype=np.float64)))


def collapses(smoothed: Sequence[float], drop: float) -> int:
    """Episodes in which the smoothed curve falls more than `drop` below its running best; an
    episode ends when the curve climbs back within `drop` of that best."""
    best, down, count = -math.inf, False, 0
    for s in smoothed:
        best = max(best, s)
        if not down and best - s > drop:
            down, count = True, count + 1
        elif down and best - s <= drop:
            down = False
    return count
