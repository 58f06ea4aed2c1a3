"""Seed-level statistics for comparing training procedures: tests, a multiple-comparison correction, intervals, power.

The unit is a run (one seed): each run gives one number (e.g. held-out success after training), and two procedures
are compared by their runs' numbers. Contract:

* :func:`welch` -- Welch's unequal-variance t test, two-sided: ``(difference of means y - x, t, df, p)``. Two samples
  with no spread at all give p = 1 when their means are equal and p = 0 otherwise. Needs two runs per side.
* :func:`permutation_p` -- two-sided permutation test of the difference of means: exact (every relabelling) when
  there are at most ``resamples`` of them, else ``resamples`` seeded random relabellings with the ``(k + 1) / (R + 1)``
  estimate, which never returns 0 and keeps the test valid.
* :func:`holm` -- Holm's step-down adjustment: adjusted p-values, in the input order, controlling the family-wise
  error rate across the comparisons of one study.
* :func:`mean_ci` -- mean and t interval (95% by default) of one procedure's runs.
* :func:`minimal_detectable_effect` / :func:`runs_needed` -- the normal-approximation power calculation of a
  two-sided two-sample comparison with ``n`` runs per side at a common seed standard deviation ``sd``:
  ``MDE = (z_{1-alpha/2} + z_{power}) * sd * sqrt(2 / n)``. With few runs the t test needs somewhat more than this.

Only the standard library and no scipy: Student's t comes from the regularised incomplete beta function (Lentz's
continued fraction), checked against scipy in the tests where scipy is installed.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from statistics import NormalDist


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast on this side; use symmetry otherwise
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return min(1.0, betainc(df / 2.0, 0.5, df / (df + t * t)))


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile (q > 0.5) of Student's t, by bisection on :func:`t_two_sided_p`."""
    target, lo, hi = 2.0 * (1.0 - q), 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > target else (lo, mid)
    return (lo + hi) / 2.0


def _variance(xs: list[float]) -> float:
    """Sample variance in floats (statistics.variance is exact but slow, and these are seed-level numbers)."""
    m = statistics.fmean(xs)
    return sum((v - m) ** 2 for v in xs) / (len(xs) - 1)


def welch(x: list[float], y: list[float]) -> tuple[float, float, float, float]:
    """Welch's two-sided t test of mean(y) - mean(x): ``(difference, t, df, p)``."""
    if len(x) < 2 or len(y) < 2:
        raise ValueError(f"Welch's test needs at least two runs per side, got {len(x)} and {len(y)}")
    d = statistics.fmean(y) - statistics.fmean(x)
    vx, vy = _variance(x) / len(x), _variance(y) / len(y)
    if vx + vy == 0.0:  # no spread on either side: the difference is certain
        return d, (0.0 if d == 0 else math.copysign(math.inf, d)), math.nan, (1.0 if d == 0 else 0.0)
    t = d / math.sqrt(vx + vy)
    df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    return d, t, df, t_two_sided_p(t, df)


def permutation_p(x: list[float], y: list[float], *, resamples: int = 20_000, seed: int = 0) -> float:
    """Two-sided permutation p-value of |mean(y) - mean(x)| (exact when affordable, else seeded Monte Carlo)."""
    if not x or not y:
        raise ValueError("a permutation test needs runs on both sides")
    pooled, n = list(x) + list(y), len(x)
    total = sum(pooled)
    observed = abs(statistics.fmean(y) - statistics.fmean(x))
    tol = 1e-12 * max(1.0, abs(observed))  # relabellings that tie the observed difference count as extreme

    def diff(left_sum: float) -> float:
        return abs((total - left_sum) / len(y) - left_sum / n)

    if math.comb(len(pooled), n) <= resamples:
        sums = [sum(c) for c in itertools.combinations(pooled, n)]
        return sum(diff(s) >= observed - tol for s in sums) / len(sums)
    rng = random.Random(seed)
    hits = sum(diff(sum(rng.sample(pooled, n))) >= observed - tol for _ in range(resamples))
    return (hits + 1) / (resamples + 1)


def holm(pvalues: list[float]) -> list[float]:
    """Holm-adjusted p-values (same order as given): reject where adjusted p <= alpha, family-wise."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))  # step-down: adjusted p never decreases
        out[i] = running
    return out


def mean_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval over runs; one run gives an unbounded interval."""
    if not xs:
        raise ValueError("no runs")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, -math.inf, math.inf
    half = t_quantile(0.5 + level / 2.0, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def _z_sum(alpha: float, power: float) -> float:
    return NormalDist().inv_cdf(1.0 - alpha / 2.0) + NormalDist().inv_cdf(power)


def minimal_detectable_effect(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest true difference a two-sided test at ``alpha`` finds with probability ``power``, n runs per side."""
    return _z_sum(alpha, power) * sd * math.sqrt(2.0 / n)


def runs_needed(effect: float, sd: float, *, alpha: float = 0.05, power: float = 0.8) -> int:
    """Runs per side for ``power`` at a true difference ``effect`` (at least 2)."""
    if effect <= 0:
        raise ValueError(f"effect must be > 0, got {effect}")
    return max(2, math.ceil(2.0 * (_z_sum(alpha, power) * sd / effect) ** 2))
