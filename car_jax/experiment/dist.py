"""The distributions the experiment's tests need, in float64 host math (no scipy; the tests
compare every function here with scipy.stats).

- Standard normal: `normal_cdf` (math.erfc).
- Student t with an integer number of degrees of freedom nu (the seed-paired t test has
  nu = seeds - 1): `t_cdf` by the closed form of Abramowitz & Stegun 26.7.3-4. With
  theta = atan(|t| / sqrt(nu)) and A = P(-|t| < T < |t|):
      nu = 1:      A = 2 theta / pi
      nu odd:      A = (2 / pi) (theta + sin(theta) sum_{k=0}^{(nu-3)/2} a_k),
                   a_0 = cos(theta),  a_k = a_{k-1} (2k / (2k + 1)) cos^2(theta)
      nu even:     A = sin(theta) sum_{k=0}^{(nu-2)/2} b_k,
                   b_0 = 1,           b_k = b_{k-1} ((2k - 1) / (2k)) cos^2(theta)
  and F(t) = (1 + sign(t) A) / 2. `t_ppf` inverts it by bisection (to float64 resolution).
- The two-sided power of a one-sample (paired) t test, `t_test_power`: with n pairs, true
  mean difference delta and standard deviation sd of one pair's difference, the statistic is
  T' = (Z + lam) / (U / sqrt(nu)), Z standard normal, U chi with nu = n - 1 degrees of freedom,
  lam = delta sqrt(n) / sd (noncentral t). With c = t_ppf(1 - alpha / 2, nu),
      power = P(T' > c) + P(T' < -c) = E_U[Phi(lam - c U / sqrt(nu)) + Phi(-lam - c U / sqrt(nu))],
  integrated over U's density g(u) = u^(nu-1) exp(-u^2 / 2) / (2^(nu/2 - 1) Gamma(nu/2)) by
  Simpson's rule on [max(0, sqrt(nu) - 12), sqrt(nu) + 12] (U's mean is about
  sqrt(nu - 1/2), its sd at most 0.71: the mass outside is below 1e-30).
- `seeds_for_power`: the smallest n >= 2 with t_test_power(n) >= the target.
- `binom_half_two_sided`: the exact two-sided p of k successes in n fair coin flips,
  min(1, 2 P(X <= min(k, n - k))) (the distribution is symmetric, so this equals the
  "sum of the outcomes no likelier than k" rule of scipy.stats.binomtest).
"""
from __future__ import annotations

import math

import numpy as np

SIMPSON_POINTS = 4001  # odd: Simpson's rule on SIMPSON_POINTS - 1 intervals
MAX_SEEDS = 100_000  # seeds_for_power's search stops here (and returns None)


def normal_cdf(x: float) -> float:
    """Phi(x), accurate in both tails (erfc)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _check_df(df: int) -> int:
    if int(df) != df or df < 1:
        raise ValueError(f"df={df!r}: the closed-form t distribution needs an integer >= 1")
    return int(df)


def t_central_mass(t: float, df: int) -> float:
    """A = P(-|t| < T < |t|) for T ~ Student t(df), df a positive integer (module docstring)."""
    df = _check_df(df)
    theta = math.atan2(abs(t), math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd
        if df == 1:
            return 2.0 * theta / math.pi
        k = np.arange(1, (df - 3) // 2 + 1, dtype=np.float64)
        terms = math.cos(theta) * np.concatenate([[1.0], np.cumprod(2 * k / (2 * k + 1) * c2)])
        return min(1.0, 2.0 / math.pi * (theta + s * float(terms.sum())))
    k = np.arange(1, (df - 2) // 2 + 1, dtype=np.float64)
    terms = np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k) * c2)])
    return min(1.0, s * float(terms.sum()))


def t_cdf(t: float, df: int) -> float:
    """P(T <= t), T ~ Student t(df), df a positive integer."""
    a = t_central_mass(t, df)
    return 0.5 * (1.0 + a) if t >= 0 else 0.5 * (1.0 - a)


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) = 1 - A."""
    return max(0.0, 1.0 - t_central_mass(t, df))


def t_ppf(p: float, df: int) -> float:
    """The p-quantile of Student t(df), 0 < p < 1: bisection on t_cdf until the bracket stops
    shrinking in float64."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p!r} must lie in (0, 1)")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # bracket: F(lo) < p <= F(hi)
        lo, hi = hi, 2.0 * hi
    while True:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            return hi
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)


def _simpson_weights(n: int, h: float) -> np.ndarray:
    w = np.ones(n)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return w * h / 3.0


def t_test_power(n: int, delta: float, sd: float, alpha: float = 0.05) -> float:
    """The two-sided power of the paired t test with n pairs (module docstring): true mean
    difference `delta`, per-pair standard deviation `sd` > 0, level `alpha`."""
    if n < 2:
        raise ValueError(f"n={n!r}: a t test needs at least 2 pairs")
    if not sd > 0:
        raise ValueError(f"sd={sd!r} must be > 0")
    nu = n - 1
    lam = abs(delta) * math.sqrt(n) / sd
    c = t_ppf(1.0 - alpha / 2.0, nu)
    u = np.linspace(max(0.0, math.sqrt(nu) - 12.0), math.sqrt(nu) + 12.0, SIMPSON_POINTS)  # f64[P]
    log_const = -(nu / 2 - 1) * math.log(2.0) - math.lgamma(nu / 2)
    g = np.zeros_like(u)  # chi(nu) density; at u = 0 it is 0 for nu > 1 and exp(log_const) for nu = 1
    pos = u > 0
    g[pos] = np.exp((nu - 1) * np.log(u[pos]) - u[pos] ** 2 / 2 + log_const)
    if nu == 1:
        g[~pos] = math.exp(log_const)
    x = c * u / math.sqrt(nu)
    tail = np.array([normal_cdf(lam - v) + normal_cdf(-lam - v) for v in x])  # f64[P]
    return float(min(1.0, np.sum(_simpson_weights(u.size, u[1] - u[0]) * g * tail)))


def seeds_for_power(delta: float, sd: float, power: float = 0.8, alpha: float = 0.05) -> int | None:
    """The smallest n >= 2 whose paired t test reaches `power` against a true difference
    `delta` when one pair's difference has standard deviation `sd` (2 when sd == 0; None when
    sd is NaN or no n up to MAX_SEEDS does). Power rises with n, so: doubling, then bisection."""
    if math.isnan(sd) or delta == 0:
        return None
    if sd == 0:
        return 2
    if t_test_power(2, delta, sd, alpha) >= power:
        return 2
    lo, hi = 2, 4  # power(lo) < target
    while t_test_power(hi, delta, sd, alpha) < power:
        if hi >= MAX_SEEDS:
            return None
        lo, hi = hi, min(2 * hi, MAX_SEEDS)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if t_test_power(mid, delta, sd, alpha) < power else (lo, mid)
    return hi


def binom_half_two_sided(k: int, n: int) -> float:
    """The exact two-sided p of k successes in n trials with success probability 1/2:
    min(1, 2 P(X <= min(k, n - k))), in exact integer arithmetic; 1 when n = 0."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    low = sum(math.comb(n, i) for i in range(min(k, n - k) + 1))
    return min(1.0, 2 * low / 2**n)
