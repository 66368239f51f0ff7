"""The experiment's statistics over seeds and examples (host numpy; the per-sample metrics are
`car_jax.calibration.metrics`'s).

A policy arm has one set of eval records per seed. Its point estimate of a metric is the mean
over seeds of the metric on each seed's records. Its 95% interval is a two-level percentile
bootstrap: each draw resamples the seeds with replacement and, within each drawn seed, the
examples (metrics.bootstrap_draws), and averages the drawn seeds' metrics. With one seed it
is the ordinary example bootstrap. Comparisons with the baseline arm (differences, relative
ECE change) take the draw-by-draw difference or ratio of the two arms' independent draws.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

from car_jax.calibration import metrics

REPORTED = ("accuracy", "ece", "mcip", "auroc", "brier", "mean_confidence")
NEAR = 0.05  # "about one confidence": within this of the one stated most (modal_confidence)


def arrays(records: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([r["correct"] for r in records], bool),
            np.array([r["confidence"] for r in records], np.float32))


def seed_metrics(records: Sequence[dict]) -> dict[str, float]:
    """The metrics (metrics.KEYS) of one seed's records; NaN where undefined, no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return {k: float(v) for k, v in metrics.calibration(*arrays(records)).items() if k in metrics.KEYS}


def arm_draws(per_seed: Sequence[Sequence[dict]], n_boot: int, seed: int = 0) -> np.ndarray:
    """f64[n_boot, len(metrics.KEYS)]: the two-level bootstrap draws of an arm's
    seed-averaged metrics (module docstring)."""
    inner = np.stack([metrics.bootstrap_draws(*arrays(recs), n_boot=n_boot, seed=seed + 7919 * i)
                      for i, recs in enumerate(per_seed)])  # [S, n_boot, K]
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(per_seed), size=(n_boot, len(per_seed)))  # drawn seeds, [n_boot, S]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a draw whose metric is undefined everywhere
        return np.nanmean(inner[pick, np.arange(n_boot)[:, None]], axis=1)


def interval(draws: np.ndarray) -> tuple[float, float]:
    """The 95% percentile interval of 1-d draws (NaN draws left out; NaN when none is left)."""
    draws = draws[~np.isnan(draws)]
    if not draws.size:
        return float("nan"), float("nan")
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(lo), float(hi)


def modal_confidence(records: Sequence[dict], near: float = NEAR) -> dict[str, float]:
    """{"value", "share", "near"}: the confidence one seed's policy states most often (ties: the
    smaller value), the share of its records that state it, and the share within `near` of it.
    A "near" share close to 1 means the policy says about one number whatever the question: its
    ECE then only measures where that number sits against its accuracy."""
    q = np.array([r["confidence"] for r in records], np.float64)  # as stated, not rounded to f32
    values, counts = np.unique(q, return_counts=True)
    i = int(np.argmax(counts))
    return {"value": float(values[i]), "share": float(counts[i] / counts.sum()),
            "near": float(np.mean(np.abs(q - values[i]) <= near + 1e-9))}


def arm_summary(per_seed: Sequence[Sequence[dict]], n_boot: int, seed: int = 0) -> dict:
    """{metric: {"mean", "lo", "hi", "per_seed"}} for REPORTED, plus "n" (examples per seed),
    "seeds", "modal" (modal_confidence per seed) and "_draws" (the bootstrap draws, for
    comparisons; not written out)."""
    points = [seed_metrics(recs) for recs in per_seed]
    draws = arm_draws(per_seed, n_boot, seed)
    out = {"n": [len(r) for r in per_seed], "seeds": len(per_seed), "_draws": draws,
           "modal": [modal_confidence(recs) for recs in per_seed]}
    for k in REPORTED:
        vals = np.array([p[k] for p in points])
        lo, hi = interval(draws[:, metrics.KEYS.index(k)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean = float(np.nanmean(vals)) if not np.all(np.isnan(vals)) else float("nan")
        out[k] = {"mean": mean, "lo": lo, "hi": hi, "per_seed": vals.tolist()}
    return out


def compare(arm: dict, base: dict) -> dict:
    """Arm minus baseline: {"d_<metric>": {"mean", "lo", "hi"}} for REPORTED and
    "rel_ece" (ECE_arm / ECE_base - 1, with its interval from the draws' ratios)."""
    out = {}
    for k in REPORTED:
        i = metrics.KEYS.index(k)
        lo, hi = interval(arm["_draws"][:, i] - base["_draws"][:, i])
        out[f"d_{k}"] = {"mean": arm[k]["mean"] - base[k]["mean"], "lo": lo, "hi": hi}
    i = metrics.KEYS.index("ece")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = arm["_draws"][:, i] / base["_draws"][:, i] - 1
        point = arm["ece"]["mean"] / base["ece"]["mean"] - 1 if base["ece"]["mean"] else float("nan")
    lo, hi = interval(ratio[np.isfinite(ratio)])
    out["rel_ece"] = {"mean": float(point), "lo": lo, "hi": hi}
    return out


def verdict(diff: dict, arm: str, base: str, split: str, acc_margin: float = 0.05) -> str:
    """One honest sentence on "the arm lowers ECE at equal accuracy" from `compare`'s output,
    opening with "<split>, <arm>:": supported when the ECE difference's interval lies below 0
    and the accuracy difference's interval lies within +-acc_margin of 0 or above it;
    contradicted when the ECE interval lies above 0; otherwise not resolved by this experiment."""
    e, a = diff["d_ece"], diff["d_accuracy"]
    nums = (f"ECE {e['mean']:+.3f} [{e['lo']:+.3f}, {e['hi']:+.3f}], accuracy {a['mean']:+.3f} "
            f"[{a['lo']:+.3f}, {a['hi']:+.3f}] against {base}")
    if e["hi"] < 0 and a["lo"] >= -acc_margin:
        return f"{split}, {arm}: supported. {arm} lowers ECE without losing accuracy ({nums})."
    if e["hi"] < 0:
        return f"{split}, {arm}: ECE is lower, but accuracy drops. {arm} is not better at equal accuracy ({nums})."
    if e["lo"] > 0:
        return f"{split}, {arm}: contradicted. {arm} raises ECE ({nums})."
    return f"{split}, {arm}: not resolved. The interval of the ECE difference includes 0 ({nums})."


def collapse_note(split: str, runs: dict[str, dict], share: float = 0.9, before: str = "warm") -> str | None:
    """The sentence on confidence collapse among trained policies ({run name: {"modal",
    "auroc"}} of one split; the run named `before`, the warm start, is the reference, not one of
    them): which state about one confidence (within NEAR of the one they state most) on at
    least `share` of the questions, and what their ECE does and does not measure then. None
    when none does."""
    start = runs.get(before)
    runs = {n: r for n, r in runs.items() if n != before}
    flat = [n for n, r in runs.items() if r["modal"]["near"] >= share]
    if not flat:
        return None
    said = ", ".join(f"{n} {100 * runs[n]['modal']['value']:.0f} on "
                     f"{100 * runs[n]['modal']['near']:.0f}%" for n in flat)
    aurocs = [runs[n]["auroc"] for n in flat if not np.isnan(runs[n]["auroc"])]
    auroc = f" (their AUROC: median {np.median(aurocs):.2f})" if aurocs else ""
    return (f"{split}: {len(flat)} of the {len(runs)} trained policies state about one confidence (within "
            f"{100 * NEAR:g} points) on at least {100 * share:.0f}% of the questions ({said}). For them ECE measures how far that one number "
            f"is from their accuracy, not whether their confidence tells right answers from wrong ones{auroc}."
            + ("" if start is None else f" The warm start, before RL, states about "
               f"{100 * start['modal']['value']:.0f} on {100 * start['modal']['near']:.0f}% of the questions."))
