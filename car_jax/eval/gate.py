"""Confidence-gated tool use (`car-jax eval --gate TAU`): calibration used at inference time.

The gated agent first answers without its tool (mode `direct`) and states a confidence q;
when q < TAU it discards that answer and runs the tool episode (mode `search`, or `tir`)
instead. TAU = 0 never calls the tool; any TAU above every direct confidence always does.

Episodes are independent and greedy, so the gated outcome of every TAU follows from two
ordinary evaluations of the same examples, one per mode: `run_gate` runs them (each its own
resumable `car-jax eval` folder, `<out>/direct` and `<out>/<tool mode>`), then combines
them. Files in `<out>`:
    gate.json        {"tau", "tool_mode", "summary" (the gated agent at TAU, as eval's
                     summary.json), "curve" (one row per TAU of the grid), "direct",
                     "tool" (the two plain summaries' main numbers)}
    samples.jsonl    the gated agent's record per example at TAU (`gated`: the tool ran)
    gate.png         accuracy, ECE and tool calls per question against TAU
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

from car_jax import hosts
from car_jax.calibration import metrics
from car_jax.data import load_dataset
from car_jax.eval.job import output_dir, run_eval
from car_jax.eval.runner import SAMPLES_FILE, read_samples, summarize

GATE_FILE, GATE_PLOT = "gate.json", "gate.png"
TOOL_MODES = ("search", "tir")
DEFAULT_GRID = tuple(round(0.05 * i, 2) for i in range(21))  # 0, 0.05, ..., 1
CURVE_KEYS = ("accuracy", "ece", "auroc", "brier", "mean_confidence")


def check_tau(tau: float) -> float:
    """TAU is a confidence in [0, 1] (the records' scale, not the model's 0-100)."""
    if not 0.0 <= tau <= 1.0:
        hint = f"; for a confidence of {tau:g} out of 100 pass {tau / 100:g}" if 1 < tau <= 100 else ""
        raise ValueError(f"--gate {tau:g}: TAU must be a confidence in [0, 1]{hint}")
    return float(tau)


def _by_id(direct: Sequence[dict], tool: Sequence[dict]) -> list[tuple[dict, dict]]:
    """Pairs the two modes' records of each example, in the direct records' order."""
    tool_of = {r["id"]: r for r in tool}
    missing = [r["id"] for r in direct if r["id"] not in tool_of]
    if missing or len(tool_of) != len(direct):
        raise ValueError(f"the direct and tool evaluations hold different examples ({len(direct)} vs "
                         f"{len(tool_of)}; e.g. {missing[:3]} only in direct); run both on the same data")
    return [(r, tool_of[r["id"]]) for r in direct]


def gate_records(direct: Sequence[dict], tool: Sequence[dict], tau: float) -> list[dict]:
    """The gated agent's record per example: the direct record when its confidence >= tau,
    else the tool record; each with `gated` (the tool ran) and `n_tool_calls` (0 when kept)."""
    out = []
    for d, t in _by_id(direct, tool):
        gated = d["confidence"] < tau
        rec = dict(t if gated else d)
        rec.update(gated=bool(gated), n_tool_calls=int(t.get("n_tool_calls", 0)) if gated else 0,
                   direct_confidence=d["confidence"])
        out.append(rec)
    return out


def gate_curve(direct: Sequence[dict], tool: Sequence[dict], taus: Sequence[float] = DEFAULT_GRID) -> list[dict]:
    """One row per TAU: tau, gated_rate (share of questions that ran the tool),
    tool_calls (mean tool calls per question), and CURVE_KEYS of the gated agent."""
    rows = []
    for tau in taus:
        recs = gate_records(direct, tool, check_tau(tau))
        with warnings.catch_warnings():  # a one-class row's AUROC is reported as None
            warnings.simplefilter("ignore", RuntimeWarning)
            m = metrics.calibration(np.array([r["correct"] for r in recs], bool),
                                    np.array([r["confidence"] for r in recs], np.float32))
        rows.append({"tau": float(tau), "gated_rate": float(np.mean([r["gated"] for r in recs])),
                     "tool_calls": float(np.mean([r["n_tool_calls"] for r in recs])),
                     **{k: (None if np.isnan(m[k]) else float(m[k])) for k in CURVE_KEYS}})
    return rows


def format_curve(curve: Sequence[dict], tau: float | None = None) -> str:
    """A text table of the curve; the row of `tau` is marked with '*'."""
    head = f"{'TAU':>6}  {'tool ran':>8}  {'calls/q':>7}  {'accuracy':>8}  {'ECE':>6}  {'AUROC':>6}  {'mean q':>6}"
    fmt = lambda v: "   n/a" if v is None else f"{v:6.3f}"  # noqa: E731
    lines = [head]
    for r in curve:
        mark = "*" if tau is not None and abs(r["tau"] - tau) < 1e-9 else " "
        lines.append(f"{r['tau']:5.2f}{mark}  {r['gated_rate']:8.3f}  {r['tool_calls']:7.3f}  {r['accuracy']:8.3f}  "
                     f"{fmt(r['ece'])}  {fmt(r['auroc'])}  {fmt(r['mean_confidence'])}")
    return "\n".join(lines)


def gate_plot(curve: Sequence[dict], path: str | Path, title: str = "confidence-gated tool use") -> None:
    """Accuracy and ECE (left axis) and tool calls per question (right axis) against TAU
    (matplotlib's object API, as `car_jax.calibration.plots`)."""
    tau = [r["tau"] for r in curve]
    fig = Figure(figsize=(5.5, 3.6), dpi=120)
    ax = fig.subplots()
    ax.plot(tau, [r["accuracy"] for r in curve], "o-", label="accuracy")
    ax.plot(tau, [np.nan if r["ece"] is None else r["ece"] for r in curve], "s-", label="ECE")
    ax.set(xlabel="TAU (run the tool when the direct confidence < TAU)", ylim=(0, 1), title=title)
    right = ax.twinx()
    right.plot(tau, [r["tool_calls"] for r in curve], "^--", color="tab:gray", label="tool calls / question")
    right.set_ylabel("tool calls per question")
    right.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def run_gate(cfg, tau: float, *, grid: Sequence[float] = DEFAULT_GRID, log=print) -> dict:
    """`car-jax eval --gate TAU`: evaluates `cfg` (an EvalConfig whose mode is the tool mode)
    in mode direct and in its own mode, under <output dir>/direct and /<mode> (both resume, so
    an interrupted gate run continues), then writes the gated files (module docstring) and
    returns gate.json's content."""

    tau = check_tau(tau)
    if cfg.mode not in TOOL_MODES:
        raise ValueError(f"--gate needs a tool mode (mode={' or mode='.join(TOOL_MODES)}), not mode={cfg.mode!r}")
    out = output_dir(cfg) if cfg.output.dir else Path(str(output_dir(cfg)) + "-gate")
    summaries, records = {}, {}
    for mode in ("direct", cfg.mode):
        sub = dataclasses.replace(cfg, mode=mode, output=dataclasses.replace(cfg.output, dir=str(out / mode),
                                                                               resume=True))
        log(f"gate: mode {mode} -> {out / mode}")
        summaries[mode] = run_eval(sub, log=log)
        records[mode] = read_samples(out / mode / SAMPLES_FILE) if hosts.is_writer() else None
    if not hosts.is_writer():
        return {}
    # this run's examples only, in data order (a resumed folder may hold more)
    ids = [e.id for e in load_dataset(cfg.data.path, split=cfg.data.split, limit=cfg.data.limit)]
    direct, tool = (_select(records[m], ids) for m in ("direct", cfg.mode))
    gated = gate_records(direct, tool, tau)
    summary = {"mode": f"gate {tau:g}", "data": summaries[cfg.mode].get("data"),
               **summarize(gated, n_boot=cfg.output.n_boot, seed=cfg.seed)}
    summary["gated_rate"] = float(np.mean([r["gated"] for r in gated]))
    grid = sorted({*map(check_tau, grid), tau})
    result = {"tau": tau, "tool_mode": cfg.mode, "summary": summary, "curve": gate_curve(direct, tool, grid),
              "direct": _main_numbers(summaries["direct"]), "tool": _main_numbers(summaries[cfg.mode])}
    (out / SAMPLES_FILE).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in gated))
    (out / GATE_FILE).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    gate_plot(result["curve"], out / GATE_PLOT, title=f"gated {cfg.mode} on {summary['data']}")
    result["out"] = str(out)
    return result


def _select(records: list[dict], ids: list[str]) -> list[dict]:
    by_id = {r["id"]: r for r in records}
    return [by_id[i] for i in ids]


def _main_numbers(summary: dict) -> dict:
    keys = ("n", *CURVE_KEYS, "mcip", "format_rate", "mean_tool_calls")
    return {k: summary.get(k) for k in keys}
