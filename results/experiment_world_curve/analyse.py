"""The world learning curve's table and figure, from the committed records only.

    python results/experiment_world_curve/analyse.py   # writes CURVE.md and curve.png beside it

Per arm and step (runs/<arm>-s0/metrics.jsonl, the training rollouts: 16 trajectories a
step): accuracy, mean stated q, the AUROC and corr(q, c) of the sampled confidences, each also
pooled over windows of 10 steps (AUROC over the pooled trajectories is not recoverable from
the per-step values, so the window rows average the per-step values over the steps where they
are defined). Held out (evals/<unit>/<split>/samples.jsonl, greedy, 100 questions a split):
accuracy, the stated and the expected confidence's AUROC, and each arm's expected-AUROC
difference from the warm start with a paired bootstrap over questions (the same questions,
resampled together; 2,000 resamples, seed 0).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
WINDOW = 10
N_BOOT = 2000


def auroc(q: np.ndarray, c: np.ndarray) -> float:
    """P(q of a correct row > q of a wrong row), ties counted half; NaN with one class."""
    pos, neg = q[c], q[~c]
    if len(pos) == 0 or len(neg) == 0:
        return math.nan
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0) + 0.5 * (diff == 0)).mean())


def number(v) -> float:
    return math.nan if v is None or isinstance(v, str) else float(v)


def curve(arm: str) -> list[dict]:
    path = HERE / "runs" / f"{arm}-s0" / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r["step"], "accuracy": number(r.get("accuracy")), "q": number(r.get("confidence")),
             "auroc": number(r.get("calib/auroc")), "corr": number(r.get("calib/corr_qc")),
             "q_sd": number(r.get("calib/q_group_sd")), "format": number(r.get("format_ok"))} for r in rows]


def samples(unit: str, split: str) -> list[dict] | None:
    path = HERE / "evals" / unit / split / "samples.jsonl"
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out(unit: str, split: str, warm: list[dict] | None) -> dict | None:
    rows = samples(unit, split)
    if rows is None:
        return None
    c = np.array([r["correct"] for r in rows], bool)
    q = np.array([r["confidence"] for r in rows], float)
    e = np.array([r["expected_confidence"] for r in rows], float)
    out = {"n": len(rows), "accuracy": float(c.mean()), "auroc": auroc(q, c), "expected_auroc": auroc(e, c)}
    if warm is not None and unit != "warm":
        by_id = {r["id"]: r for r in warm}
        ids = [r["id"] for r in rows if r["id"] in by_id]
        cw = np.array([by_id[i]["correct"] for i in ids], bool)
        ew = np.array([by_id[i]["expected_confidence"] for i in ids], float)
        keep = {r["id"]: r for r in rows}
        ca = np.array([keep[i]["correct"] for i in ids], bool)
        ea = np.array([keep[i]["expected_confidence"] for i in ids], float)
        rng = np.random.default_rng(0)
        diffs = []
        for _ in range(N_BOOT):
            idx = rng.integers(0, len(ids), len(ids))
            d = auroc(ea[idx], ca[idx]) - auroc(ew[idx], cw[idx])
            if not math.isnan(d):
                diffs.append(d)
        out["vs_warm"] = auroc(ea, ca) - auroc(ew, cw)
        out["vs_warm_ci"] = [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]
    return out


def window_rows(points: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for start in range(1, max((p["step"] for p in points), default=0) + 1, WINDOW):
        part = [p for p in points if start <= p["step"] < start + WINDOW]
        mean = {k: float(np.nanmean([p[k] for p in part])) if any(not math.isnan(p[k]) for p in part) else math.nan
                for k in ("accuracy", "q", "auroc", "corr", "q_sd", "format")}
        defined = sum(not math.isnan(p["auroc"]) for p in part)
        out.append((f"{part[0]['step']}-{part[-1]['step']}", {**mean, "defined": defined}))
    return out


def fmt(v: float) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:.3f}"


def main() -> None:
    # car: MSCR (b1 = b2 = 1), the arm experiment.yaml gains when it is run; rlcr_dapo: RESULTS.md
    # 2c, the Brier arm with dynamic sampling
    arms = ("rlcr", "car", "vanilla", "rlcr_dapo")
    curves = {arm: curve(arm) for arm in arms}
    lines = ["# World learning curve (records of configs/experiment/world_curve_cpu.yaml)", "",
             "Written by `python results/experiment_world_curve/analyse.py` from the records in this folder.", "",
             "## Training rollouts, per window of 10 steps (16 trajectories a step)", "",
             "| arm | steps | accuracy | mean q | AUROC(q) | corr(q, c) | group SD of q | format | steps with AUROC |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in arms:
        for label, m in window_rows(curves[arm]):
            lines.append(f"| {arm} | {label} | {fmt(m['accuracy'])} | {fmt(m['q'])} | {fmt(m['auroc'])} | "
                         f"{fmt(m['corr'])} | {fmt(m['q_sd'])} | {fmt(m['format'])} | {m['defined']} |")
        if not curves[arm]:
            lines.append(f"| {arm} | not run | | | | | | | |")
    lines += ["", "## Held out (greedy, 100 questions a split)", "",
              "| policy | split | accuracy | AUROC stated q | AUROC expected q | expected - warm [95% paired bootstrap] |",
              "|---|---|---:|---:|---:|---|"]
    for split in ("id", "ood"):
        warm = samples("warm", split)
        for unit in ("warm", "rlcr-s0", "car-s0", "vanilla-s0"):
            h = held_out(unit, split, warm)
            if h is None:
                lines.append(f"| {unit} | {split} | not evaluated | | | |")
                continue
            vs = (f"{h['vs_warm']:+.3f} [{h['vs_warm_ci'][0]:+.3f}, {h['vs_warm_ci'][1]:+.3f}]"
                  if "vs_warm" in h else "")
            lines.append(f"| {unit} | {split} | {fmt(h['accuracy'])} | {fmt(h['auroc'])} | "
                         f"{fmt(h['expected_auroc'])} | {vs} |")
    (HERE / "CURVE.md").write_text("\n".join(lines) + "\n")
    plot(curves)
    print("\n".join(lines))


def plot(curves: dict[str, list[dict]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for arm, points in curves.items():
        if not points:
            continue
        steps = [p["step"] for p in points]
        for ax, key, title in zip(axes, ("auroc", "corr", "q"),
                                  ("AUROC of sampled q (rollouts)", "corr(q, correct)", "mean stated q")):
            ax.plot(steps, [p[key] for p in points], marker=".", label=arm)
            ax.set_title(title)
            ax.set_xlabel("GRPO step")
    axes[0].axhline(0.5, color="grey", lw=0.8, ls="--")
    axes[1].axhline(0.0, color="grey", lw=0.8, ls="--")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(HERE / "curve.png", dpi=110)


if __name__ == "__main__":
    main()
