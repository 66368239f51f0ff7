"""Calibration metrics: jitted array math plus a host wrapper. Letters: car_jax.dims.

Conventions (car_jax's, used everywhere these numbers are reported):
- Inputs: `correct: bool[B]` (c), `confidence: float[B]` (q in [0, 1], finite), cast to float32.
  Samples with a missing confidence stay in with q = 0 (the parser already gives them q = 0).
- Bins: `n_bins` equal-width bins with edges e_k = float32(k / n_bins), k = 0..n_bins (k / n_bins
  computed in float64, then rounded to float32). Bin k holds the q with e_k <= q < e_{k+1};
  q = 1.0 goes to the last bin. So float32(0.3) lies in bin 3, the largest float32 below it in 2.
- ECE = sum over non-empty bins of (n_b / B) |mean q_b - accuracy_b|. Its split into
  over-confidence (the same sum over max(mean q_b - acc_b, 0)) and under-confidence
  (over max(acc_b - mean q_b, 0)) adds up to ECE.
- MCIP = mean q over wrong predictions (NaN, with a warning, when none is wrong).
- Brier = mean (q - c)^2. Accuracy = mean c.
- AUROC: correct = positive class, q = score; P(q+ > q-) + 0.5 P(q+ = q-) over all
  positive/negative pairs, which equals the rank formula with average ranks for ties
  (sklearn's `roc_auc_score`). NaN, with a warning, when only one class is present.
Sums run in float32 (pairwise reductions): at B = 1M the results agree with a float64
reference to within 1e-7 (benchmarks/bench_rewards.py prints the difference).
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

KEYS = ("accuracy", "ece", "mcip", "auroc", "brier", "overconfidence", "underconfidence",
        "mean_confidence")


def bin_edges(n_bins: int = 10) -> np.ndarray:
    """float32[n_bins + 1]: e_k = float32(k / n_bins)."""
    return (np.arange(n_bins + 1, dtype=np.float64) / n_bins).astype(np.float32)


def bin_index(q: jax.Array, n_bins: int = 10) -> jax.Array:
    """q: f32[B] -> int32[B] in [0, n_bins): the number of inner edges e_1..e_{n_bins-1} <= q."""
    inner = jnp.asarray(bin_edges(n_bins)[1:-1])  # f32[n_bins - 1]
    q = jnp.asarray(q, jnp.float32)
    return jnp.sum(q[:, None] >= inner, axis=1, dtype=jnp.int32)  # compares beat a search here


@functools.partial(jax.jit, static_argnames="n_bins")
def bin_stats(correct, q, n_bins: int = 10) -> tuple[jax.Array, jax.Array, jax.Array]:
    """bool[B], f32[B] -> (count int32[Q], mean q f32[Q], accuracy f32[Q]), Q = n_bins.

    Empty bins report mean q = accuracy = 0.
    """
    c, q = jnp.asarray(correct, jnp.float32), jnp.asarray(q, jnp.float32)
    member = bin_index(q, n_bins)[:, None] == jnp.arange(n_bins)  # bool[B, Q]
    # masked reductions, not segment_sum: XLA reduces pairwise, a scatter-add adds serially
    # (at B = 1M that moved ECE by 3e-6 against a float64 reference).
    count = jnp.sum(member, axis=0, dtype=jnp.int32)  # int32[Q]
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    mean_q = jnp.sum(jnp.where(member, q[:, None], 0.0), axis=0) / denom
    acc = jnp.sum(jnp.where(member, c[:, None], 0.0), axis=0) / denom
    return count, mean_q, acc


@jax.jit
def auroc(correct, q) -> jax.Array:
    """bool[B], f32[B] -> f32[]: P(q+ > q-) + 0.5 P(q+ = q-); NaN when a class is missing.

    One sort of int32 keys (XLA's CPU sort is ~3x faster on int32 than on float32): for
    q in [0, 1] the float32 bit pattern, read as an int, is < 2^30 and ordered like q, so
    key = 2 * bits + c fits in int32 and carries the label. Then, per tie group of equal q,
    scans give the negatives below the group and inside it; no scatter.
    q must lie in [0, 1] (negative q would break the key order; `calibration` checks).
    """
    c = jnp.asarray(correct, jnp.int32)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(q, jnp.float32) + 0.0, jnp.int32)  # -0 -> +0
    key = jnp.sort(2 * bits + c)  # int32[B], ascending q
    v, pos = key >> 1, key & 1  # int32[B] each: q's bits and the label, in sorted order
    neg = 1 - pos
    n_pos = jnp.sum(pos)
    n_neg = neg.shape[0] - n_pos
    first = jnp.concatenate([jnp.array([True]), v[1:] != v[:-1]])  # bool[B]: starts a group
    last = jnp.concatenate([v[1:] != v[:-1], jnp.array([True])])  # bool[B]: ends a group
    incl = jnp.cumsum(neg)  # int32[B]: negatives at positions <= i
    below = jax.lax.cummax(jnp.where(first, incl - neg, 0))  # negatives before the group
    upto = jax.lax.cummin(jnp.where(last, incl, neg.shape[0]), reverse=True)  # ... through it
    score = (below + 0.5 * (upto - below)) / n_neg  # f32[B]: per-positive P(beat a negative)
    value = jnp.sum(jnp.where(pos == 1, score, 0.0)) / n_pos
    return jnp.where((n_pos > 0) & (n_neg > 0), value, jnp.nan)


@functools.partial(jax.jit, static_argnames="n_bins")
def calibration_arrays(correct, q, n_bins: int = 10) -> dict[str, jax.Array]:
    """bool[B], f32[B] -> dict of f32[] for every name in KEYS, plus n, n_correct (int32[])."""
    c, q = jnp.asarray(correct, jnp.float32), jnp.asarray(q, jnp.float32)
    n = c.shape[0]
    count, mean_q, acc = bin_stats(correct, q, n_bins)
    w = count / n  # f32[Q]; empty bins weigh 0, which skips them
    gap = mean_q - acc
    n_wrong = n - jnp.sum(c)
    return {
        "accuracy": jnp.mean(c),
        "ece": jnp.sum(w * jnp.abs(gap)),
        "overconfidence": jnp.sum(w * jnp.maximum(gap, 0.0)),
        "underconfidence": jnp.sum(w * jnp.maximum(-gap, 0.0)),
        "mcip": jnp.sum(q * (1.0 - c)) / n_wrong,
        "auroc": auroc(correct, q),
        "brier": jnp.mean((q - c) ** 2),
        "mean_confidence": jnp.mean(q),
        "n": jnp.int32(n),
        "n_correct": jnp.sum(correct).astype(jnp.int32),
    }


def check_inputs(correct, confidence) -> tuple[np.ndarray, np.ndarray]:
    """Host validation: -> (bool[B], float32[B]); ValueError on bad shapes or q outside [0, 1]."""
    c = np.asarray(correct).astype(bool)
    q = np.asarray(confidence, dtype=np.float32)
    if c.ndim != 1 or c.shape != q.shape or c.size == 0:
        raise ValueError(f"need equal, non-empty 1-D shapes, got {c.shape} and {q.shape}")
    if not np.all((q >= 0) & (q <= 1)):  # also catches NaN
        raise ValueError("confidence must lie in [0, 1] (use q = 0 for a missing confidence)")
    return c, q


def calibration(correct, confidence, n_bins: int = 10) -> dict[str, float]:
    """The report's metrics: bool[B], float[B] -> {name: float} for KEYS plus n, n_correct.

    Warns (and reports NaN) for AUROC with a single class and for MCIP with no wrong answer.
    Raises ValueError on empty input, mismatched shapes, or q outside [0, 1].
    """
    c, q = check_inputs(correct, confidence)
    out = {k: v.item() for k, v in calibration_arrays(c, q, n_bins).items()}
    if out["n_correct"] in (0, out["n"]):
        warnings.warn("AUROC is undefined with a single class; reporting NaN", RuntimeWarning)
    if out["n_correct"] == out["n"]:
        warnings.warn("MCIP is undefined with no wrong predictions; reporting NaN",
                      RuntimeWarning)
    return out


@functools.partial(jax.jit, static_argnames=("n_bins", "n_boot"))
def _bootstrap_stats(correct, q, key, n_bins: int, n_boot: int) -> jax.Array:
    """bool[B], f32[B] -> f32[n_boot, len(KEYS)]: the metrics of n_boot resamples."""

    def one(k):
        idx = jax.random.randint(k, q.shape, 0, q.shape[0])  # int32[B]
        m = calibration_arrays(correct[idx], q[idx], n_bins)
        return jnp.stack([m[name] for name in KEYS])  # f32[len(KEYS)]

    return jax.lax.map(one, jax.random.split(key, n_boot), batch_size=16)


def bootstrap_draws(correct, confidence, n_bins: int = 10, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """The metrics of n_boot resamples (with replacement) of the B samples:
    bool[B], float[B] -> f64[n_boot, len(KEYS)], columns in KEYS order; NaN where undefined."""
    c, q = check_inputs(correct, confidence)
    return np.asarray(_bootstrap_stats(c, q, jax.random.key(seed), n_bins, n_boot), np.float64)


def bootstrap_ci(correct, confidence, n_bins: int = 10, n_boot: int = 1000,
                 level: float = 0.95, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap intervals: resample the B samples with replacement n_boot times.

    Returns {name: (low, high)} for every name in KEYS at the given two-sided level; resamples
    where a metric is undefined (NaN) are left out of that metric's interval.
    """
    stats = bootstrap_draws(correct, confidence, n_bins, n_boot, seed)
    tail = 100 * (1 - level) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN bounds
        lo, hi = np.nanpercentile(stats, [tail, 100 - tail], axis=0)
    return {k: (float(lo[i]), float(hi[i])) for i, k in enumerate(KEYS)}
