"""The report's sentences, read off the statistics (`car_jax.experiment.stats`): the verdict on
each arm against the baseline, and the note on confidence collapse.

A difference is *resolved* when its seed-paired 95% interval excludes 0 and its Holm-adjusted
p (over every comparison of the report) is below 0.05 (`stats.finalize`). The claim under test
is "the arm lowers ECE at equal accuracy":
- supported: the ECE difference is resolved and negative, and the accuracy difference's
  seed-paired interval lies above -acc_margin (non-inferiority: at most that much is lost);
- ECE lower, accuracy drops: ECE resolved lower and the accuracy difference resolved negative;
- ECE lower, equal accuracy not shown: ECE resolved lower, but the accuracy interval reaches
  below -acc_margin without the drop being resolved;
- contradicted: the ECE difference is resolved and positive;
- otherwise not resolved, saying which condition failed.
"""
from __future__ import annotations

import math

import numpy as np

from car_jax.experiment.stats import ALPHA, NEAR

ACC_MARGIN = 0.05


def _p(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


def _numbers(row: dict, label: str) -> str:
    ci = "no interval" if math.isnan(row["lo"]) else f"[{row['lo']:+.3f}, {row['hi']:+.3f}]"
    return (f"{label} {row['mean']:+.3f} {ci} over {row['n']} seeds, {row['test']} p {_p(row['p'])}, "
            f"Holm {_p(row['p_holm'])}")


def _unresolved_reason(row: dict) -> str:
    if row["n"] < 2:
        return f"with {row['n']} paired seed(s) there is no seed-paired test"
    why = []
    if not (row["lo"] > 0 or row["hi"] < 0):
        why.append("its seed-paired interval includes 0")
    if not row["p_holm"] < ALPHA:
        why.append(f"its Holm-adjusted p is {_p(row['p_holm'])} (not below {ALPHA:g})")
    return " and ".join(why)


def verdict(cmp: dict, arm: str, base: str, split: str, acc_margin: float = ACC_MARGIN) -> str:
    """One sentence opening with "<split>, <arm>:", from `stats.compare`'s output after
    `stats.finalize` (its "ece" and "accuracy" entries; module docstring)."""
    e, a = cmp["ece"], cmp["accuracy"]
    nums = f"{_numbers(e, 'ECE')}; {_numbers(a, 'accuracy')}; against {base}"
    if e["resolved"] and e["mean"] < 0:
        if not math.isnan(a["lo"]) and a["lo"] >= -acc_margin:
            return f"{split}, {arm}: supported. {arm} lowers ECE without losing accuracy ({nums})."
        if a["resolved"] and a["mean"] < 0:
            return f"{split}, {arm}: ECE is lower, but accuracy drops. {arm} is not better at equal accuracy ({nums})."
        return (f"{split}, {arm}: ECE is lower, but equal accuracy is not shown: the accuracy interval reaches "
                f"below -{acc_margin:g} ({nums}).")
    if e["resolved"]:
        return f"{split}, {arm}: contradicted. {arm} raises ECE ({nums})."
    return f"{split}, {arm}: not resolved. The ECE difference is not resolved: {_unresolved_reason(e)} ({nums})."


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
