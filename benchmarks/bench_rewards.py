"""Rewards and calibration metrics at B = 1M: car_jax (jitted) against plain numpy, same run.

    .venv/bin/python benchmarks/bench_rewards.py [--n 1000000] [--repeats 5]

Prints a markdown table: best-of-`repeats` wall time per operation, the numpy / car_jax ratio
(> 1: car_jax faster), and the largest absolute difference from a float64 reference (for
AUROC: from sklearn). The jitted
side is timed on arrays already on the device, after one warm-up call (compilation excluded);
the "calibration, host" row is `car_jax.calibration.metrics.calibration` end to end from numpy inputs
(validation, transfer, jitted math, back to Python floats).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.metrics import roc_auc_score

from car_jax.calibration import metrics, rewards


# ------------------------------------------------------------------ numpy peers
# Rewards: c, q, ok arrays in the caller's float dtype (float32 when timed, float64 for the diff).
NP_REWARDS = {
    "binary": lambda c, q, ok: c - 0.5 * (1 - ok),
    "brier": lambda c, q, ok: c - (q - c) ** 2 - 0.5 * (1 - ok),
    "weighted_brier": lambda c, q, ok: c - 0.5 * (q - c) ** 2 - 0.5 * (1 - ok),
    "mscr": lambda c, q, ok: c * (2 - (1 - q) ** 2) - (1 - c) * q**2 - 0.5 * (1 - ok),
}


def np_auroc(c, q):
    """Rank formula with average ranks for ties: (R+ - n+(n+ + 1)/2) / (n+ n-)."""
    s = np.sort(q)
    ranks = (np.searchsorted(s, q, "left") + np.searchsorted(s, q, "right") + 1) / 2.0
    n_pos = c.sum()
    n_neg = c.size - n_pos
    return (ranks[c].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def np_auroc_keys(c, q):
    """car_jax's algorithm in numpy: one int32 sort of 2 * bits(q) + c, then scans."""
    key = np.sort(2 * (q.astype(np.float32) + np.float32(0)).view(np.int32) + c)
    v, neg = key >> 1, 1 - (key & 1)
    change = v[1:] != v[:-1]
    first, last = np.r_[True, change], np.r_[change, True]
    incl = np.cumsum(neg)
    below = np.maximum.accumulate(np.where(first, incl - neg, 0))
    upto = np.minimum.accumulate(np.where(last, incl, neg.size)[::-1])[::-1]
    n_neg = neg.sum()
    return np.sum(((below + 0.5 * (upto - below)))[neg == 0]) / ((neg.size - n_neg) * n_neg)


def np_calibration(c, q, n_bins=10):
    """float64 sums; AUROC by the (faster) int-key algorithm."""
    edges = metrics.bin_edges(n_bins)
    b = np.searchsorted(edges[1:-1], q, "right")
    cnt = np.bincount(b, minlength=n_bins)
    q64, c64 = q.astype(np.float64), c.astype(np.float64)
    den = np.maximum(cnt, 1)
    gap = np.bincount(b, q64, n_bins) / den - np.bincount(b, c64, n_bins) / den
    return {
        "accuracy": c64.mean(), "ece": np.sum(cnt / c.size * np.abs(gap)),
        "mcip": q64[~c].mean(), "auroc": np_auroc_keys(c, q), "brier": np.mean((q64 - c64) ** 2),
    }


def best_of(fn, repeats):
    fn()  # warm-up (compiles the jitted side)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q = np.where(rng.random(args.n) < 0.5, rng.integers(0, 101, args.n) / 100,
                 rng.random(args.n)).astype(np.float32)
    c = rng.random(args.n) < q**1.5
    ok = rng.random(args.n) < 0.9
    cj, qj, okj = jnp.asarray(c), jnp.asarray(q), jnp.asarray(ok)
    q64 = q.astype(np.float64)

    rows = []
    c32, ok32 = c.astype(np.float32), ok.astype(np.float32)
    for kind, np_fn in NP_REWARDS.items():
        fn = rewards.reward_fn(rewards.RewardConfig(kind=kind))
        t_jax = best_of(lambda: fn(cj, qj, okj), args.repeats)
        t_np = best_of(lambda: np_fn(c32, q, ok32), args.repeats)
        ref = np_fn(c.astype(np.float64), q64, ok.astype(np.float64))
        diff = np.max(np.abs(np.asarray(fn(cj, qj, okj), np.float64) - ref))
        rows.append((f"reward {kind} (numpy float32)", t_jax, t_np, diff))

    sk = roc_auc_score(c, q)
    t_jax = best_of(lambda: metrics.auroc(cj, qj), args.repeats)
    for name, peer, reps in [("numpy rank formula", np_auroc, args.repeats),
                             ("numpy, car_jax's int-key algorithm", np_auroc_keys, args.repeats),
                             ("sklearn roc_auc_score", roc_auc_score, 1)]:
        t_peer = best_of(lambda: peer(c, q), reps)
        rows.append((f"AUROC vs {name}", t_jax, t_peer, abs(metrics.auroc(cj, qj).item() - sk)))
        assert abs(peer(c, q) - sk) < 1e-9, name  # the peers agree with sklearn

    ref = np_calibration(c, q)
    core = lambda: metrics.calibration_arrays(cj, qj)  # noqa: E731
    t_jax = best_of(core, args.repeats)
    t_np = best_of(lambda: np_calibration(c, q), args.repeats)
    got = {k: v.item() for k, v in core().items()}
    diff = max(abs(got[k] - ref[k]) for k in ref)
    rows.append(("calibration (acc, ECE, MCIP, AUROC, Brier, ...)", t_jax, t_np, diff))
    t_host = best_of(lambda: metrics.calibration(c, q), args.repeats)
    rows.append(("calibration, host (numpy in, floats out)", t_host, t_np, diff))

    print(f"B = {args.n:,}, best of {args.repeats}, jax {jax.__version__} on "
          f"{jax.devices()[0].platform}, numpy {np.__version__}\n")
    print("| operation | car_jax jit (ms) | numpy (ms) | numpy / car_jax | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for name, tj, tn, d in rows:
        print(f"| {name} | {tj * 1e3:.2f} | {tn * 1e3:.2f} | {tn / tj:.2f}x | {d:.1e} |")


if __name__ == "__main__":
    main()
