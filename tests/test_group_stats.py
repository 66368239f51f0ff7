"""`rl.group_stats`: the per-step calibration and group metrics, each re-derived here in plain
numpy (loops over groups, np.corrcoef, sklearn's roc_auc_score) from scripted batches whose
rewards and advantages come from the trainer's own scorer (`batches.make_scorer` with
`rewards.reward_fn`). tests/test_mixed.py checks a real training step's row against
`reference_stats` too."""
import warnings

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from car_jax.calibration.rewards import RewardConfig, RewardInputs, reward_fn
from car_jax.rl.batches import make_scorer, to_device
from car_jax.rl.group_stats import KEYS, group_stats, pearson
from car_jax.rl.host_batch import host_batch
from car_jax.rollout.episode import Trajectory

NAN = float("nan")


def reference_stats(correct, q, rewards, advantages, group, keep) -> dict[str, float]:
    """Every metric of `group_stats`, written out: the kept rows by group, the groups of two
    or more kept rows, their statistics one at a time."""
    by_group: dict = {}
    for i in range(len(keep)):
        if keep[i]:
            by_group.setdefault(int(group[i]), []).append(i)
    groups = [rows for rows in by_group.values() if len(rows) >= 2]
    sds, equal_reward, equal_correct, equal_adv, mixed_adv = [], [], [], [], []
    for rows in groups:
        sds.append(np.std([float(q[i]) for i in rows], ddof=1))
        equal_reward.append(len({float(np.float32(rewards[i])) for i in rows}) == 1)
        same = len({bool(correct[i]) for i in rows}) == 1
        equal_correct.append(same)
        (equal_adv if same else mixed_adv).extend(abs(float(advantages[i])) for i in rows)
    kept = [i for rows in by_group.values() for i in rows]
    c = np.array([float(correct[i]) for i in kept])
    qk = np.array([float(q[i]) for i in kept])
    corr = np.corrcoef(qk, c)[0, 1] if len(set(qk)) > 1 and len(set(c)) > 1 else NAN
    auroc = roc_auc_score(c, qk) if len(set(c)) == 2 else NAN

    def mean(values):
        return float(np.mean(values)) if values else NAN

    return {"calib/q_group_sd": mean(sds), "calib/corr_qc": corr, "calib/auroc": auroc,
            "groups/count": float(len(groups)), "groups/equal_reward_share": mean(equal_reward),
            "groups/equal_correct_share": mean(equal_correct), "groups/equal_correct_abs_adv": mean(equal_adv),
            "groups/mixed_abs_adv": mean(mixed_adv)}


def assert_matches(got: dict, want: dict):
    assert set(want) == set(KEYS) <= set(got)
    for k in KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-6, nan_ok=True), k


def scored(correct, q, format_ok, groups, keep, kind="mscr"):
    """The scorer's rewards and advantages (numpy) of scripted rows, one token each, and the
    group numbers the HostBatch gave them."""
    trajs = [Trajectory([1, 2], [3], [0.0], [True]) for _ in correct]
    inputs = RewardInputs(np.array(correct, bool), np.array(q, np.float32), np.array(format_ok, bool))
    host = host_batch(trajs, 0, keep=np.array(keep, bool), inputs=inputs, groups=groups)
    batch, rewards = make_scorer(reward_fn(RewardConfig(kind=kind)))(to_device(host))
    return host, np.asarray(rewards), np.asarray(batch.advantages)


# (group, correct, q, format_ok, keep) per row, G = 4
ROWS = [
    *[("wrong", 0, q, 1, 1) for q in (0.30, 0.31, 0.32, 0.33)],  # all wrong: rewards differ by ~6e-3
    *[("right", 1, q, ok, 1) for q, ok in ((0.9, 1), (0.8, 1), (0.95, 0), (0.7, 1))],  # all right, one bad format
    *[("mixed", c, q, 1, 1) for c, q in ((1, 0.9), (0, 0.2), (1, 0.35), (0, 0.5))],
    *[("equal", 0, 0.4, 1, 1) for _ in range(4)],  # exactly equal rewards: advantages 0
    ("dropped", 1, 0.7, 1, 0), *[("dropped", 0, q, 1, 1) for q in (0.1, 0.2, 0.3)],  # all wrong once kept
    ("solo", 1, 0.8, 1, 1), *[("solo", 0, 0.5, 1, 0) for _ in range(3)],  # one kept row: no group
    *[("sure", 1, 1.0, 1, 1) for _ in range(4)],  # all right, equal rewards
]


def test_group_stats_equal_the_numpy_reference():
    order = np.random.default_rng(0).permutation(len(ROWS))  # groups interleaved
    names, correct, q, ok, keep = (list(col) for col in zip(*[ROWS[i] for i in order]))
    host, rewards, adv = scored(correct, q, ok, names, keep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = group_stats(host.correct, host.q, rewards, adv, host.group, host.keep)
    want = reference_stats(host.correct, host.q, rewards, adv, host.group, host.keep)
    assert_matches(got, want)
    # what the batch was built to show: the solo group is out, the dropped row too (its group
    # is all wrong once it is gone), two of six groups have equal rewards, five equal correctness
    assert want["groups/count"] == 6
    assert want["groups/equal_reward_share"] == pytest.approx(2 / 6)
    assert want["groups/equal_correct_share"] == pytest.approx(5 / 6)
    # the point: a reward spread of ~6e-3 in the all-wrong group still gives |A| ~ 1
    wrong = np.array(names)[np.asarray(host.keep)] == "wrong"
    assert np.abs(adv[np.asarray(host.keep)][wrong]).min() > 0.3
    assert got["groups/equal_correct_abs_adv"] > 0.3 and got["groups/mixed_abs_adv"] > 0.3
    assert 0 < got["calib/corr_qc"] < 1 and 0.5 < got["calib/auroc"] < 1 and got["calib/q_group_sd"] > 0.01
    # the dropped row counts nowhere: keeping it changes the shares
    flipped = group_stats(host.correct, host.q, rewards, adv, host.group, np.ones(len(ROWS), bool))
    assert flipped["groups/equal_correct_share"] != got["groups/equal_correct_share"]


def test_equal_rewards_and_equal_correctness_are_counted_apart():
    """The Brier reward gives a right and a wrong answer at q = 0 the same reward 0: a group
    of equal rewards whose correctness differs (and whose advantages are all 0)."""
    host, rewards, adv = scored([1, 0, 1, 0, 0, 0], [0, 0, 0.9, 0.1, 0.3, 0.6], [1] * 6,
                                ["a", "a", "b", "b", "c", "c"], [1] * 6, kind="brier")
    got = group_stats(host.correct, host.q, rewards, adv, host.group, host.keep)
    assert_matches(got, reference_stats(host.correct, host.q, rewards, adv, host.group, host.keep))
    assert got["groups/equal_reward_share"] == pytest.approx(1 / 3)
    assert got["groups/equal_correct_share"] == pytest.approx(1 / 3)  # only c
    assert rewards[0] == rewards[1] and adv[0] == adv[1] == 0


def test_constant_q_or_correctness_give_nan_without_warnings():
    cases = {"constant q": ([1, 0, 1, 0], [0.5] * 4), "all wrong": ([0] * 4, [0.1, 0.2, 0.3, 0.4])}
    seen = {}
    for name, (correct, q) in cases.items():
        host, rewards, adv = scored(correct, q, [1] * 4, ["a", "a", "b", "b"], [1] * 4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = group_stats(host.correct, host.q, rewards, adv, host.group, host.keep)
        assert np.isnan(got["calib/corr_qc"]), name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert np.isnan(np.corrcoef(host.q, host.correct)[0, 1]), name  # numpy agrees, with a warning
        assert_matches(got, reference_stats(host.correct, host.q, rewards, adv, host.group, host.keep))
        seen[name] = got
    # constant q: SD 0, AUROC one half (all ties); all wrong: AUROC undefined, no mixed group
    assert seen["constant q"]["calib/q_group_sd"] == 0 and seen["constant q"]["calib/auroc"] == 0.5
    assert seen["constant q"]["groups/equal_correct_share"] == 0
    wrong = seen["all wrong"]
    assert wrong["groups/equal_correct_share"] == 1 and np.isnan(wrong["groups/mixed_abs_adv"])
    assert np.isnan(wrong["calib/auroc"]) and wrong["groups/equal_correct_abs_adv"] > 0.5


def test_pearson():
    x, y = np.array([0.1, 0.5, 0.2, 0.9]), np.array([0, 1, 0, 1], bool)
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)
    assert np.isnan(pearson([0.3], [1])) and np.isnan(pearson([], []))


def test_no_groups_gives_nans():
    """A step whose rows are all dropped, or all in groups of one, has no group statistics."""
    got = group_stats([1, 0], [0.2, 0.4], [1.0, 0.0], [1.0, 0.0], [0, 1], [True, True])
    assert got["groups/count"] == 0
    assert all(np.isnan(got[k]) for k in KEYS if k.startswith(("groups/", "calib/q")) and k != "groups/count")
    assert got["calib/auroc"] == 0.0 and got["calib/corr_qc"] == pytest.approx(-1.0)
    none = group_stats([1, 0], [0.2, 0.4], [1.0, 0.0], [0.0, 0.0], [0, 0], [False, False])
    assert none["groups/count"] == 0 and all(np.isnan(none[k]) for k in KEYS if k != "groups/count")
