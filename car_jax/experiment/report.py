"""The experiment's report, rebuilt from its run folders alone (`car-jax experiment --report`),
written to a folder (default <dir>/report): RESULTS.md there, the rest in its `results/`:

    results.json     every number below (per split: each policy's metrics with intervals and
                     per-seed values; each arm against the baseline; the equivalence check)
    RESULTS.md       the tables, relative ECE change, figures, commands and verdict
    curves.png       reward, ECE and mean confidence per training step (mean over seeds, and
                     each seed thin)
    reliability_<split>.png   reliability diagrams per policy (seeds pooled)

Figures use matplotlib's object API, like `car_jax.calibration.plots`.
"""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from car_jax.calibration import metrics
from car_jax.eval.runner import SAMPLES_FILE, read_samples
from car_jax.experiment import stats
from car_jax.experiment.config import ExperimentConfig
from car_jax.experiment.runner import PROGRESS_FILE, REBUILT, equivalence_rewards, is_done, plan, status

ASSETS = "results"  # the folder beside RESULTS.md that holds its figures and results.json
CURVE_KEYS = (("reward", "reward"), ("ece", "ECE (train rollouts)"), ("confidence", "mean confidence"))
EQUIV_KEYS = ("loss", "kl", "entropy", "accuracy", "ece", "confidence", "grad_norm")


def _rows(path: Path) -> list[dict]:
    """A JSONL file's rows ([] when it does not exist yet); a run still writing it may leave a
    torn last line, which is skipped (`read_samples`)."""
    return read_samples(path, missing_ok=True)


def collect(cfg: ExperimentConfig) -> dict:
    """{split: {policy: {run name: records}}} from evals/ ("warm": {"warm": records}; an arm:
    {"<arm>-s<seed>": records} for each evaluated seed), with only the evaluations that are
    complete (a policy with none is left out), so a report can be made while the experiment is
    still running."""
    root, out = Path(cfg.dir), {}
    done = {u.name for u in plan(cfg) if u.kind == "eval" and is_done(u)}
    for split in cfg.eval.splits:
        out[split] = {}
        for policy, seeds in [("warm", [None])] + [(arm, list(cfg.seeds)) for arm in cfg.arms]:
            names = [policy if s is None else f"{policy}-s{s}" for s in seeds]
            recs = {n: read_samples(root / "evals" / n / split / SAMPLES_FILE) for n in names
                    if f"eval/{n}/{split}" in done}
            if recs:
                out[split][policy] = recs
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


def build(cfg: ExperimentConfig, data: dict) -> dict:
    """The report's numbers (results.json without its figures) from `collect(cfg)`."""
    res = {"splits": {}, "baseline": cfg.baseline, "arms": list(cfg.arms), "seeds": list(cfg.seeds)}
    for split, policies in data.items():
        summ = {name: stats.arm_summary(list(recs.values()), cfg.eval.n_boot, seed=i)
                for i, (name, recs) in enumerate(policies.items())}
        runs = {run: {"modal": summ[name]["modal"][j], **{k: summ[name][k]["per_seed"][j] for k in stats.REPORTED}}
                for name, recs in policies.items() for j, run in enumerate(recs)}
        base = summ.get(cfg.baseline)
        vs = {} if base is None else {arm: stats.compare(summ[arm], base) for arm in cfg.arms
                                      if arm != cfg.baseline and arm in summ}
        res["splits"][split] = {
            "policies": {k: {m: v for m, v in s.items() if m != "_draws"} for k, s in summ.items()},
            "vs_baseline": vs,
            "runs": runs,
            "verdicts": {arm: stats.verdict(d, arm, cfg.baseline, split) for arm, d in vs.items()},
            "collapse": stats.collapse_note(split, runs)}
    res["equivalence"] = equivalence_check(cfg)
    progress = _rows(Path(cfg.dir) / PROGRESS_FILE)
    done = [d for _, d in status(cfg)]
    res["budget"] = {"units_timed": len([p for p in progress if p["unit"] != REBUILT]),
                     "seconds": sum(p["seconds"] for p in progress), "units": len(done), "units_done": sum(done)}
    res["warm_rebuilds"] = [p.get("identical") for p in progress if p["unit"] == REBUILT]
    res["complete"] = all(done)
    return res


def _rebuild_lines(rebuilds: list) -> list[str]:
    """The Setup line on rebuilds of the warm start's pruned weights between sittings."""
    if not rebuilds:
        return []
    word = {True: "identical", False: "DIFFERENT", None: "not compared (no first hashes)"}
    return [f"- The warm start's weights were pruned and rebuilt from its demonstrations {len(rebuilds)} "
            "time(s) between sittings; SHA-256 against the first build: "
            + ", ".join(word[r] for r in rebuilds) + "."]


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
    """One reliability panel per policy ({name: {run name: records}}), seeds pooled."""
    fig = Figure(figsize=(3.2 * len(records), 3.4), dpi=110)
    axes = np.atleast_1d(fig.subplots(1, len(records)))
    edges = metrics.bin_edges(10)
    for ax, (name, per_seed) in zip(axes, records.items()):
        pooled = [r for recs in per_seed.values() for r in recs]
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


# ---------------------------------------------------------------- markdown
def _cell(m: dict) -> str:
    if m["mean"] is None or math.isnan(m["mean"]):
        return "n/a"
    ci = "" if math.isnan(m["lo"]) else f" [{m['lo']:.3f}, {m['hi']:.3f}]"
    return f"{m['mean']:.3f}{ci}"


def markdown(cfg: ExperimentConfig, res: dict, commands: Sequence[str], figures: dict[str, str]) -> str:
    t, w = cfg.train, cfg.warm_start
    lines = ["# Results: calibration rewards for a search agent", "",
             f"Generated by the experiment's report step on {datetime.date.today().isoformat()} from the run "
             f"folders under `{cfg.dir}`; every number below is recomputed from their per-example files.", "",
             "## Setup", "",
             f"- Model: `{t.model.path or 'embedded SmolLM2-135M-Instruct'}` ({t.model.dtype}).",
             f"- Training data: `{t.data.train}` split `{t.data.train_split}` (limit {t.data.limit}); "
             f"tool: `{t.tools.retriever}` top-{t.tools.topk}.",
             f"- Shared warm start: {w.steps} SFT steps of batch {w.batch}, lr {w.lr:g}; demonstrations state "
             f"confidence `{w.confidence}` (no information about correctness"
             f"{'' if w.confidence != 'informative' else ': NOT the case here'}).",
             *_rebuild_lines(res.get("warm_rebuilds", [])),
             f"- GRPO: {t.rl.steps} steps x {t.rl.prompts_per_step} prompts x G = {t.rollout.group_size}, "
             f"lr {t.rl.optim.lr:g}, KL {t.rl.loss.kl_coef:g}, at most {t.rollout.max_turns} search "
             f"turn{'s' * (t.rollout.max_turns != 1)} of "
             f"{t.rollout.max_response_tokens} tokens.",
             f"- Arms: " + ", ".join(f"`{a}` ({r.kind})" for a, r in cfg.arms.items())
             + f"; seeds {list(cfg.seeds)}; baseline `{cfg.baseline}`.",
             f"- Evaluation: greedy, splits " + ", ".join(
                 f"`{s}` = {d.path}:{d.split} (the first {d.limit or 'all'} questions)"
                 for s, d in cfg.eval.splits.items()) + ".",
             f"- Intervals: 95%, two-level bootstrap over seeds and examples ({cfg.eval.n_boot} draws).",
             f"- Compute: {res['budget']['seconds'] / 3600:.2f} h over the {res['budget']['units_timed']} timed units "
             f"(of {res['budget']['units']}).", "",
             "## Commands", "", "```", *commands, "```", ""]
    if not res["complete"]:
        b = res["budget"]
        lines[2:2] = ["**Partial report: the experiment is still running** "
                      f"({b['units_done']} of {b['units']} units done). The tables hold the policies evaluated "
                      "so far, each with the number of seeds it has; the verdict waits for every run.", ""]
    for split, sres in res["splits"].items():
        lines += [f"## Split `{split}`", "",
                  "| policy | accuracy | ECE | MCIP | AUROC | Brier | mean confidence |",
                  "|---|---|---|---|---|---|---|"]
        for name, p in sres["policies"].items():
            label = "warm start (before RL)" if name == "warm" else f"{name} ({p['seeds']} seed{'s' * (p['seeds'] > 1)})"
            lines.append(f"| {label} | " + " | ".join(_cell(p[k]) for k in stats.REPORTED) + " |")
        lines += ["", f"Against `{cfg.baseline}` (difference, and ECE change relative to it):", "",
                  "| arm | accuracy diff | ECE diff | relative ECE change |", "|---|---|---|---|"]
        for arm, d in sres["vs_baseline"].items():
            rel = d["rel_ece"]
            rel_cell = "n/a" if math.isnan(rel["mean"]) else (
                f"{100 * rel['mean']:+.1f}% [{100 * rel['lo']:+.1f}%, {100 * rel['hi']:+.1f}%]")
            lines.append(f"| {arm} | {_cell(d['d_accuracy'])} | {_cell(d['d_ece'])} | {rel_cell} |")
        lines += ["", "Each run (the seed-level values behind the rows above; the last columns give the "
                  "confidence the policy states most often, and on what share of the questions it states "
                  f"that value, or one within {100 * stats.NEAR:g} points of it):", "",
                  f"| run | accuracy | ECE | AUROC | mean confidence | most stated | share | share within {100 * stats.NEAR:g} |",
                  "|---|---|---|---|---|---|---|---|"]
        for run, r in sres["runs"].items():
            lines.append(f"| {run} | " + " | ".join("n/a" if math.isnan(r[k]) else f"{r[k]:.3f}"
                                                   for k in ("accuracy", "ece", "auroc", "mean_confidence"))
                         + f" | {100 * r['modal']['value']:.0f} | {100 * r['modal']['share']:.0f}% | "
                         f"{100 * r['modal']['near']:.0f}% |")
        if f"reliability_{split}" in figures:
            lines += ["", f"![reliability diagrams, {split}]({figures[f'reliability_{split}']})"]
        lines.append("")
    lines += ["## Training curves", "", f"![training curves]({figures['curves']})", ""]
    eq = res["equivalence"]
    if eq:
        lines += ["## MSCR with b1 = b2 = b against (1 + b) x weighted Brier", "",
                  f"Two runs from the warm start with the same seed: MSCR (b = {eq['b']:g}) and weighted Brier "
                  f"(w = b / (1 + b), format penalty / (1 + b)). GRPO normalizes rewards within each group, so "
                  f"the runs should match step for step while their rewards differ by the factor "
                  f"{eq['expected_ratio']:g}.", "",
                  "| step | reward MSCR | reward weighted Brier | ratio | largest relative difference (metric) |",
                  "|---|---|---|---|---|"]
        for s in eq["steps"]:
            lines.append(f"| {s['step']} | {s['reward_mscr']:.4f} | {s['reward_weighted_brier']:.4f} | "
                         f"{s['ratio']:.4f} | {s['max_rel_diff']:.2e} ({s['worst']}) |")
        lines.append("")
    lines += ["## Verdict", ""]
    if not res["complete"]:
        lines.append("Not yet: the experiment is still running.")
    for split, sres in res["splits"].items():
        if res["complete"]:
            lines += [f"- {v}" for v in sres["verdicts"].values()]
            lines += [f"- {sres['collapse']}"] if sres["collapse"] else []
    lines.append("")
    return "\n".join(lines)


def _clean(x):
    """NaN -> None, recursively (strict JSON)."""
    if isinstance(x, float):
        return None if math.isnan(x) else x
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
