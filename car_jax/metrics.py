"""Calibration metrics (SPEC.md section 4): jitted array math plus a host wrapper. B = batch.

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
Sums run in float32: at B = 1M the results agree with a float64 reference to about 1e-6.
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
    inner = jnp.asarray(bin_edges(n_bins)[1:-1])
    return jnp.searchsorted(inner, jnp.asarray(q, jnp.float32), side="right").astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="n_bins")
def bin_stats(correct, q, n_bins: int = 10) -> tuple[jax.Array, jax.Array, jax.Array]:
    """bool[B], f32[B] -> (count int32[n_bins], mean q f32[n_bins], accuracy f32[n_bins]).

    Empty bins report mean q = accuracy = 0.
    """
    c, q = jnp.asarray(correct, jnp.float32), jnp.asarray(q, jnp.float32)
    b = bin_index(q, n_bins)
    count = jax.ops.segment_sum(jnp.ones_like(b), b, n_bins)  # int32[n_bins]
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    mean_q = jax.ops.segment_sum(q, b, n_bins) / denom
    acc = jax.ops.segment_sum(c, b, n_bins) / denom
    return count, mean_q, acc


@jax.jit
def auroc(correct, q) -> jax.Array:
    """bool[B], f32[B] -> f32[]: P(q+ > q-) + 0.5 P(q+ = q-); NaN when a class is missing."""
    c, q = jnp.asarray(correct, bool), jnp.asarray(q, jnp.float32)
    n_pos = jnp.sum(c)
    n_neg = c.shape[0] - n_pos
    neg_sorted = jnp.sort(jnp.where(c, jnp.inf, q))  # f32[B], positives pushed past every q
    below = jnp.searchsorted(neg_sorted, q, side="left", method="sort")  # negatives < q
    at_or_below = jnp.searchsorted(neg_sorted, q, side="right", method="sort")
    frac = (below + 0.5 * (at_or_below - below)) / n_neg  # f32[B], per-positive score
    value = jnp.sum(jnp.where(c, frac, 0.0)) / n_pos
    return jnp.where((n_pos > 0) & (n_neg > 0), value, jnp.nan)


@functools.partial(jax.jit, static_argnames="n_bins")
def calibration_arrays(correct, q, n_bins: int = 10) -> dict[str, jax.Array]:
    """bool[B], f32[B] -> dict of f32[] for every name in KEYS, plus n, n_correct (int32[])."""
    c, q = jnp.asarray(correct, jnp.float32), jnp.asarray(q, jnp.float32)
    n = c.shape[0]
    count, mean_q, acc = bin_stats(correct, q, n_bins)
    w = count / n  # f32[n_bins]; empty bins weigh 0, which skips them
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


def bootstrap_ci(correct, confidence, n_bins: int = 10, n_boot: int = 1000,
                 level: float = 0.95, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap intervals: resample the B samples with replacement n_boot times.

    Returns {name: (low, high)} for every name in KEYS at the given two-sided level; resamples
    where a metric is undefined (NaN) are left out of that metric's interval.
    """
    c, q = check_inputs(correct, confidence)
    c, q = jnp.asarray(c), jnp.asarray(q)

    def one(key):
        idx = jax.random.randint(key, c.shape, 0, c.shape[0])  # int32[B]
        m = calibration_arrays(c[idx], q[idx], n_bins)
        return jnp.stack([m[k] for k in KEYS])  # f32[len(KEYS)]

    keys = jax.random.split(jax.random.key(seed), n_boot)
    stats = np.asarray(jax.jit(lambda k: jax.lax.map(one, k, batch_size=16))(keys))
    tail = 100 * (1 - level) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN bounds
        lo, hi = np.nanpercentile(stats, [tail, 100 - tail], axis=0)
    return {k: (float(lo[i]), float(hi[i])) for i, k in enumerate(KEYS)}
