"""RESULTS.md, written from `report.build`'s numbers (no statistics here, only their wording):
Setup, Commands, per split the policies, the paired comparisons with the baseline and the
runs, the power analysis, training curves, the equivalence check and the verdict."""
from __future__ import annotations

import datetime
import math
import re
from typing import Sequence

from car_jax.calibration.rewards import RewardConfig
from car_jax.eval.runner import FALLBACK_MARK, FALLBACK_NOTE, is_fallback
from car_jax.experiment import dist, stats
from car_jax.experiment.config import ExperimentConfig
from car_jax.experiment.verdict import ACC_MARGIN


def _num(x, fmt: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _p(x) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x:.3f}" if x >= 0.001 else f"{x:.1e}"


MARK = "\\" + FALLBACK_MARK  # escaped: a bare * may start a list or emphasis
NOTE = MARK + re.sub(r"(<\w+>|\\boxed\{\})", r"`\1`", FALLBACK_NOTE.removeprefix(FALLBACK_MARK))  # tags as code


def _cell(m: dict, mark: bool = False) -> str:
    if m["mean"] is None or math.isnan(m["mean"]):
        return "n/a"
    ci = "" if math.isnan(m["lo"]) else f" [{m['lo']:.3f}, {m['hi']:.3f}]"
    return f"{m['mean']:.3f}{MARK * mark}{ci}"


def _format_rate(p: dict) -> float | None:
    """A policy's format-valid rate: the mean over its seeds that know theirs (None: none do)."""
    known = [r for r in p.get("format_rate") or [] if r is not None]
    return sum(known) / len(known) if known else None


def _interval(lo: float, hi: float, fmt: str = "+.3f") -> str:
    return "n/a" if math.isnan(lo) else f"[{lo:{fmt}}, {hi:{fmt}}]"


def arm_label(name: str, r: RewardConfig) -> str:
    """`name` (kind, and the reward's own parameters)."""
    extra = {"mscr": f", b1 {r.b1:g}, b2 {r.b2:g}", "weighted_brier": f", w {r.weight:g}"}.get(r.kind, "")
    return f"`{name}` ({r.kind}{extra})"


def _rebuild_lines(rebuilds: list) -> list[str]:
    """The Setup line on rebuilds of the warm start's pruned weights between sittings."""
    if not rebuilds:
        return []
    word = {True: "identical", False: "DIFFERENT", None: "not compared (no first hashes)"}
    return [f"- The warm start's weights were pruned and rebuilt from its demonstrations {len(rebuilds)} "
            "time(s) between sittings; SHA-256 against the first build: "
            + ", ".join(word[r] for r in rebuilds) + "."]


def _order_line(cfg: ExperimentConfig, res: dict) -> str:
    """What data order the runs used, from their saved configs."""
    seen = res["shuffle_seeds"]
    used = ", ".join(f"{run} {s}" for run, s in seen.items()) if len(set(seen.values())) > 1 else (
        f"{next(iter(seen.values()))} in all {len(seen)}" if seen else "none yet")
    if cfg.data_order == "shared":
        how = ("`shared`: every GRPO run drew its training prompts in one order, so all arms and all seeds saw "
               "the same prompts and seeds differ only in sampling")
    else:
        how = ("`per_seed`: run seed s draws its prompts in the order of shuffle seed "
               f"{cfg.train.data.shuffle_seed} + s, so the arms of a seed see the same prompts and seeds differ")
    return f"- Data order: {how} (shuffle seeds in the runs' config.yaml: {used})."


def _setup(cfg: ExperimentConfig, res: dict) -> list[str]:
    t, w = cfg.train, cfg.warm_start
    return ["## Setup", "",
            f"- Model: `{t.model.path or 'embedded SmolLM2-135M-Instruct'}` ({t.model.dtype}).",
            f"- Training data: `{t.data.train}` split `{t.data.train_split}` (limit {t.data.limit}); "
            f"tool: `{t.tools.retriever}` top-{t.tools.topk}.",
            f"- Shared warm start: {w.steps} SFT steps of batch {w.batch}, lr {w.lr:g}; demonstrations state "
            f"confidence `{w.confidence}` (no information about correctness"
            f"{'' if w.confidence != 'informative' else ': NOT the case here'}).",
            *_rebuild_lines(res.get("warm_rebuilds", [])),
            f"- GRPO: {t.rl.steps} steps x {t.rl.prompts_per_step} prompts x G = {t.rollout.group_size}, "
            f"lr {t.rl.optim.lr:g}, KL {t.rl.loss.kl_coef:g}, at most {t.rollout.max_turns} search "
            f"turn{'s' * (t.rollout.max_turns != 1)} of {t.rollout.max_response_tokens} tokens.",
            "- Arms: " + ", ".join(arm_label(a, r) for a, r in cfg.arms.items())
            + f"; seeds {list(cfg.seeds)}; baseline `{cfg.baseline}`.",
            _order_line(cfg, res),
            "- Evaluation: greedy, splits " + ", ".join(
                f"`{s}` = {d.path}:{d.split} (the first {d.limit or 'all'} questions)"
                for s, d in cfg.eval.splits.items()) + "; every policy answers the same questions.",
            f"- Statistics ({100 * stats.LEVEL:g}% intervals). A policy's row: the mean over seeds, with the t "
            "interval over its per-seed values (n - 1 degrees of freedom; seeds that agree exactly give it zero "
            "width); a single run's (the warm start): a "
            f"percentile bootstrap over its questions ({cfg.eval.n_boot} draws); intervals of metrics in [0, 1] are cut "
            "to [0, 1] (differences to [-1, 1]). Against the baseline, paired: "
            "the seed-paired t interval and test of the per-seed differences (the interval the verdict reads); "
            "a paired bootstrap over questions within seeds (the same question draws for both arms; it holds the "
            "trained policies fixed, so it shows question noise only); accuracy's p is the exact McNemar test on "
            "the paired (seed, question) answers, the other metrics' the seed-paired t test's. Holm's step-down "
            f"correction runs over all {res['holm_family']} p-values of this report. A difference is resolved "
            f"when its seed-paired interval excludes 0 and its Holm-adjusted p is below {stats.ALPHA:g}.",
            f"- Compute: {res['budget']['seconds'] / 3600:.2f} h over the {res['budget']['units_timed']} timed "
            f"units (of {res['budget']['units']}).", ""]


def _policy_table(sres: dict) -> list[str]:
    """The split's table of policies; the metrics of a policy whose format-valid rate is below
    `runner.FALLBACK_BELOW` are marked, with the fallback note (`runner.FALLBACK_NOTE`) under the table."""
    lines = ["| policy | accuracy | ECE | MCIP | AUROC | Brier | mean confidence | format valid |",
             "|---|---|---|---|---|---|---|---|"]
    marked = False
    for name, p in sres["policies"].items():
        label = "warm start (before RL)" if name == "warm" else f"{name} ({p['seeds']} seed{'s' * (p['seeds'] > 1)})"
        rate = _format_rate(p)
        mark = is_fallback(rate)
        marked |= mark
        lines.append(f"| {label} | " + " | ".join(_cell(p[k], mark) for k in stats.REPORTED) + f" | {_num(rate)} |")
    return lines + ["", NOTE] * marked


def _test_cell(row: dict) -> str:
    if "mcnemar" in row:
        m = row["mcnemar"]
        return f"McNemar exact (arm only right {m['b']}, baseline only right {m['c']})"
    return f"paired t (df {row['df']})" if row["n"] >= 2 else "paired t (needs 2 seeds)"


def _comparison_table(cfg: ExperimentConfig, sres: dict) -> list[str]:
    lines = [f"Against `{cfg.baseline}`, paired by seed (and by question within a seed); differences are arm "
             "minus baseline:", "",
             "| arm | metric | difference | seed-paired interval | per-seed differences | questions-only interval "
             "| test | p | Holm p | resolved |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, cmp in sres["vs_baseline"].items():
        for name in cfg.eval.compare:
            r = cmp[name]
            per_seed = ", ".join(_num(d, "+.3f") for d in r["per_seed"])
            lines.append(f"| {arm} | {name} | {r['mean']:+.3f} | {_interval(r['lo'], r['hi'])} | {per_seed} | "
                         f"{_interval(r['q_lo'], r['q_hi'])} | {_test_cell(r)} | {_p(r['p'])} | {_p(r['p_holm'])} | "
                         f"{'yes' if r['resolved'] else 'no'} |")
    rel = [f"{arm} {100 * r['mean']:+.1f}%" + ("" if math.isnan(r["lo"]) else
                                                 f" [{100 * r['lo']:+.1f}%, {100 * r['hi']:+.1f}%]")
           for arm, c in sres["vs_baseline"].items() if not math.isnan((r := c["rel_ece"])["mean"])]
    if rel:
        lines += ["", f"ECE change relative to `{cfg.baseline}`'s mean ECE (the seed-paired interval divided by "
                  "it): " + "; ".join(rel) + "."]
    return lines


def _runs_table(sres: dict) -> list[str]:
    lines = ["Each run (the seed-level values behind the rows above; the last columns give the confidence the "
             "policy states most often, and on what share of the questions it states that value, or one within "
             f"{100 * stats.NEAR:g} points of it):", "",
             f"| run | accuracy | ECE | AUROC | mean confidence | most stated | share | share within {100 * stats.NEAR:g} |",
             "|---|---|---|---|---|---|---|---|"]
    for run, r in sres["runs"].items():
        lines.append(f"| {run} | " + " | ".join(_num(r[k]) for k in ("accuracy", "ece", "auroc", "mean_confidence"))
                     + f" | {100 * r['modal']['value']:.0f} | {100 * r['modal']['share']:.0f}% | "
                     f"{100 * r['modal']['near']:.0f}% |")
    return lines


def _seeds(n) -> str:
    return f"more than {dist.MAX_SEEDS}" if n is None else str(n)


def _detectable(x: float) -> str:
    """An ECE difference lies in [-1, 1]: beyond 1 no true difference reaches the power."""
    return "n/a" if math.isnan(x) else (f"{x:.3f}" if x <= 1 else f"none (it would take {x:.2f})")


def _power(cfg: ExperimentConfig, res: dict) -> list[str]:
    rows = [(split, arm, p, sres["vs_baseline"][arm]["ece"]) for split, sres in res["splits"].items()
            for arm, p in sres["power"].items()]
    if not rows:
        return []
    first = rows[0][2]
    lines = ["## Power: how many seeds an ECE difference needs", "",
             f"From this experiment's per-seed ECE differences: the seeds the seed-paired t test needs to detect a "
             f"true ECE difference of {first['delta']:g} with {100 * first['power']:.0f}% power at alpha "
             f"{first['alpha']:g} (two-sided; exact noncentral t power: the smallest n with "
             "P(|T'| > t_{1-alpha/2, n-1}) >= power, T' ~ noncentral t(n - 1, delta sqrt(n) / s_d)); also at "
             f"0.05 / {first['family']}, the level of Holm's first step over this report's family. The per-question "
             "variance: a seed's difference is its policies' true difference plus the noise of its questions, "
             "s_d^2 ~ tau^2 + v_q, where v_q is the paired question bootstrap's variance of one seed's difference; "
             "more questions shrink v_q (as 1 / questions) but not tau^2, the seed-to-seed variance of training, so "
             "the last seed count is the floor that more evaluation questions cannot go below. With few seeds s_d "
             "is itself rough.", "",
             f"| split | arm | per-seed ECE differences | s_d | sqrt(v_q) | tau | seeds needed | seeds needed at "
             f"{first['alpha']:g} / {first['family']} | seeds needed with no question noise | difference the seeds "
             f"used detect with {100 * first['power']:.0f}% power |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for split, arm, p, e in rows:
        lines.append(f"| {split} | {arm} | {', '.join(_num(d, '+.3f') for d in e['per_seed'])} | {_num(p['sd'])} | "
                     f"{_num(math.sqrt(p['q_var']))} | {_num(math.sqrt(p['seed_var']))} | "
                     f"{_seeds(p['seeds'])} | {_seeds(p['seeds_holm_first'])} | {_seeds(p['seeds_no_question_noise'])} | "
                     f"{_detectable(p['detectable'])} ({p['seeds_used']} seeds) |")
    return lines + [""]


def _equivalence(eq: dict | None) -> list[str]:
    if not eq:
        return []
    lines = ["## MSCR with b1 = b2 = b against (1 + b) x weighted Brier", "",
             f"Two runs from the warm start with the same seed: MSCR (b = {eq['b']:g}) and weighted Brier "
             f"(w = b / (1 + b), format penalty / (1 + b)). GRPO normalizes rewards within each group, so "
             f"the runs should match step for step while their rewards differ by the factor "
             f"{eq['expected_ratio']:g}.", "",
             "| step | reward MSCR | reward weighted Brier | ratio | largest relative difference (metric) |",
             "|---|---|---|---|---|"]
    for s in eq["steps"]:
        lines.append(f"| {s['step']} | {s['reward_mscr']:.4f} | {s['reward_weighted_brier']:.4f} | "
                     f"{s['ratio']:.4f} | {s['max_rel_diff']:.2e} ({s['worst']}) |")
    return lines + [""]


def _rows(res: dict, keep) -> list[str]:
    return [f"{split} {arm} {name} ({row['mean']:+.3f}, Holm p {_p(row['p_holm'])})"
            for split, sres in res["splits"].items() for arm, cmp in sres["vs_baseline"].items()
            for name, row in cmp.items() if isinstance(row, dict) and "p_holm" in row and keep(row)]


def _resolved_lines(res: dict) -> list[str]:
    """Which differences are resolved, and which pass Holm only over the questions."""
    hits = _rows(res, lambda r: r["resolved"])
    lines = [f"- Resolved, of the {res['holm_family']} comparisons (seed-paired interval excludes 0 and Holm p < "
             f"{stats.ALPHA:g}): " + ("; ".join(hits) if hits else "none") + "."]
    only = _rows(res, lambda r: not r["resolved"] and r["p_holm"] < stats.ALPHA)
    if only:
        lines.append("- Significant after Holm, but with a seed-paired interval that includes 0: " + "; ".join(only)
                     + ". Their tests pool the (seed, question) pairs of these seeds' policies (McNemar), so they "
                     "say these trained policies differ on these questions; the seeds disagree too much to say "
                     "that another training seed would.")
    return lines


def markdown(cfg: ExperimentConfig, res: dict, commands: Sequence[str], figures: dict[str, str]) -> str:
    lines = ["# Results: calibration rewards for a search agent", "",
             f"Generated by the experiment's report step on {datetime.date.today().isoformat()} from the run "
             f"folders under `{cfg.dir}`; every number below is recomputed from their per-example files.", "",
             *_setup(cfg, res), "## Commands", "", "```", *commands, "```", ""]
    if not res["complete"]:
        b = res["budget"]
        lines[2:2] = ["**Partial report: the experiment is still running** "
                      f"({b['units_done']} of {b['units']} units done). The tables hold the policies evaluated "
                      "so far, each with the number of seeds it has; the verdict waits for every run.", ""]
    for split, sres in res["splits"].items():
        lines += [f"## Split `{split}`", "", *_policy_table(sres), "", *_comparison_table(cfg, sres), "",
                  *_runs_table(sres)]
        if f"reliability_{split}" in figures:
            lines += ["", f"![reliability diagrams, {split}]({figures[f'reliability_{split}']})"]
        lines.append("")
    lines += _power(cfg, res)
    lines += ["## Training curves", "", f"![training curves]({figures['curves']})", "", *_equivalence(res["equivalence"])]
    lines += ["## Verdict", "", f"The claim: an arm lowers ECE against `{cfg.baseline}` without losing more than "
              f"{ACC_MARGIN:g} accuracy (the accuracy difference's seed-paired interval lies above -{ACC_MARGIN:g}).", ""]
    if not res["complete"]:
        lines.append("Not yet: the experiment is still running.")
    else:
        for sres in res["splits"].values():
            lines += [f"- {v}" for v in sres["verdicts"].values()]
            lines += [f"- {sres['collapse']}"] if sres["collapse"] else []
        lines += _resolved_lines(res)
    lines.append("")
    return "\n".join(lines)
