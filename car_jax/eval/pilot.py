"""The confidence-dichotomy pilot (`car-jax pilot`): does a tool raise or lower overconfidence?

For each tool kind, three settings on the same questions (the paper's pilot study):
    tool kind      data (default)                  direct         prompt           rl
    evidence       world-large dev (QA)            mode direct    mode search      mode search, checkpoint
    verification   world-large arith_dev (math;    mode direct    mode tir (code)  mode tir, checkpoint
                   MATH-500 with a file path)
    mixed          world-large mixed_dev (QA and   mode direct    mode mixed       mode mixed, checkpoint
                   math interleaved; opt-in)                      (both tools)
`direct` and `prompt` run the base model (`model.path`); `rl` runs the RL-trained policy
(`checkpoint`, or `verification_checkpoint` / `mixed_checkpoint` for those kinds) and is left
out when none is given. The mixed kind (one policy, both tools; beyond the paper) runs when
`kinds` names it; its cells are also broken down by the tool each question needs (the
examples' `tool`: "search" questions, "code" word problems), each part with the same numbers
as a cell, reported and tested as groups `mixed/search` and `mixed/code`. Each cell is one
`car-jax eval` run (`car_jax.eval.job.run_eval`, resumable) in `<out>/<kind>/<setting>/`
(samples.jsonl, summary.json, reliability.png).

Per cell: accuracy, ECE, MCIP, AUROC (and Brier) with percentile-bootstrap 95% intervals
(`car_jax.calibration.metrics.bootstrap_ci`, n_boot resamples, seed `seed`: eval's summary).
Between every two settings of a tool kind, Welch's unequal-variance t-test (`welch`, two-sided)
of the difference in the mean of three per-example quantities:
    correct           1 if the answer is right, else 0 (its mean is the accuracy)
    calib_error       |q - correct|, the example's own calibration error (its mean is the
                      L1 analogue of the Brier score; ECE itself is a binned, not a per-example, mean)
    wrong_confidence  q over the wrong answers only (its mean is MCIP, the paper's measure of
                      overconfidence)
The tests treat the settings' examples as independent samples (the paper's t-tests do too),
although they are the same questions.

Files in `out`: pilot.json ({"config", "cells": {kind: {setting: numbers}}, "tests": [...]};
a mixed cell's numbers hold "by_tool": {tool: numbers}), pilot.png (the four metrics with their
intervals, a bar group per kind and per mixed part), and the cell folders. The paper's
finding (SPEC section 1) reads: MCIP up from direct to tool use for the evidence tool, down
for the verification tool.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Literal

import numpy as np
from matplotlib.figure import Figure

from car_jax.config import require
from car_jax.data import load_dataset
from car_jax.eval.config import EvalConfig, EvalDataConfig, EvalModelConfig, OutputConfig
from car_jax.eval.job import run_eval
from car_jax.eval.runner import (EVAL_EPISODE, FALLBACK_MARK, FALLBACK_NOTE, SAMPLES_FILE, is_fallback,
                                 read_samples, summarize)
from car_jax.rollout.episode import EpisodeConfig
from car_jax.rollout.toolbox import ToolsConfig
from car_jax.sharding import MeshConfig

PILOT_FILE, PILOT_PLOT = "pilot.json", "pilot.png"
KINDS = {"evidence": "search", "verification": "tir", "mixed": "mixed"}  # tool kind -> its tool mode
PARTS = ("search", "code")  # a mixed cell's parts: its examples' `tool` (`car_jax.data.world_mixed`)
SETTINGS = ("direct", "prompt", "rl")
METRICS = ("accuracy", "ece", "mcip", "auroc", "brier")
QUANTITIES = ("correct", "calib_error", "wrong_confidence")


@dataclasses.dataclass(frozen=True)
class PilotConfig:
    seed: int = 0
    batch_size: int = 8
    kinds: tuple[Literal["evidence", "verification", "mixed"], ...] = ("evidence", "verification")  # + "mixed": opt-in
    model: EvalModelConfig = EvalModelConfig()  # the base model: settings direct and prompt
    checkpoint: str = ""  # the RL-trained policy for the rl setting ("" = no rl setting)
    verification_checkpoint: str = ""  # a separate RL-trained TIR policy for the verification tool ("" = checkpoint)
    mixed_checkpoint: str = ""  # a separate RL-trained policy of the mixed protocol for mixed ("" = checkpoint)
    evidence_data: EvalDataConfig = EvalDataConfig(path="world-large", split="dev")
    verification_data: EvalDataConfig = EvalDataConfig(path="world-large", split="arith_dev")  # or a MATH-500 file
    mixed_data: EvalDataConfig = EvalDataConfig(path="world-large", split="mixed_dev")  # rows with a `tool`
    tools: ToolsConfig = ToolsConfig(retriever="world-large", code_timeout_s=10.0)
    episode: EpisodeConfig = EVAL_EPISODE
    n_boot: int = 1000  # bootstrap resamples per cell
    out: str = "runs/pilot"
    mesh: MeshConfig = MeshConfig(devices=1)

    def __post_init__(self):
        require(self.seed >= 0, "seed", self.seed, ">= 0")
        require(self.batch_size >= 1, "batch_size", self.batch_size, ">= 1")
        require(len(self.kinds) > 0 and len(set(self.kinds)) == len(self.kinds), "kinds", self.kinds,
                "some of evidence, verification, mixed, each once")
        require(self.n_boot >= 1, "n_boot", self.n_boot, ">= 1 (the intervals are the point of the pilot)")
        require(bool(self.out), "out", self.out, "an output folder")


def cell_configs(cfg: PilotConfig) -> dict[tuple[str, str], EvalConfig]:
    """(tool kind, setting) -> the EvalConfig of that cell, in run order (base model first)."""
    cells = {}
    for setting in SETTINGS:
        for kind in cfg.kinds:
            path = cfg.model.path
            if setting == "rl":
                own = {"verification": ("verification_checkpoint", cfg.verification_checkpoint),
                       "mixed": ("mixed_checkpoint", cfg.mixed_checkpoint)}
                which, path = own.get(kind, ("checkpoint", ""))
                if not path:
                    which, path = "checkpoint", cfg.checkpoint
                if not path:
                    continue
                if not Path(path).exists():
                    raise FileNotFoundError(f"{which}={path!r}: no such file or folder (an RL-trained policy: "
                                            "HF folder, .gguf or params folder)")
            cells[kind, setting] = EvalConfig(
                seed=cfg.seed, mode="direct" if setting == "direct" else KINDS[kind], batch_size=cfg.batch_size,
                model=dataclasses.replace(cfg.model, path=path),
                data={"evidence": cfg.evidence_data, "verification": cfg.verification_data,
                      "mixed": cfg.mixed_data}[kind],
                tools=cfg.tools, episode=cfg.episode, mesh=cfg.mesh,
                output=OutputConfig(dir=str(Path(cfg.out) / kind / setting), resume=True, n_boot=cfg.n_boot))
    return cells


# ---------------------------------------------------------------- statistics
def _mean(x: np.ndarray) -> float:
    """The mean; exactly the value when all values are equal; NaN when there is none."""
    if not x.size:
        return math.nan
    return float(x[0]) if np.ptp(x) == 0 else float(x.mean())


def _var(x: np.ndarray) -> float:
    """The sample variance (ddof 1); exactly 0 when all values are equal."""
    return 0.0 if np.ptp(x) == 0 else float(x.var(ddof=1))


def welch(a, b) -> dict:
    """Welch's t-test of mean(a) - mean(b) (float[n_a], float[n_b], unequal variances).

    Returns {"t", "df" (Welch-Satterthwaite), "p" (two-sided), "n_a", "n_b", "mean_a",
    "mean_b"}; t, df and p are NaN when a group has fewer than 2 values or both have zero
    variance. A group whose values are all equal has mean that value and variance exactly 0
    (summing 15 copies of 0.9 in float64 leaves a variance of ~1e-32, enough for scipy to
    report t = 3.7, p = 0.002 between two groups that both say 0.9). p = I_x(df/2, 1/2) with
    x = df / (df + t^2), the regularized incomplete beta function (float64 continued fraction,
    `_betainc`), which is the Student-t two-sided tail.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out = {"n_a": int(a.size), "n_b": int(b.size), "mean_a": _mean(a), "mean_b": _mean(b),
           "t": math.nan, "df": math.nan, "p": math.nan}
    if a.size < 2 or b.size < 2:
        return out
    va, vb = _var(a) / a.size, _var(b) / b.size
    if va + vb == 0:
        return out
    t = (out["mean_a"] - out["mean_b"]) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    out.update(t=float(t), df=float(df), p=_betainc(df / 2, 0.5, df / (df + t * t)))
    return out


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), a, b > 0, x in [0, 1] (float64)."""
    if x <= 0.0 or x >= 1.0:
        return float(x >= 1.0)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float, iters: int = 10_000, eps: float = 1e-15) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz, as in Numerical Recipes' betacf)."""
    tiny = 1e-300
    keep = lambda v: v if abs(v) > tiny else tiny  # noqa: E731
    c, d = 1.0, 1.0 / keep(1.0 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, iters + 1):
        for aa in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 / keep(1.0 + aa * d)
            c = keep(1.0 + aa / c)
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta ({a}, {b}, {x}) did not converge")


def per_example(records: list[dict], quantity: str) -> np.ndarray:
    """The per-example values (float64[n]) a Welch test compares (QUANTITIES, module doc)."""
    c = np.array([r["correct"] for r in records], np.float64)
    q = np.array([r["confidence"] for r in records], np.float64)
    if quantity == "correct":
        return c
    if quantity == "calib_error":
        return np.abs(q - c)
    if quantity == "wrong_confidence":
        return q[c == 0]
    raise ValueError(f"unknown quantity {quantity!r}; choose one of {QUANTITIES}")


def group_order(group: str) -> tuple[int, int]:
    """Sort key of a tool kind ("mixed") or a mixed part ("mixed/search"): KINDS, then PARTS."""
    kind, _, part = group.partition("/")
    return list(KINDS).index(kind), PARTS.index(part) + 1 if part else 0


def welch_tests(records: dict[tuple[str, str], list[dict]]) -> list[dict]:
    """(group, setting) -> its records (a group: a tool kind, or a part of the mixed kind such
    as "mixed/search"); -> one row per group, pair of settings (a the later of SETTINGS, b the
    earlier: prompt vs direct, rl vs direct, rl vs prompt) and quantity:
    {"kind" (the group), "a", "b", "quantity", **welch(values of a, values of b)}."""
    rows = []
    kinds = sorted({k for k, _ in records}, key=group_order)
    for kind in kinds:
        present = [s for s in SETTINGS if (kind, s) in records]
        for before, after in itertools.combinations(present, 2):  # a = the later setting, b = the earlier
            for quantity in QUANTITIES:
                test = welch(per_example(records[kind, after], quantity), per_example(records[kind, before], quantity))
                rows.append({"kind": kind, "a": after, "b": before, "quantity": quantity, **test})
    return rows


# ---------------------------------------------------------------- the study
def run_pilot(cfg: PilotConfig, *, log=print, progress: bool = True) -> dict:
    """Runs every cell (resuming finished ones), then writes pilot.json and pilot.png into
    `cfg.out` and returns pilot.json's content. One process (the cells' folders are read back)."""
    cells = cell_configs(cfg)
    out = Path(cfg.out)
    records, numbers = {}, {}
    for (kind, setting), ecfg in cells.items():
        log(f"pilot: {kind} tool, setting {setting} (mode {ecfg.mode}, model {ecfg.model.path or 'embedded'})")
        summary = run_eval(ecfg, label=ecfg.model.path or None, progress=progress, log=log)
        examples = load_dataset(ecfg.data.path, split=ecfg.data.split, limit=ecfg.data.limit)
        by_id = {r["id"]: r for r in read_samples(Path(ecfg.output.dir) / SAMPLES_FILE)}
        records[kind, setting] = [by_id[e.id] for e in examples]  # this run's examples, in data order
        cell = {"mode": ecfg.mode, "model": summary.get("model"), "data": summary.get("data"), **_numbers(summary),
                "samples": str(Path(ecfg.output.dir) / SAMPLES_FILE)}
        if kind == "mixed":  # per part: the same numbers (and bootstrap) over its examples alone
            parts = tool_parts(examples, records[kind, setting])
            cell["by_tool"] = {t: _numbers(summarize(rows, n_boot=cfg.n_boot, seed=cfg.seed))
                               for t, rows in parts.items()}
            records.update(((f"{kind}/{t}", setting), rows) for t, rows in parts.items())
        numbers.setdefault(kind, {})[setting] = cell
    result = {"config": dataclasses.asdict(cfg), "cells": numbers, "tests": welch_tests(records)}
    out.mkdir(parents=True, exist_ok=True)
    (out / PILOT_FILE).write_text(json.dumps(_nulls(result), indent=2, ensure_ascii=False) + "\n")
    pilot_plot(numbers, out / PILOT_PLOT)
    return result


def _numbers(summary: dict) -> dict:
    """A cell's numbers from an eval summary (`runner.summarize`)."""
    return {"n": summary["n"], **{k: summary[k] for k in METRICS}, "ci95": {k: summary["ci95"][k] for k in METRICS},
            "mean_confidence": summary["mean_confidence"], "mean_tool_calls": summary.get("mean_tool_calls"),
            "format_rate": summary.get("format_rate")}


def tool_parts(examples, records: list[dict]) -> dict[str, list[dict]]:
    """A mixed cell's records split by the tool their example needs: {part: records} in PARTS
    order, parts without examples left out. The part is the example's `tool` (world-large's
    mixed splits), else its task (QA: "search", math: "code")."""
    need = [ex.meta.get("tool") or ("search" if ex.task == "qa" else "code") for ex in examples]
    if bad := sorted(set(need) - set(PARTS)):
        raise ValueError(f"mixed examples name tool {bad[0]!r}; a mixed split's `tool` is one of {', '.join(PARTS)}")
    return {t: [r for r, n in zip(records, need) if n == t] for t in PARTS if t in need}


def _nulls(x):
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nulls(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nulls(v) for v in x]
    return x


def _fmt(v, ci=None, mark: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    lo, hi = ci or (None, None)
    return f"{v:.3f}{FALLBACK_MARK * mark}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else "")


def groups(cells: dict) -> dict[str, dict]:
    """The cells by group: each tool kind, then each part of a mixed kind ("mixed/search",
    "mixed/code", from the cells' `by_tool`): {group: {setting: numbers}}."""
    out = {}
    for kind, settings in cells.items():
        out[kind] = settings
        for part in PARTS:
            if found := {s: c["by_tool"][part] for s, c in settings.items() if part in c.get("by_tool", {})}:
                out[f"{kind}/{part}"] = found
    return out


def format_pilot(result: dict) -> str:
    """The cells (and the mixed kind's parts) as a table (metric [95% interval]) and the Welch
    tests below it. A cell whose format-valid rate is below `runner.FALLBACK_BELOW` has its
    metrics marked, with `runner.FALLBACK_NOTE` under the table."""
    head = ["tool", "setting", "n", *(m.upper() if m != "accuracy" else m for m in METRICS[:4]), "format", "tool calls"]
    cells = [(kind, setting, c) for kind, settings in groups(result["cells"]).items()
             for setting, c in settings.items()]
    body = [[kind, setting, str(c["n"]),
             *(_fmt(c[m], c["ci95"][m], is_fallback(c.get("format_rate"))) for m in METRICS[:4]),
             _fmt(c.get("format_rate")), _fmt(c.get("mean_tool_calls"))] for kind, setting, c in cells]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    lines = [line(head), line(["-" * w for w in widths]), *map(line, body), "",
             "format: the share of episodes that end in a well-formed answer with its confidence.",
             *[FALLBACK_NOTE] * any(is_fallback(c.get("format_rate")) for _, _, c in cells), "",
             "Welch t-tests (two-sided; a vs b: mean of a - mean of b):"]
    for t in result["tests"]:
        lines.append(f"  {t['kind']:<12} {t['a']:>6} vs {t['b']:<6} {t['quantity']:<16} "
                     f"{_fmt(t['mean_a'])} vs {_fmt(t['mean_b'])}  t {_fmt(t['t'])}  df {_fmt(t['df'])}  "
                     f"p {'n/a' if t['p'] is None or math.isnan(t['p']) else format(t['p'], '.3g')}")
    return "\n".join(lines)


def pilot_plot(cells: dict, path: str | Path) -> str:
    """A PNG: one panel per metric (accuracy, ECE, MCIP, AUROC), a bar group per tool kind
    (and per part of the mixed kind: `groups`), a bar per setting with its 95% interval as an
    error bar. Undefined values draw no bar."""
    cells = groups(cells)
    kinds = list(cells)
    fig = Figure(figsize=(max(12, 3.2 * len(kinds)), 3.4), dpi=110)
    axes = fig.subplots(1, 4)
    colors = {"direct": "tab:gray", "prompt": "tab:blue", "rl": "tab:orange"}
    for ax, metric in zip(axes, METRICS[:4]):
        for j, setting in enumerate(SETTINGS):
            xs, ys, errs = [], [], [[], []]
            for i, kind in enumerate(kinds):
                c = cells[kind].get(setting)
                v = None if c is None else c[metric]
                if v is None or math.isnan(v):
                    continue
                lo, hi = c["ci95"][metric]
                xs.append(i + (j - 1) * 0.27)
                ys.append(v)
                errs[0].append(max(v - lo, 0) if lo is not None and not math.isnan(lo) else 0)
                errs[1].append(max(hi - v, 0) if hi is not None and not math.isnan(hi) else 0)
            if xs:
                ax.bar(xs, ys, 0.27, yerr=errs, capsize=3, color=colors[setting], label=setting)
        ax.set(xticks=range(len(kinds)), ylim=(0, 1), title=metric.upper() if metric != "accuracy" else metric)
        ax.set_xticklabels(kinds, fontsize=7 if len(kinds) > 3 else None)
    axes[0].legend(fontsize=7)
    fig.suptitle("confidence-dichotomy pilot (95% bootstrap intervals)")
    fig.tight_layout()
    fig.savefig(path)
    return str(path)
