"""car_jax.sim: GRPO advantages, q*, the policy's probabilities, determinism, and what the toy
simulation shows (properties a broken update or reward wiring would fail)."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax import rewards, sim

# Small but long enough for the confidence head to move: compile time dominates anyway.
CFG = sim.SimConfig(n_questions=128, prompts_per_step=32, steps=200)
KEY = jax.random.key(0)
MSCR = sim.outcome_reward(rewards.RewardConfig(kind="mscr"))
BINARY = sim.outcome_reward(rewards.RewardConfig(kind="binary"))


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
    dr = np.asarray(sim.group_advantages(jnp.asarray(r), std_normalize=False))
    np.testing.assert_allclose(dr, r - r.mean(1, keepdims=True), atol=1e-6)


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


def test_deterministic_for_a_seed():
    a = sim.run(CFG, MSCR, KEY)
    b = sim.run(CFG, MSCR, KEY)
    c = sim.run(CFG, MSCR, jax.random.key(1))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a[1]["accuracy"]), np.asarray(c[1]["accuracy"]))
    hist = a[1]
    assert set(hist) >= {"accuracy", "ece", "mean_confidence", "attempt_rate", "dead_groups"}
    assert all(v.shape == (CFG.steps,) for v in hist.values())


def test_mscr_calibrates_better_than_binary():
    """b1 = b2 makes MSCR proper: the overconfident start gets corrected; binary ignores q."""
    for cfg in (CFG, dataclasses.replace(CFG, std_normalize=False)):
        m, b = sim.run(cfg, MSCR, KEY)[2], sim.run(cfg, BINARY, KEY)[2]
        assert float(m["ece"]) < float(b["ece"]) - 0.05
        assert float(m["mean_confidence"]) < float(b["mean_confidence"])


def test_sweep_matches_single_runs():
    """The vmapped sweep at (b1, b2) = (1, 1) reproduces the single MSCR run's final metrics."""
    final = sim.mscr_sweep(CFG, jnp.array([1.0, 4.0]), jnp.array([1.0, 0.25]), KEY)
    single = sim.run(CFG, MSCR, KEY)[2]
    for name in ("accuracy", "ece", "mean_confidence"):
        assert final[name].shape == (2,)
        assert float(final[name][0]) == pytest.approx(float(single[name]), abs=1e-5)
    # b1 >> b2 rewards overconfidence (q* > p): more confident than the proper setting
    assert float(final["mean_confidence"][1]) > float(final["mean_confidence"][0])


def test_read_eval_jsonl(tmp_path):
    path = tmp_path / "eval.jsonl"
    rows = [{"correct": True, "confidence": 0.9, "id": "a"}, {"correct": False, "confidence": 0}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    c, q = sim.read_eval_jsonl(path)
    assert c.dtype == bool and q.dtype == np.float32
    np.testing.assert_array_equal(c, [True, False])
    np.testing.assert_allclose(q, [0.9, 0.0])
    for bad in ({"correct": 1, "confidence": 0.5}, {"correct": True, "confidence": 1.5},
                {"correct": True}, {"correct": True, "confidence": True}):
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=":1:"):
            sim.read_eval_jsonl(path)
    path.write_text("")
    with pytest.raises(ValueError, match="no records"):
        sim.read_eval_jsonl(path)
