"""The experiment's report, rebuilt from its run folders alone (`car-jax experiment --report`),
written to a folder (default <dir>/report): RESULTS.md there, the rest in its `results/`:

    results.json     every number below (per split: each policy's metrics with intervals and
                     per-seed values; each arm against the baseline, paired: seed-paired t,
                     question bootstrap, McNemar, Holm-adjusted p, resolved; the power
                     analysis; the equivalence check; the data order the runs used)
    RESULTS.md       the tables, relative ECE change, power, figures, commands and verdict
                     (`car_jax.experiment.markdown`; the statistics: `stats`, the sentences: `verdict`)
    curves.png       reward, ECE and mean confidence per training step (mean over seeds, and
                     each seed thin)
    reliability_<split>.png   reliability diagrams per policy (seeds pooled)

Figures use matplotlib's object API, like `car_jax.calibration.plots`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from car_jax.calibration import metrics
from car_jax.config import parse_yaml
from car_jax.eval.runner import SAMPLES_FILE, SUMMARY_FILE, read_samples
from car_jax.experiment import stats, verdict
from car_jax.experiment.config import ExperimentConfig
from car_jax.experiment.markdown import markdown
from car_jax.experiment.runner import PROGRESS_FILE, REBUILT, equivalence_rewards, is_done, plan, status

ASSETS = "results"  # the folder beside RESULTS.md that holds its figures and results.json
CURVE_KEYS = (("reward", "reward"), ("ece", "ECE (train rollouts)"), ("confidence", "mean confidence"))
EQUIV_KEYS = ("loss", "kl", "entropy", "accuracy", "ece", "confidence", "grad_norm")


def _rows(path: Path) -> list[dict]:
    """A JSONL file's rows ([] when it does not exist yet); a run still writing it may leave a
    torn last line, which is skipped (`read_samples`)."""
    return read_samples(path, missing_ok=True)


def collect(cfg: ExperimentConfig) -> dict:
    """{split: {policy: {run name: {"seed", "records", "summary"}}}} from evals/ ("warm":
    {"warm": ...} with seed None; an arm: {"<arm>-s<seed>": ...} for each evaluated seed), with
    only the evaluations that are complete (a policy with none is left out), so a report can be
    made while the experiment is still running."""
    root, out = Path(cfg.dir), {}
    done = {u.name for u in plan(cfg) if u.kind == "eval" and is_done(u)}
    for split in cfg.eval.splits:
        out[split] = {}
        for policy, seeds in [("warm", [None])] + [(arm, list(cfg.seeds)) for arm in cfg.arms]:
            runs = {}
            for s in seeds:
                name = policy if s is None else f"{policy}-s{s}"
                if f"eval/{name}/{split}" in done:
                    folder = root / "evals" / name / split
                    runs[name] = {"seed": s, "records": read_samples(folder / SAMPLES_FILE),
                                  "summary": json.loads((folder / SUMMARY_FILE).read_text())}
            if runs:
                out[split][policy] = runs
    return out


def shuffle_seeds(cfg: ExperimentConfig) -> dict[str, int]:
    """{run name: the data.shuffle_seed its saved config.yaml says} for every GRPO run that has
    one: what the runs did, read from their folders (the report's Setup line)."""
    out = {}
    for arm in cfg.arms:
        for s in cfg.seeds:
            path = Path(cfg.dir) / "runs" / f"{arm}-s{s}" / "config.yaml"
            if path.is_file():
                out[f"{arm}-s{s}"] = int(parse_yaml(path.read_text())["data"]["shuffle_seed"])
    return out


def equivalence_check(cfg: ExperimentConfig) -> dict | None:
    """The two equivalence runs' metrics side by side: per step, the reward ratio (expected
    1 + b) and the largest relative difference of the other metrics (expected ~0)."""
    if not cfg.equivalence.steps:
        return None
    root, b = Path(cfg.dir) / "equivalence", cfg.equivalence.b
    a, w = (_rows(root / name / "metrics.jsonl") for name in equivalence_rewards(b, 0.0))
    steps = []
    for ra, rw in zip(a, w):
        rel = {k: abs(ra[k] - rw[k]) / max(abs(ra[k]), abs(rw[k]), 1e-12) for k in EQUIV_KEYS
               if k in ra and k in rw and not (math.isnan(ra[k]) and math.isnan(rw[k]))}
        steps.append({"step": ra["step"], "reward_mscr": ra["reward"], "reward_weighted_brier": rw["reward"],
                      "ratio": ra["reward"] / rw["reward"] if rw["reward"] else float("nan"),
                      "max_rel_diff": max(rel.values()) if rel else float("nan"),
                      "worst": max(rel, key=rel.get) if rel else None})
    return {"b": b, "expected_ratio": 1 + b, "steps": steps}


def paired_runs(policies: dict, arm: str, base: str) -> tuple[list[int], list[dict], list[dict]]:
    """The seeds both `arm` and `base` have evaluated, and their runs in that seed order."""
    by_seed = {p: {r["seed"]: r for r in policies.get(p, {}).values()} for p in (arm, base)}
    seeds = [s for s in by_seed[base] if s in by_seed[arm]]
    return seeds, [by_seed[arm][s] for s in seeds], [by_seed[base][s] for s in seeds]


def comparisons(cfg: ExperimentConfig, data: dict) -> dict:
    """{split: {arm: stats.compare(...)}} for every arm but the baseline over the seeds both
    have, with Holm over all of them (stats.finalize); each gains "seeds" (the paired seeds)."""
    out = {}
    for i, (split, policies) in enumerate(data.items()):
        out[split] = {}
        for j, arm in enumerate(a for a in cfg.arms if a != cfg.baseline):
            seeds, runs, base = paired_runs(policies, arm, cfg.baseline)
            if seeds:
                out[split][arm] = {**stats.compare(runs, base, cfg.eval.compare, cfg.eval.n_boot, seed=100 * i + j),
                                   "seeds": seeds}
    return out


def build(cfg: ExperimentConfig, data: dict) -> dict:
    """The report's numbers (results.json without its figures) from `collect(cfg)`."""
    res = {"splits": {}, "baseline": cfg.baseline, "arms": list(cfg.arms), "seeds": list(cfg.seeds),
           "data_order": cfg.data_order, "shuffle_seeds": shuffle_seeds(cfg), "compare": list(cfg.eval.compare)}
    vs_all = comparisons(cfg, data)
    family = stats.finalize(vs_all)
    res["holm_family"] = family
    for split, policies in data.items():
        summ = {name: stats.arm_summary(list(runs.values()), cfg.eval.n_boot, seed=i)
                for i, (name, runs) in enumerate(policies.items())}
        per_run = {run: {"modal": summ[name]["modal"][j], **{k: summ[name][k]["per_seed"][j] for k in stats.REPORTED}}
                   for name, runs in policies.items() for j, run in enumerate(runs)}
        vs = vs_all[split]
        res["splits"][split] = {
            "policies": summ,
            "vs_baseline": vs,
            "runs": per_run,
            "power": {arm: stats.power_analysis(d["ece"], delta=cfg.eval.power_delta, family=family)
                      for arm, d in vs.items()},
            "verdicts": {arm: verdict.verdict(d, arm, cfg.baseline, split) for arm, d in vs.items()},
            "collapse": verdict.collapse_note(split, per_run)}
    res["equivalence"] = equivalence_check(cfg)
    progress = _rows(Path(cfg.dir) / PROGRESS_FILE)
    done = [d for _, d in status(cfg)]
    res["budget"] = {"units_timed": len([p for p in progress if p["unit"] != REBUILT]),
                     "seconds": sum(p["seconds"] for p in progress), "units": len(done), "units_done": sum(done)}
    res["warm_rebuilds"] = [p.get("identical") for p in progress if p["unit"] == REBUILT]
    res["complete"] = all(done)
    return res


# ---------------------------------------------------------------- figures
def curves_figure(cfg: ExperimentConfig, path: Path) -> None:
    fig = Figure(figsize=(12, 3.4), dpi=110)
    axes = fig.subplots(1, len(CURVE_KEYS))
    for color, arm in zip(("tab:gray", "tab:blue", "tab:red", "tab:green", "tab:purple"), cfg.arms):
        runs = [r for s in cfg.seeds if (r := _rows(Path(cfg.dir) / "runs" / f"{arm}-s{s}" / "metrics.jsonl"))]
        if not runs:
            continue
        for ax, (key, label) in zip(axes, CURVE_KEYS):
            for rows in runs:
                ax.plot([r["step"] for r in rows], [r[key] for r in rows], color=color, alpha=0.25, lw=0.8)
            n = min(len(r) for r in runs)
            if n:  # the steps every seed has reached
                mean = np.nanmean([[r[key] for r in rows[:n]] for rows in runs], axis=0)
                ax.plot([r["step"] for r in runs[0][:n]], mean, color=color, lw=2, label=arm)
            ax.set(xlabel="GRPO step", title=label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def reliability_figure(records: dict, split: str, path: Path) -> None:
    """One reliability panel per policy ({name: {run name: {"records", ...}}}), seeds pooled."""
    fig = Figure(figsize=(3.2 * len(records), 3.4), dpi=110)
    axes = np.atleast_1d(fig.subplots(1, len(records)))
    edges = metrics.bin_edges(10)
    for ax, (name, per_seed) in zip(axes, records.items()):
        pooled = [r for run in per_seed.values() for r in run["records"]]
        c, q = stats.arrays(pooled)
        count, mean_q, acc = (np.asarray(a) for a in metrics.bin_stats(c, q, 10))
        full = count > 0
        ax.bar(edges[:-1][full], acc[full], np.diff(edges)[full], align="edge", color="tab:blue", edgecolor="black")
        ax.plot(mean_q[full], acc[full], "o", color="tab:red", ms=3)
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ece = stats.seed_metrics(pooled)["ece"]
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", title=f"{name}: ECE {ece:.3f}, n={len(pooled)}")
    axes[0].set_ylabel(f"accuracy ({split})")
    fig.tight_layout()
    fig.savefig(path)


def _clean(x):
    """NaN and +-inf -> None, recursively (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_report(cfg: ExperimentConfig, out_dir: str | Path | None = None, commands: Sequence[str] = ()) -> Path:
    """Builds the report from cfg.dir's folders into out_dir (default <dir>/report): RESULTS.md,
    and results.json and the PNGs in out_dir/results. Returns the RESULTS.md path."""
    out = Path(out_dir) if out_dir else Path(cfg.dir) / "report"
    (out / ASSETS).mkdir(parents=True, exist_ok=True)
    data = collect(cfg)
    res = build(cfg, data)
    figs = {"curves": f"{ASSETS}/curves.png"}
    curves_figure(cfg, out / figs["curves"])
    for split in cfg.eval.splits:
        if data[split]:  # a partial report may have no evaluation of a split yet
            figs[f"reliability_{split}"] = f"{ASSETS}/reliability_{split}.png"
            reliability_figure(data[split], split, out / figs[f"reliability_{split}"])
    (out / ASSETS / "results.json").write_text(json.dumps(_clean(res), indent=2) + "\n")
    path = out / "RESULTS.md"
    path.write_text(markdown(cfg, res, commands, figs))
    return path
