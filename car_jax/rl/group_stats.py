"""Per-step statistics of the GRPO groups: is calibration being learned, and where does the
advantage signal come from? Host-side numpy over one step's rows (with several processes,
every process's rows, gathered by the trainer). Letters: B rows of the step.

Only kept rows count (keep True): a dropped row (a void TIR trajectory) is out of its group's
mean and std in the advantages (`grpo.group_advantages(valid=keep)`) and out of these
statistics too. A "group" below is a GRPO group with at least two kept rows: a group left with
one kept row has no spread (its advantage is its reward, as verl's group of one) and enters
only the row-level metrics (corr_qc, auroc).

  calib/q_group_sd          mean over groups of the sample SD (ddof=1) of the sampled q. ddof=1
                            is the estimate of the prompt's q spread that does not shrink with
                            G (ddof=0 reads sqrt(3/4), 13%, low at G = 4), and the SD
                            `grpo.group_advantages` divides by (torch.std's), so a q spread and
                            a reward spread are measured alike.
  calib/corr_qc             Pearson correlation of q and correctness (0/1) over the kept rows;
                            NaN (no warning) when either is constant or fewer than 2 rows.
  calib/auroc               AUROC of q as a score for correctness over the kept rows
                            (`calibration.metrics.auroc`: P(q+ > q-) + 0.5 P(q+ = q-), sklearn's
                            roc_auc_score); NaN (no warning) when one class is missing.
  groups/count              how many groups there are (the denominator of the shares).
  groups/equal_reward_share share of groups whose float32 rewards (as the reward function gave
                            them) are all exactly equal: their advantages are all 0.
  groups/equal_correct_share share of groups that are all right or all wrong: their rewards
                            differ only by the confidence and format terms.
  groups/equal_correct_abs_adv  mean |advantage| over the kept rows of those groups. With std
                            normalisation a reward spread of 1e-3 in an all-wrong group of 4
                            still gives advantages of about +-1: this shows how much of the
                            update such groups drive.
  groups/mixed_abs_adv      mean |advantage| over the kept rows of the other groups (some right,
                            some wrong), for comparison.
A mean over no groups or rows is NaN (logged as such).
"""
from __future__ import annotations

import numpy as np

from car_jax.calibration import metrics as cal

KEYS = ("calib/q_group_sd", "calib/corr_qc", "calib/auroc", "groups/count", "groups/equal_reward_share",
        "groups/equal_correct_share", "groups/equal_correct_abs_adv", "groups/mixed_abs_adv")


def group_stats(correct, q, rewards, advantages, group, keep) -> dict[str, float]:
    """The metrics of the module docstring (every name in KEYS) of one step's rows.

    correct bool[B], q float32[B] (the sampled confidence as parsed, 0 when missing),
    rewards float32[B] and advantages float32[B] (the scorer's, `batches.make_scorer`),
    group int[B] (any integer ids: rows with equal ids form a group), keep bool[B].
    """
    keep = np.asarray(keep, bool)
    c = np.asarray(correct, bool)[keep]
    q = np.asarray(q, np.float32)[keep]
    r = np.asarray(rewards, np.float32)[keep]
    a = np.asarray(advantages, np.float32)[keep]
    gid, size = _numbered(np.asarray(group)[keep])
    multi = size >= 2  # bool[K]: the groups these statistics speak of
    equal_r = _all_equal(r, gid, len(size))[multi]
    equal_c = _all_equal(c, gid, len(size))
    in_equal_c = (multi & equal_c)[gid]  # bool[kept rows]
    in_mixed = (multi & ~equal_c)[gid]
    return {
        "calib/q_group_sd": _mean(_group_sd(q, gid, size)[multi]),
        "calib/corr_qc": pearson(q, c),
        "calib/auroc": float(cal.auroc(c, q)) if len(c) else float("nan"),
        "groups/count": float(multi.sum()),
        "groups/equal_reward_share": _mean(equal_r),
        "groups/equal_correct_share": _mean(equal_c[multi]),
        "groups/equal_correct_abs_adv": _mean(np.abs(a[in_equal_c])),
        "groups/mixed_abs_adv": _mean(np.abs(a[in_mixed])),
    }


def pearson(x, y) -> float:
    """Pearson correlation of x[N] and y[N] (bools as 0/1) in float64; NaN, without a
    warning, when N < 2 or either is constant (its SD is 0)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    return float(np.sum(dx * dy) / np.sqrt(np.sum(dx * dx) * np.sum(dy * dy)))


def _numbered(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group ids [N] -> (int[N] numbers in [0, K), int[K] rows per group)."""
    _, gid, size = np.unique(group, return_inverse=True, return_counts=True)
    return gid.reshape(-1), size


def _all_equal(x: np.ndarray, gid: np.ndarray, k: int) -> np.ndarray:
    """bool[K]: whether every row of group k has the same x (exact comparison)."""
    first = np.zeros(k, x.dtype)
    first[gid] = x  # some row's value per group (the last one written)
    differs = np.zeros(k, bool)
    np.logical_or.at(differs, gid, x != first[gid])
    return ~differs


def _group_sd(x: np.ndarray, gid: np.ndarray, size: np.ndarray) -> np.ndarray:
    """float64[K]: each group's sample SD (ddof=1) of x[N]; NaN for a group of one."""
    x = x.astype(np.float64)
    mean = np.bincount(gid, x, len(size)) / size
    square = np.bincount(gid, (x - mean[gid]) ** 2, len(size))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(square / (size - 1))


def _mean(x: np.ndarray) -> float:
    """The mean of x as a float; NaN, without a warning, for no values."""
    return float(np.mean(x, dtype=np.float64)) if len(x) else float("nan")


__all__ = ["KEYS", "group_stats", "pearson"]
