"""car_jax.rl.sim: GRPO advantages, q*, the policy's probabilities, determinism, and what the toy
simulation shows (properties a broken update or reward wiring would fail)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.calibration import rewards
from car_jax.rl import grpo, sim

# Small but long enough for the confidence head to move: compile time dominates anyway.
CFG = sim.SimConfig(n_questions=128, prompts_per_step=32, steps=200)
KEY = jax.random.key(0)
MSCR = sim.outcome_reward(rewards.RewardConfig(kind="mscr"))
BINARY = sim.outcome_reward(rewards.RewardConfig(kind="binary"))
THETAS = np.array([sim.family_theta(rewards.RewardConfig(kind="mscr")), (1.0, 0.0, 0.0),
                   sim.family_theta(rewards.RewardConfig(kind="mscr", b1=4.0, b2=0.25))])


def test_group_advantages_match_numpy():
    r = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)
    r[2] = 0.25  # an all-equal group: no signal
    want = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    got = np.asarray(sim.group_advantages(jnp.asarray(r)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(got[2] == 0)
    np.testing.assert_allclose(got.mean(1), 0, atol=1e-6)
    # ddof=1: the sample std of the advantages is 1 (up to eps) in every non-constant group
    np.testing.assert_allclose(np.delete(got, 2, 0).std(1, ddof=1), 1, rtol=1e-4)
    dr = np.asarray(sim.group_advantages(jnp.asarray(r), std_norm=False))
    np.testing.assert_allclose(dr, r - r.mean(1, keepdims=True), atol=1e-6)
    # the trainer's host version (arbitrary group ids) agrees on the [P, G] layout
    ids = np.repeat(np.arange(r.shape[0]), r.shape[1])
    for std in (True, False):
        np.testing.assert_allclose(
            grpo.group_advantages(r.ravel(), ids, std_norm=std).reshape(r.shape),
            sim.group_advantages(jnp.asarray(r), std_norm=std), rtol=1e-5, atol=1e-6)


def test_q_star_numeric_matches_analytic():
    p = np.linspace(0.05, 0.95, 19)
    grid = np.linspace(0, 1, 2001)
    for b1, b2 in [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)]:
        fn = sim.outcome_reward(rewards.RewardConfig(kind="mscr", b1=b1, b2=b2))
        np.testing.assert_allclose(sim.numeric_q_star(fn, p, grid), sim.mscr_q_star(p, b1, b2),
                                   atol=1e-3)
    for kind in ("brier", "weighted_brier"):
        fn = sim.outcome_reward(rewards.RewardConfig(kind=kind, weight=0.3))
        np.testing.assert_allclose(sim.numeric_q_star(fn, p, grid), p, atol=1e-3)
    # binary is flat in q: every q ties, the smallest wins
    assert np.all(np.asarray(sim.numeric_q_star(BINARY, p, grid)) == 0)


def test_expected_reward_by_hand():
    # MSCR b1 = b2 = 1 at p = 0.5, q = 0.5: 0.5 * (1 + 0.75) - 0.5 * 0.25 = 0.75
    got = sim.expected_reward(MSCR, np.array([0.5]), np.array([0.5]))
    np.testing.assert_allclose(np.asarray(got), [[0.75]], atol=1e-6)


def test_policy_probabilities_sum_to_one():
    """exp(log_prob) over every (attempt, correct, k) outcome of one question sums to 1."""
    cfg = dataclasses.replace(CFG, n_bins=11)
    params = sim.init_params(cfg)._replace(skill=jnp.float32(0.7), attempt=jnp.array([0.3, 1.5]))
    k = jnp.arange(cfg.n_bins, dtype=jnp.int32)
    total = 0.0
    for attempted, correct in [(True, True), (True, False), (False, False)]:
        s = sim.Sample(jnp.full((1, cfg.n_bins), attempted), jnp.full((1, cfg.n_bins), correct),
                       k[None])
        total += float(jnp.sum(jnp.exp(sim.log_prob(cfg, params, jnp.array([0.2]), s))))
    assert total == pytest.approx(1.0, abs=1e-5)


def test_sample_frequencies_follow_the_policy():
    cfg = dataclasses.replace(CFG, n_bins=11)
    params = sim.init_params(cfg)._replace(attempt=jnp.array([0.0, 0.0]))  # P(attempt) = 0.5
    s = sim.sample(cfg, params, jnp.array([0.0, 2.0]), KEY, 20000)  # skill 0: p = 0.5, 0.12
    assert np.asarray(s.attempted).mean() == pytest.approx(0.5, abs=0.02)
    p = jax.nn.sigmoid(jnp.array([0.0, -2.0]))
    np.testing.assert_allclose(np.asarray(s.correct).mean(1), 0.5 * p, atol=0.02)
    assert not np.any(np.asarray(s.correct) & ~np.asarray(s.attempted))


@pytest.fixture(scope="module")
def family():
    """Rows: MSCR (b1 = b2 = 1), binary, MSCR (b1 = 4, b2 = 0.25); one compile per config."""
    return {norm: sim.run_family(cfg, THETAS, KEY) for norm, cfg in
            [("grpo", CFG), ("dr_grpo", dataclasses.replace(CFG, std_norm=False))]}


def test_deterministic_for_a_seed(family):
    hist, final = family["grpo"]
    again = sim.run_family(CFG, THETAS, KEY)
    for x, y in zip(jax.tree.leaves((hist, final)), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other = sim.run_family(CFG, THETAS, jax.random.key(1))[0]
    assert not np.array_equal(np.asarray(hist["accuracy"]), np.asarray(other["accuracy"]))
    assert set(hist) >= {"accuracy", "ece", "mean_confidence", "attempt_rate", "dead_groups"}
    assert all(v.shape == (len(THETAS), CFG.steps) for v in hist.values())


def test_mscr_calibrates_better_than_binary(family):
    """b1 = b2 makes MSCR proper: the overconfident start gets corrected; binary ignores q."""
    for _, final in family.values():
        assert float(final["ece"][0]) < float(final["ece"][1]) - 0.05
        assert float(final["mean_confidence"][0]) < float(final["mean_confidence"][1])


def test_b1_above_b2_is_overconfident(family):
    """q* > p when b1 > b2: more confident than the proper setting, both normalizations."""
    for _, final in family.values():
        assert float(final["mean_confidence"][2]) > float(final["mean_confidence"][0])


def test_run_family_matches_a_single_run(family):
    """Row 0 of the vmapped run is the single run under car_jax.calibration.rewards.mscr."""
    hist, final = family["grpo"]
    _, single_hist, single = sim.run(CFG, MSCR, KEY)
    for name in ("accuracy", "ece", "mean_confidence", "attempt_rate"):
        assert float(final[name][0]) == pytest.approx(float(single[name]), abs=1e-5)
    np.testing.assert_allclose(sim.row(hist, 0)["accuracy"], single_hist["accuracy"], atol=1e-6)


@pytest.mark.parametrize("cfg", [
    rewards.RewardConfig(kind="binary"), rewards.RewardConfig(kind="brier"),
    rewards.RewardConfig(kind="weighted_brier", weight=0.3),
    rewards.RewardConfig(kind="mscr", b1=2.5, b2=0.4)], ids=lambda c: c.kind)
def test_family_reproduces_each_reward(cfg):
    q = np.linspace(0, 1, 101, dtype=np.float32)
    theta = jnp.asarray(sim.family_theta(cfg))
    for correct in (np.ones(q.shape, bool), np.zeros(q.shape, bool)):
        np.testing.assert_allclose(sim.family_reward(correct, q, theta),
                                   sim.outcome_reward(cfg)(correct, q), atol=1e-6)


def test_summarize_collapse_markers():
    hist = {"accuracy": np.r_[np.full(20, 0.4), np.full(20, 0.1), np.full(20, 0.5)],
            "attempt_rate": np.r_[np.ones(30), np.full(30, 0.2)]}
    s = sim.summarize(hist, {"ece": jnp.float32(0.25)}, window=10)
    assert s == pytest.approx({"ece": 0.25, "start_accuracy": 0.4, "min_accuracy": 0.1,
                               "min_attempt": 0.2})
    assert sim.moving_average(np.arange(5.0), 2).tolist() == [0.5, 1.5, 2.5, 3.5]
