"""The experiment's paired statistics against scipy and numpy re-derivations on scripted
numbers: the Student t distribution and the paired t test, noncentral-t power and the seeds it
asks for, the exact McNemar test, Holm's correction, the paired question bootstrap, the
verdict read off them, and the per-seed data order of the planned units."""
import math

import numpy as np
import pytest
from scipy import stats as ss

from car_jax.config import ConfigError, load_config, save_config
from car_jax.experiment import ExperimentConfig, dist, plan, stats, verdict
from car_jax.experiment.config import SAVED, load_experiment


def _records(correct, q, ids=None):
    ids = range(len(correct)) if ids is None else ids
    return [{"id": f"q{i}", "correct": bool(c), "confidence": float(x)} for i, c, x in zip(ids, correct, q)]


# ---------------------------------------------------------------- distributions
@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 10, 31, 250])
def test_student_t_against_scipy(df):
    for t in (-40.0, -3.2, -1.0, -0.1, 0.0, 0.7, 2.0, 5.5, 1e4):
        assert dist.t_cdf(t, df) == pytest.approx(ss.t.cdf(t, df), abs=1e-13)
        assert dist.t_two_sided_p(t, df) == pytest.approx(2 * ss.t.sf(abs(t), df), abs=1e-13)
    for p in (0.001, 0.2, 0.5, 0.8, 0.975, 0.9995):
        assert dist.t_ppf(p, df) == pytest.approx(ss.t.ppf(p, df), rel=1e-10, abs=1e-12)
    with pytest.raises(ValueError, match="integer >= 1"):
        dist.t_cdf(1.0, 2.5)


def test_power_and_seeds_against_scipy_noncentral_t():
    def ref(n, delta, sd, alpha=0.05):
        c, lam = ss.t.ppf(1 - alpha / 2, n - 1), delta * math.sqrt(n) / sd
        return ss.nct.sf(c, n - 1, lam) + ss.nct.cdf(-c, n - 1, lam)

    for n, delta, sd, alpha in ((2, 0.3, 0.2, 0.05), (3, 0.05, 0.35, 0.05), (8, 0.1, 0.1, 0.01), (60, -0.02, 0.07, 0.05)):
        assert dist.t_test_power(n, delta, sd, alpha) == pytest.approx(ref(n, abs(delta), sd, alpha), abs=1e-8)
    for delta, sd in ((0.05, 0.35), (0.1, 0.12), (0.05, 0.02)):
        n = dist.seeds_for_power(delta, sd)
        assert ref(n, delta, sd) >= 0.8 and (n == 2 or ref(n - 1, delta, sd) < 0.8)
    # the normal approximation lands within a few seeds of the exact answer
    z = ss.norm.ppf(0.975) + ss.norm.ppf(0.8)
    assert abs(dist.seeds_for_power(0.05, 0.35) - (z * 0.35 / 0.05) ** 2) < 3
    assert dist.seeds_for_power(0.05, 0.0) == 2 and dist.seeds_for_power(0.05, math.nan) is None


def test_binomial_half_against_scipy_binomtest():
    for n in (0, 1, 5, 20, 57):
        for k in range(n + 1):
            assert dist.binom_half_two_sided(k, n) == pytest.approx(ss.binomtest(k, n, 0.5).pvalue if n else 1.0,
                                                                    rel=1e-12, abs=1e-300)


# ---------------------------------------------------------------- seed-paired t
def test_paired_t_against_scipy_ttest_rel():
    arm, base = [0.21, 0.35, 0.18, 0.40, 0.27], [0.30, 0.41, 0.33, 0.38, 0.36]
    got = stats.paired_t(arm, base)
    ref = ss.ttest_rel(arm, base)
    d = np.subtract(arm, base)
    lo, hi = ss.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=ss.sem(d))
    assert got["t"] == pytest.approx(ref.statistic, rel=1e-12) and got["p"] == pytest.approx(ref.pvalue, rel=1e-10)
    assert (got["lo"], got["hi"]) == pytest.approx((lo, hi), rel=1e-10)
    assert got["mean"] == pytest.approx(d.mean()) and got["df"] == 4 and got["per_seed"] == pytest.approx(d)
    # the committed experiment's car - vanilla id ECE: 3 seeds, t_{0.975, 2} = 4.30
    e = stats.paired_t([0.018, 0.465, 0.331], [0.487, 0.235, 0.488])
    assert e["hi"] - e["lo"] == pytest.approx(2 * ss.t.ppf(0.975, 2) * ss.sem([-0.469, 0.230, -0.157]), rel=1e-9)
    # cut to the possible range keeps the point and only narrows
    cut = stats.paired_t([0.018, 0.465, 0.331], [0.487, 0.235, 0.488], clip=(-1.0, 1.0))
    assert cut["lo"] == -1.0 and cut["hi"] == pytest.approx(e["hi"]) and e["lo"] < -1.0


def test_t_interval_edge_cases():
    one = stats.t_interval([0.4])
    assert one["mean"] == 0.4 and all(math.isnan(one[k]) for k in ("lo", "hi", "t", "p"))
    same = stats.t_interval([0.55, 0.55, 0.55])  # three seeds at one accuracy: no spread at all
    assert same["sd"] == 0.0 and same["lo"] == same["hi"] == 0.55 and same["p"] == 0.0
    assert stats.t_interval([0.0, 0.0])["p"] == 1.0
    nan = stats.paired_t([0.5, math.nan, 0.7], [0.4, 0.4, 0.4])  # an undefined seed is left out
    assert nan["n"] == 2 and nan["mean"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        stats.paired_t([0.1, 0.2], [0.1])


# ---------------------------------------------------------------- McNemar, Holm
def test_mcnemar_counts_discordant_pairs_by_question_id():
    rng = np.random.default_rng(4)
    arm, base = [], []
    b = c = 0
    for _ in range(3):
        ca, cb = rng.random(30) < 0.6, rng.random(30) < 0.5
        b, c = b + int(np.sum(ca & ~cb)), c + int(np.sum(~ca & cb))
        order = rng.permutation(30)  # the arm's file lists the questions in another order
        arm.append([_records(ca, np.full(30, 0.5))[i] for i in order])
        base.append(_records(cb, np.full(30, 0.5)))
    got = stats.mcnemar(arm, base)
    assert (got["b"], got["c"]) == (b, c) and sum(map(sum, got["per_seed"])) == b + c
    assert got["p"] == pytest.approx(ss.binomtest(b, b + c, 0.5).pvalue, rel=1e-12)
    with pytest.raises(ValueError, match="different questions"):
        stats.mcnemar([_records([1, 0], [0.5, 0.5], ids=[0, 7])], [_records([1, 0], [0.5, 0.5])])


def test_holm_worked_example_and_rederivation():
    # p = (0.01, 0.04, 0.03, 0.005): sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 =
    # 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06; a NaN is no test
    got = stats.holm([0.01, 0.04, math.nan, 0.03, 0.005])
    assert got[:2] == pytest.approx([0.03, 0.06]) and math.isnan(got[2]) and got[3:] == pytest.approx([0.06, 0.02])
    rng = np.random.default_rng(0)
    p = rng.random(9) ** 3
    rank = np.argsort(np.argsort(p))  # 0-based rank of each p
    ref = [max(min(1.0, (9 - rank[j]) * p[j]) for j in range(9) if p[j] <= p[i]) for i in range(9)]
    assert stats.holm(p) == pytest.approx(ref)
    assert stats.holm([0.6, 0.7]) == [1.0, 1.0]


# ---------------------------------------------------------------- paired question bootstrap
def test_question_bootstrap_uses_the_same_questions_for_both_arms():
    rng = np.random.default_rng(1)
    B, n_boot = 50, 2000
    base_c = [rng.random(B) < 0.5 for _ in range(2)]
    q = [rng.random(B) for _ in range(2)]
    arm_c = [c.copy() for c in base_c]
    for c in arm_c:  # the arm is also right on 3 questions the baseline gets wrong, nowhere worse
        c[np.flatnonzero(~c)[:3]] = True
    arm = [_records(c, x) for c, x in zip(arm_c, q)]
    base = [_records(c, x) for c, x in zip(base_c, q)]
    draws = stats.question_draws(arm, base, n_boot=n_boot, seed=5)
    assert draws["accuracy"].shape == (2, n_boot)
    # re-derived: seed s's indices are default_rng([5, s]); one matrix for both arms
    for s in range(2):
        idx = np.random.default_rng([5, s]).integers(0, B, size=(n_boot, B))
        d = arm_c[s].astype(float) - base_c[s].astype(float)
        assert draws["accuracy"][s] == pytest.approx(d[idx].mean(axis=1), abs=1e-6)
        assert draws["mean_confidence"][s] == pytest.approx(0.0, abs=1e-7)  # same confidences, same draws
    # paired, every draw's difference is >= 0 (an unpaired bootstrap would go negative), and
    # the known answer: the count of the 3 questions among B draws is Binomial(B, 3 / B)
    assert draws["accuracy"].min() >= 0
    assert draws["accuracy"].mean() == pytest.approx(3 / B, rel=0.05)
    assert draws["accuracy"].var(axis=1) == pytest.approx([B * (3 / B) * (1 - 3 / B) / B**2] * 2, rel=0.15)
    iv = stats.bootstrap_interval(draws["accuracy"])
    assert 0 <= iv["lo"] < 3 / B < iv["hi"] and iv["var"] == pytest.approx(np.mean(draws["accuracy"].var(axis=1, ddof=1)))
    same = stats.question_draws(base, base, n_boot=200)
    assert all(np.all((v == 0) | np.isnan(v)) for v in same.values())  # an arm against itself: 0 in every draw


# ---------------------------------------------------------------- comparisons, verdict, power
def _row(mean, lo, hi, p, n=5, test="paired t"):
    return {"mean": mean, "lo": lo, "hi": hi, "p": p, "n": n, "test": test, "per_seed": [mean] * n}


def _cmp(e, a):
    return {"ece": e, "accuracy": a, "rel_ece": {"mean": 0.0, "lo": 0.0, "hi": 0.0}, "seeds": [0, 1, 2, 3, 4]}


def test_verdict_reads_paired_interval_and_holm():
    def kept():  # accuracy kept: within -0.05 of the baseline's
        return _row(0.0, -0.02, 0.03, 0.9, test="McNemar exact")

    cases = {
        "supported": _cmp(_row(-0.1, -0.15, -0.05, 0.001), kept()),
        "not resolved": _cmp(_row(-0.02, -0.08, 0.03, 0.2), kept()),
        "contradicted": _cmp(_row(0.1, 0.02, 0.2, 0.002), kept()),
        "accuracy drops": _cmp(_row(-0.1, -0.15, -0.05, 0.001), _row(-0.2, -0.3, -0.1, 1e-6, test="McNemar exact")),
        "equal accuracy is not shown": _cmp(_row(-0.1, -0.15, -0.05, 0.001), _row(-0.04, -0.2, 0.1, 0.3)),
        # the interval excludes 0 but Holm over the family lifts p above 0.05: not resolved
        "Holm-adjusted p": _cmp(_row(-0.1, -0.15, -0.01, 0.02), kept()),
    }
    m = stats.finalize({"id": cases})
    assert m == 2 * len(cases)
    for word, cmp in cases.items():
        assert word in verdict.verdict(cmp, "car", "vanilla", "id"), word
    # Holm over 12: 1e-6 x 12; the three 0.001s x 11, 10, 9 -> 0.011 (running max), still
    # resolved; 0.002 x 8 = 0.016; 0.02 x 7 = 0.14, no longer
    assert cases["supported"]["ece"]["resolved"] and cases["supported"]["ece"]["p_holm"] == pytest.approx(0.011)
    assert cases["contradicted"]["ece"]["p_holm"] == pytest.approx(0.016)
    assert not cases["Holm-adjusted p"]["ece"]["resolved"] and cases["Holm-adjusted p"]["ece"]["p_holm"] == pytest.approx(0.14)
    assert not cases["not resolved"]["ece"]["resolved"]
    one = _cmp(dict(_row(-0.1, math.nan, math.nan, math.nan, n=1), p_holm=math.nan, resolved=False),
               dict(kept(), p_holm=0.9, resolved=False))
    assert "no seed-paired test" in verdict.verdict(one, "car", "vanilla", "id")


def test_compare_on_scripted_seeds_and_power():
    rng = np.random.default_rng(7)
    arm, base = [], []
    for s in range(4):
        cb = rng.random(40) < 0.5
        cb[:s + 1] = False
        ca = cb.copy()
        ca[:s + 1] = True  # seed s: only the arm right on the first s + 1 questions (10 in all)
        arm.append({"records": _records(ca, rng.random(40)), "summary": {"extra": 0.1 * s, "deep": {"x": s}}})
        base.append({"records": _records(cb, rng.random(40)), "summary": {"extra": 0.0, "deep": {"x": 0}}})
    got = stats.compare(arm, base, ["accuracy", "ece", "extra", "deep.x"], n_boot=200, seed=0)
    acc = [np.mean([r["correct"] for r in a["records"]]) - np.mean([r["correct"] for r in b["records"]])
           for a, b in zip(arm, base)]
    assert got["accuracy"]["per_seed"] == pytest.approx(acc) and got["accuracy"]["test"] == "McNemar exact"
    accuracy = lambda runs: [np.mean([r["correct"] for r in x["records"]]) for x in runs]  # noqa: E731
    assert got["accuracy"]["p_t"] == pytest.approx(ss.ttest_rel(accuracy(arm), accuracy(base)).pvalue, rel=1e-5)  # f32 accuracies
    assert got["accuracy"]["p"] == got["accuracy"]["mcnemar"]["p"] == pytest.approx(ss.binomtest(10, 10).pvalue)
    # summary.json numbers (top level and one section down) take the seed-paired t test only
    assert got["extra"]["per_seed"] == pytest.approx([0.0, 0.1, 0.2, 0.3]) and math.isnan(got["extra"]["q_lo"])
    assert got["deep.x"]["mean"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="neither recomputed"):
        stats.compare(arm, base, ["nothing"], n_boot=200)

    p = stats.power_analysis(got["ece"], delta=0.05, family=4)
    sd = np.std(got["ece"]["per_seed"], ddof=1)
    assert p["sd"] == pytest.approx(sd) and p["seeds"] == dist.seeds_for_power(0.05, sd)
    assert p["seeds_holm_first"] == dist.seeds_for_power(0.05, sd, alpha=0.05 / 4) >= p["seeds"]
    assert p["seed_var"] == pytest.approx(max(sd**2 - got["ece"]["q_var"], 0.0))
    assert (p["seeds_no_question_noise"] or 0) <= p["seeds"]
    c, lam = ss.t.ppf(0.975, 3), p["detectable"] * 2 / sd  # sqrt(4) seeds
    assert ss.nct.sf(c, 3, lam) + ss.nct.cdf(-c, 3, lam) == pytest.approx(0.8, abs=1e-6)


# ---------------------------------------------------------------- configs: data order, arms
def test_each_seed_gets_its_own_data_order(tmp_path):
    cfg = load_config(ExperimentConfig, None, ["seeds=[0, 3, 5]", "train.data.shuffle_seed=10",
                                               "arms={vanilla: {kind: binary}, asym: {kind: mscr, b1: 2.0, b2: 0.5}}"])
    assert cfg.data_order == "per_seed"  # the default for new experiments
    runs = {u.name: u.config for u in plan(cfg) if u.kind != "eval"}
    for seed in (0, 3, 5):
        for arm in ("vanilla", "asym"):  # arms of a seed share its order: paired
            assert runs[f"train/{arm}-s{seed}"].data.shuffle_seed == 10 + seed
            assert runs[f"train/{arm}-s{seed}"].seed == seed
    assert runs["warm"].data.shuffle_seed == 10  # the one warm start keeps the configured order
    assert runs["train/asym-s3"].reward.b1 == 2.0 and runs["train/asym-s3"].reward.b2 == 0.5
    shared = load_config(ExperimentConfig, None, ["seeds=[0, 3]", "data_order=shared"])
    assert {u.config.data.shuffle_seed for u in plan(shared) if u.kind == "train"} == {0}
    with pytest.raises(ConfigError, match="seeds >= 0"):
        load_config(ExperimentConfig, None, ["seeds=[-1, 2]"])
    with pytest.raises(ConfigError, match="compare"):
        load_config(ExperimentConfig, None, ["eval.compare=[auroc]"])

    # a folder saved before data_order existed keeps its old meaning: shared
    folder = tmp_path / "old"
    folder.mkdir()
    saved = load_config(ExperimentConfig, None, [f"dir={folder}", "seeds=[0, 1]", "data_order=shared"])
    save_config(saved, folder / SAVED)
    text = (folder / SAVED).read_text()
    (folder / SAVED).write_text("".join(line for line in text.splitlines(keepends=True) if "data_order" not in line))
    assert load_experiment(folder / SAVED).data_order == "shared"
    assert load_experiment(folder / SAVED, ["data_order=per_seed"]).data_order == "per_seed"  # an override wins
    other = tmp_path / "copy.yaml"  # the same text elsewhere is a new config: today's default
    other.write_text((folder / SAVED).read_text())
    assert load_experiment(other).data_order == "per_seed"


def test_paired_config_is_the_world_design_with_per_seed_order_and_an_asymmetric_arm():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs" / "experiment"
    old, new = (load_experiment(root / f) for f in ("world_car.yaml", "world_car_paired.yaml"))
    assert old.data_order == "shared" and new.data_order == "per_seed" and len(new.seeds) >= 5
    asym = [r for r in new.arms.values() if r.kind == "mscr" and r.b1 != r.b2]
    assert asym and set(old.arms) < set(new.arms)
    assert new.warm_start == old.warm_start and new.train == old.train and new.eval == old.eval
    assert {u.config.data.shuffle_seed for u in plan(new) if u.kind == "train"} == set(new.seeds)


def test_expected_confidence_metrics_come_from_the_samples_when_they_carry_them():
    """A metric over another per-sample confidence (the eval's `expected_confidence`, null
    without a tag, read as q = 0) is recomputed per seed and bootstrapped like the stated one."""
    rng = np.random.default_rng(2)
    runs = []
    for _ in range(2):
        pair = []
        for _ in range(2):
            recs = _records(rng.random(30) < 0.5, rng.random(30))
            for r, e in zip(recs, rng.random(30)):
                r["expected_confidence"] = None if e < 0.1 else float(e)
            pair.append({"records": recs, "summary": {"expected": {"ece": 123.0}}})  # samples win over it
        runs.append(pair)
    arm, base = [p[0] for p in runs], [p[1] for p in runs]
    got = stats.compare(arm, base, ["accuracy", "ece", "expected.ece"], n_boot=200)

    def ece_expected(recs):
        c = np.array([r["correct"] for r in recs], float)
        q = np.array([r["expected_confidence"] or 0.0 for r in recs], np.float32)
        bins = np.minimum(np.floor(q * 10).astype(int), 9)
        return sum(abs(c[bins == b].mean() - q[bins == b].astype(float).mean()) * (bins == b).mean() for b in np.unique(bins))

    want = [ece_expected(a["records"]) - ece_expected(b["records"]) for a, b in zip(arm, base)]
    assert got["expected.ece"]["per_seed"] == pytest.approx(want, abs=1e-6)
    assert not math.isnan(got["expected.ece"]["q_lo"]) and got["expected.ece"]["q_lo"] < got["expected.ece"]["q_hi"]
    assert got["expected.ece"]["per_seed"] != pytest.approx(got["ece"]["per_seed"])
