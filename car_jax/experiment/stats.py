"""The experiment's statistics: per-seed metrics, intervals over seeds, and the paired
comparisons of an arm with the baseline (host float64 math; the distributions are
`car_jax.experiment.dist`'s, the per-sample metrics `car_jax.calibration.metrics`'s).

Design. Run seed s of every arm starts from the same warm start with the same data order and
the same sampling seed (`ExperimentConfig.data_order`), and every policy is evaluated on the
same questions. So arm and baseline are *paired*: by seed, and within a seed by question. The
comparisons use the pairing instead of treating the arms as independent samples:

- Seed-paired t (`paired_t`): the per-seed difference d_s = m(arm, s) - m(base, s) of a metric
  m, over the n seeds both have; mean d, sd s_d (ddof 1), t = mean / (s_d / sqrt(n)),
  df = n - 1, two-sided p, 95% interval mean +- t_{0.975, n-1} s_d / sqrt(n). This is the
  interval the verdict reads: its unit of replication is the training seed.
- Paired question bootstrap (`question_draws`): within each seed, draw B question indices with
  replacement, the SAME indices for both arms, and take the difference of the metric on the
  drawn questions; a draw's value is the mean over seeds. Its percentile interval holds the
  trained policies fixed (it shows question noise only), so it is narrower than the seed
  interval whenever seeds disagree; the variance of one seed's draws is that seed's
  per-question variance, which the power analysis uses.
- Exact McNemar (`mcnemar`) for accuracy: over all (seed, question) pairs, b = arm right and
  baseline wrong, c = arm wrong and baseline right; under "no difference" each discordant
  pair is a fair coin, p = min(1, 2 P(Binom(b + c, 1/2) <= min(b, c))).
- Holm's step-down correction (`holm`) over every comparison a report makes.
- Power (`power_analysis`): how many seeds the seed-paired t test needs (formula there).

A metric is named by a string. Its per-seed value comes from the samples when the name is in
QUESTION_METRICS and the samples carry its confidence field (computed by
`metrics.calibration_arrays`; those metrics also get the question bootstrap), else from the
evaluation's summary.json: any numeric key, top level ("accuracy") or one section down
("expected.ece", "sampled.accuracy"), with the seed-paired t test only. So a metric a later
evaluation adds is compared by naming it in `eval.compare`.
"""
from __future__ import annotations

import math
import warnings
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from car_jax.calibration import metrics
from car_jax.experiment import dist

REPORTED = ("accuracy", "ece", "mcip", "auroc", "brier", "mean_confidence")
NEAR = 0.05  # "about one confidence": within this of the one stated most (modal_confidence)
LEVEL = 0.95  # every interval's coverage
ALPHA = 0.05  # the level of every test (after Holm)
# name -> (key of metrics.calibration_arrays, the samples' confidence field it reads): the stated
# confidence, and the policy's expected confidence at its tag (car_jax.eval.runner's
# `expected_confidence`, where an evaluation records it; its summary section is "expected").
QUESTION_METRICS: dict[str, tuple[str, str]] = {
    **{k: (k, "confidence") for k in metrics.KEYS},
    **{f"expected.{k}": (k, "expected_confidence") for k in metrics.KEYS}}
UNIT = (0.0, 1.0)  # every metric of QUESTION_METRICS lies in [0, 1]: intervals are clipped to it


def bounds(name: str, difference: bool = False) -> tuple[float, float] | None:
    """The range of metric `name` ((-1, 1) for a difference of two) where it is known."""
    if name not in QUESTION_METRICS:
        return None
    return (-UNIT[1], UNIT[1]) if difference else UNIT


# ---------------------------------------------------------------- per seed
def arrays(records: Sequence[dict], field: str = "confidence") -> tuple[np.ndarray, np.ndarray]:
    """(bool[B] correct, f32[B] the confidence field) of one evaluation's records; a missing
    (null) confidence is q = 0, the convention of SPEC 4."""
    return (np.array([r["correct"] for r in records], bool),
            np.array([0.0 if r[field] is None else r[field] for r in records], np.float32))


def seed_metrics(records: Sequence[dict], field: str = "confidence") -> dict[str, float]:
    """The metrics (metrics.KEYS) of one seed's records; NaN where undefined, no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return {k: float(v) for k, v in metrics.calibration(*arrays(records, field)).items() if k in metrics.KEYS}


def _numeric(summary: Mapping) -> dict[str, float]:
    """A summary.json's numbers: top-level keys, and one section down as "section.key"."""
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    out = {k: float(v) for k, v in summary.items() if num(v)}
    for sec, inner in summary.items():
        if isinstance(inner, Mapping):
            out.update({f"{sec}.{k}": float(v) for k, v in inner.items() if num(v)})
    return out


def carried_fields(records: Sequence[dict]) -> set[str]:
    """The confidence fields of QUESTION_METRICS that every record carries."""
    return {f for _, f in QUESTION_METRICS.values() if records and all(f in r for r in records)}


def run_values(records: Sequence[dict], summary: Mapping | None = None) -> dict[str, float]:
    """Every metric one evaluation has: the numbers of its summary.json (`_numeric`),
    overridden by the metrics recomputed from its samples (QUESTION_METRICS whose confidence
    field the samples carry)."""
    out = _numeric(summary or {})
    per_field = {f: seed_metrics(records, f) for f in carried_fields(records)}
    out.update({name: per_field[f][key] for name, (key, f) in QUESTION_METRICS.items() if f in per_field})
    return out


def t_interval(values: Sequence[float], level: float = LEVEL, clip: tuple[float, float] | None = None) -> dict:
    """The one-sample t statistics of float[n] (NaN values left out): {"n", "mean", "sd",
    "lo", "hi", "t", "df", "p"} with mean +- t_{(1+level)/2, n-1} sd / sqrt(n) (cut to `clip`,
    the quantity's possible range, which keeps the coverage) and the two-sided p of "the true
    mean is 0". Fewer than 2 values: interval, t and p are NaN; all values equal: sd 0, a
    zero-width interval, p 0 (or 1 when the mean is 0)."""
    v = np.asarray(values, np.float64)
    v = v[~np.isnan(v)]
    out = {"n": int(v.size), "mean": float(v.mean()) if v.size else math.nan, "sd": math.nan,
           "lo": math.nan, "hi": math.nan, "t": math.nan, "df": v.size - 1, "p": math.nan}
    if v.size < 2:
        return out
    sd = 0.0 if np.ptp(v) == 0 else float(v.std(ddof=1))  # exactly 0 for equal values
    mean = float(v[0]) if sd == 0 else out["mean"]
    half = dist.t_ppf(0.5 + level / 2, v.size - 1) * sd / math.sqrt(v.size)
    lo, hi = (mean - half, mean + half) if clip is None else (max(mean - half, clip[0]), min(mean + half, clip[1]))
    out.update(mean=mean, sd=sd, lo=lo, hi=hi)
    if sd == 0:
        out.update(t=math.copysign(math.inf, mean) if mean else 0.0, p=0.0 if mean else 1.0)
    else:
        t = mean / (sd / math.sqrt(v.size))
        out.update(t=t, p=dist.t_two_sided_p(t, v.size - 1))
    return out


def paired_t(arm: Sequence[float], base: Sequence[float], level: float = LEVEL,
             clip: tuple[float, float] | None = None) -> dict:
    """The seed-paired t test of arm - base (float[n] each, seed s at index s): `t_interval`
    of the differences, plus "per_seed" (the differences; NaN where either is undefined)."""
    a, b = np.asarray(arm, np.float64), np.asarray(base, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired values need equal 1-D shapes, got {a.shape} and {b.shape}")
    d = a - b
    return {**t_interval(d, level, clip), "per_seed": d.tolist()}


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


def arm_summary(runs: Sequence[dict], n_boot: int, seed: int = 0) -> dict:
    """One policy over its runs ([{"records", "summary"}] one per seed): {metric: {"mean", "lo",
    "hi", "per_seed"}} for REPORTED, plus "n" (questions per seed), "seeds", "modal"
    (modal_confidence per seed) and "format_rate" (per seed the share of records with
    `format_ok`; None for a run whose records lack it). The interval: with 2 or more seeds the
    t interval over the per-seed values (`t_interval`); a single run's is a percentile
    bootstrap over its questions (metrics.bootstrap_ci, n_boot draws)."""
    values = [run_values(r["records"], r.get("summary")) for r in runs]
    out = {"n": [len(r["records"]) for r in runs], "seeds": len(runs),
           "modal": [modal_confidence(r["records"]) for r in runs],
           "format_rate": [float(np.mean([x["format_ok"] for x in r["records"]]))
                           if r["records"] and all("format_ok" in x for x in r["records"]) else None for r in runs]}
    ci = None
    if len(runs) == 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ci = metrics.bootstrap_ci(*arrays(runs[0]["records"]), n_boot=n_boot, level=LEVEL, seed=seed)
    for k in REPORTED:
        vals = [v.get(k, math.nan) for v in values]
        if ci:
            lo, hi = ci[k]
        else:
            t = t_interval(vals, clip=bounds(k))
            lo, hi = t["lo"], t["hi"]
        mean = float(np.nanmean(vals)) if not np.all(np.isnan(vals)) else math.nan
        out[k] = {"mean": mean, "lo": float(lo), "hi": float(hi), "per_seed": vals}
    return out


# ---------------------------------------------------------------- paired over questions
@jax.jit
def _resampled_metrics(correct, q, idx) -> jax.Array:
    """bool[B], f32[B], int32[R, B] -> f32[R, len(metrics.KEYS)]: the metrics of each row's
    questions (metrics.calibration_arrays, so exactly the point estimates' definitions)."""
    def one(i):  # int32[B]
        m = metrics.calibration_arrays(correct[i], q[i])
        return jnp.stack([m[k] for k in metrics.KEYS])

    return jax.lax.map(one, idx, batch_size=64)


def align(arm: Sequence[dict], base: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """Two evaluations' records in the same question order: by "id" when the records carry
    one (the question sets must be equal), else by position (equal lengths)."""
    if arm and all("id" in r for r in arm) and all("id" in r for r in base):
        by_id = {r["id"]: r for r in arm}
        if set(by_id) != {r["id"] for r in base}:
            raise ValueError("the two evaluations hold different questions; a paired comparison needs the same ones")
        return [by_id[r["id"]] for r in base], list(base)
    if len(arm) != len(base):
        raise ValueError(f"paired records need equal lengths, got {len(arm)} and {len(base)}")
    return list(arm), list(base)


def question_draws(arm: Sequence[Sequence[dict]], base: Sequence[Sequence[dict]], n_boot: int,
                   seed: int = 0) -> dict[str, np.ndarray]:
    """The paired bootstrap over questions within seeds (module docstring) of every metric in
    QUESTION_METRICS that the records carry: arm[s], base[s] are seed s's records. Returns
    {name: f64[S, n_boot]} of per-seed differences (seed s's draws use
    np.random.default_rng([seed, s]); one index matrix for both arms and every metric)."""
    out: dict[str, list] = {}
    for s, (a_recs, b_recs) in enumerate(zip(arm, base, strict=True)):
        a_recs, b_recs = align(a_recs, b_recs)
        idx = np.random.default_rng([seed, s]).integers(0, len(b_recs), size=(n_boot, len(b_recs)))  # [R, B]
        fields = carried_fields(a_recs + b_recs)
        draws = {}
        for f in fields:
            (ca, qa), (cb, qb) = arrays(a_recs, f), arrays(b_recs, f)
            draws[f] = (np.asarray(_resampled_metrics(ca, qa, idx), np.float64)
                        - np.asarray(_resampled_metrics(cb, qb, idx), np.float64))  # [R, K]
        for name, (key, f) in QUESTION_METRICS.items():
            if f in draws:
                out.setdefault(name, []).append(draws[f][:, metrics.KEYS.index(key)])
    return {k: np.stack(v) for k, v in out.items() if len(v) == len(arm)}


def bootstrap_interval(per_seed_draws: np.ndarray, level: float = LEVEL) -> dict:
    """f64[S, R] per-seed difference draws -> {"lo", "hi"} (the percentile interval of their
    mean over seeds; NaN draws left out) and "var" (the mean over seeds of each seed's draw
    variance: the per-question variance of one seed's difference)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a draw undefined in every seed
        mean = np.nanmean(per_seed_draws, axis=0)
        var = float(np.nanmean(np.nanvar(per_seed_draws, axis=1, ddof=1)))
    mean = mean[~np.isnan(mean)]
    if not mean.size:
        return {"lo": math.nan, "hi": math.nan, "var": var}
    lo, hi = np.percentile(mean, [50 * (1 - level), 50 * (1 + level)])
    return {"lo": float(lo), "hi": float(hi), "var": var}


def mcnemar(arm: Sequence[Sequence[dict]], base: Sequence[Sequence[dict]]) -> dict:
    """The exact McNemar test of accuracy over the paired (seed, question) answers (module
    docstring): {"b" (arm right, baseline wrong), "c" (arm wrong, baseline right), "p",
    "per_seed": [[b_s, c_s], ...]}."""
    per_seed = []
    for a_recs, b_recs in zip(arm, base, strict=True):
        a_recs, b_recs = align(a_recs, b_recs)
        ca, cb = arrays(a_recs)[0], arrays(b_recs)[0]
        per_seed.append([int(np.sum(ca & ~cb)), int(np.sum(~ca & cb))])
    b, c = (sum(x[i] for x in per_seed) for i in (0, 1))
    return {"b": b, "c": c, "p": dist.binom_half_two_sided(b, b + c), "per_seed": per_seed}


def holm(p: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order. With the m defined p-values
    sorted, p_(1) <= ... <= p_(m): adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)); rejecting
    where adj < alpha controls the family-wise error at alpha. NaN (a test that could not be
    made) stays NaN and does not count in m."""
    p = np.asarray(p, np.float64)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    order = ok[np.argsort(p[ok], kind="stable")]
    m = order.size
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out[order] = np.maximum.accumulate(scaled)
    return out.tolist()


# ---------------------------------------------------------------- one comparison
def compare(arm: Sequence[dict], base: Sequence[dict], names: Sequence[str], n_boot: int, seed: int = 0) -> dict:
    """Arm against baseline over the seeds both have (arm[s], base[s]: seed s's run, each
    {"records", "summary"}), for each metric in `names`: {name: {"mean", "per_seed", "sd",
    "lo", "hi" (seed-paired t), "df", "t", "p", "test", "q_lo", "q_hi", "q_var" (the question
    bootstrap; NaN for metrics it cannot recompute)}}. Accuracy's "p" is McNemar's (its entry
    adds "mcnemar" and the t test's "p_t"); the others' the seed-paired t test's. Plus
    "rel_ece": the ECE difference relative to the baseline's mean ECE (interval: the t
    interval's ends divided by it, the baseline mean taken as fixed). `finalize` adds the
    Holm-adjusted p and "resolved"."""
    if len(arm) != len(base):
        raise ValueError(f"compare pairs runs by seed: got {len(arm)} arm runs and {len(base)} baseline runs")
    va = [run_values(r["records"], r.get("summary")) for r in arm]
    vb = [run_values(r["records"], r.get("summary")) for r in base]
    draws = question_draws([r["records"] for r in arm], [r["records"] for r in base], n_boot, seed)
    out = {}
    for name in names:
        if not all(name in v for v in va + vb):
            raise ValueError(f"metric {name!r} is neither recomputed from the samples ({sorted(QUESTION_METRICS)}) "
                             f"nor in every run's summary.json")
        row = paired_t([v[name] for v in va], [v[name] for v in vb], clip=bounds(name, difference=True))
        q = bootstrap_interval(draws[name]) if name in draws else {"lo": math.nan, "hi": math.nan, "var": math.nan}
        row.update(q_lo=q["lo"], q_hi=q["hi"], q_var=q["var"], test="paired t")
        if name == "accuracy":
            row.update(p_t=row["p"], mcnemar=mcnemar([r["records"] for r in arm], [r["records"] for r in base]),
                       test="McNemar exact")
            row["p"] = row["mcnemar"]["p"]
        out[name] = row
    out["rel_ece"] = _relative(out["ece"], float(np.nanmean([v["ece"] for v in vb])))
    return out


def _relative(diff: dict, base_mean: float) -> dict:
    """A difference of ECE over the baseline's mean ECE; ECE >= 0, so at least -1."""
    if not base_mean:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan}
    return {k: max(diff[k] / base_mean, -1.0) for k in ("mean", "lo", "hi")}


def finalize(comparisons: dict[str, dict[str, dict]], alpha: float = ALPHA) -> int:
    """Holm over every (split, arm, metric) p of a report, in place: each metric entry of
    comparisons[split][arm] gains "p_holm" and "resolved" (its seed-paired interval excludes
    0 and p_holm < alpha). Returns the family's size m."""
    rows = [row for arms in comparisons.values() for cmp in arms.values()
            for row in cmp.values() if isinstance(row, dict) and "p" in row]  # not rel_ece, seeds
    adjusted = holm([row["p"] for row in rows])
    for row, ph in zip(rows, adjusted):
        row["p_holm"] = ph
        row["resolved"] = bool(ph < alpha and (row["lo"] > 0 or row["hi"] < 0))
    return sum(not math.isnan(p) for p in adjusted)


# ---------------------------------------------------------------- power
def power_analysis(diff: dict, delta: float = 0.05, power: float = 0.8, alpha: float = ALPHA,
                   family: int = 1) -> dict:
    """How many seeds the seed-paired t test needs, from a finished comparison's entry
    (`compare`'s, with its per-seed differences, their sd s_d and the mean per-question
    variance q_var of one seed's difference).

    The number of seeds n: the smallest n >= 2 with
        P(|T'| > t_{1 - alpha/2, n-1}) >= power,  T' ~ noncentral t(n - 1, delta sqrt(n) / s_d)
    (dist.seeds_for_power; the usual normal approximation is n ~ ((z_{1-alpha/2} + z_power)
    s_d / delta)^2). Also at alpha / family, the level Holm's first step tests at. The
    per-question variance: one seed's difference is its policy pair's true difference plus
    the noise of its B questions, so s_d^2 ~ tau^2 + q_var, where tau^2 = max(s_d^2 - q_var,
    0) is the seed-to-seed (training) variance that more questions cannot remove; with m
    questions instead of B, s_d^2(m) = tau^2 + q_var B / m. "seeds_no_question_noise" is the
    limit m -> infinity. (The seeds share their questions here, so q_var is an upper bound on
    the question noise inside s_d^2.) "detectable" is the difference the seeds used reach
    `power` for. The estimate of s_d from few seeds is itself rough (df = n - 1)."""
    sd, q_var, n = diff["sd"], diff.get("q_var", math.nan), diff["n"]
    tau2 = max(sd * sd - q_var, 0.0) if not math.isnan(q_var) else math.nan
    return {"delta": delta, "power": power, "alpha": alpha, "family": family, "seeds_used": n,
            "sd": sd, "q_var": q_var, "seed_var": tau2,
            "seeds": dist.seeds_for_power(delta, sd, power, alpha),
            "seeds_holm_first": dist.seeds_for_power(delta, sd, power, alpha / family),
            "seeds_no_question_noise": dist.seeds_for_power(delta, math.sqrt(tau2), power, alpha)
            if not math.isnan(tau2) else None,
            "detectable": detectable_difference(n, sd, power, alpha)}


def detectable_difference(n: int, sd: float, power: float = 0.8, alpha: float = ALPHA) -> float:
    """The true difference that n seeds detect with `power` (bisection on delta; NaN for n < 2
    or an undefined sd)."""
    if n < 2 or math.isnan(sd):
        return math.nan
    if sd == 0:
        return 0.0
    lo, hi = 0.0, sd
    while dist.t_test_power(n, hi, sd, alpha) < power:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if dist.t_test_power(n, mid, sd, alpha) < power else (lo, mid)
    return hi
