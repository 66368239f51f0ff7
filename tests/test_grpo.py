"""GRPO math against an independent numpy re-derivation (verl's definitions)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.rl import grpo

RNG = np.random.default_rng(0)


def np_advantages(r, groups, std_norm=True, eps=1e-6, valid=None):
    """verl's GRPO advantages of the valid rows, as if the others were not in the batch (0 there)."""
    valid = np.ones(len(r), bool) if valid is None else valid
    out = np.zeros(len(r))
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g and valid[i]]
        if not idx:
            continue
        vals = np.array([r[i] for i in idx], np.float64)
        if len(idx) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = vals.sum() / len(vals)
            std = np.sqrt(((vals - mean) ** 2).sum() / (len(vals) - 1))
        for i in idx:
            out[i] = (r[i] - mean) / (std + eps) if std_norm else r[i] - mean
    return out


def test_advantages_match_numpy():
    r = RNG.normal(size=40)
    groups = [f"q{i % 7}" for i in range(39)] + ["solo"]
    for std_norm in (True, False):
        ours = grpo.group_advantages(r, np.array(groups, object), std_norm=std_norm)
        np.testing.assert_allclose(ours, np_advantages(r, groups, std_norm), rtol=1e-6, atol=1e-6)


def test_advantages_hand_worked():
    # group of 3 rewards (1, 0, 0): mean 1/3, sample std sqrt(1/3) = 0.57735
    a = grpo.group_advantages(np.array([1.0, 0, 0]), np.array([0, 0, 0]))
    np.testing.assert_allclose(a, [(2 / 3) / 0.5773503, (-1 / 3) / 0.5773503, (-1 / 3) / 0.5773503], rtol=1e-5)
    # all equal rewards: zero advantage (std 0 + eps)
    assert (grpo.group_advantages(np.array([0.5, 0.5]), np.array([1, 1])) == 0).all()


def test_dropped_rows_leave_the_group_statistics_hand_worked():
    """Rows with valid False (void TIR trajectories) get advantage 0 and are not in their
    group's mean and std: group 0 is (1, 0, 0) plus a dropped 5.0, whose advantages are the
    hand-worked ones above; group 1 keeps one row of four, a group of one (A = r, as verl's
    advantages of the batch without the dropped rows); group 2 keeps none."""
    r = np.array([1.0, 0, 0, 5.0, 2.0, -3.0, 0.7, 9.0, 1.0, 2.0])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    valid = np.array([1, 1, 1, 0, 0, 0, 1, 0, 0, 0], bool)
    a = np.asarray(grpo.group_advantages(r, groups, valid=valid))
    s = np.sqrt(1 / 3)  # sample std of (1, 0, 0)
    np.testing.assert_allclose(a, [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0, 0, 0, 0.7 / (1 + 1e-6), 0, 0, 0],
                               rtol=1e-5, atol=1e-7)
    dr = np.asarray(grpo.group_advantages(r, groups, std_norm=False, valid=valid))  # Dr.GRPO: r - mean
    np.testing.assert_allclose(dr, [2 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0.7, 0, 0, 0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("std_norm", [True, False])
def test_advantages_with_dropped_rows_match_numpy(std_norm):
    r = RNG.normal(size=40)
    groups = [f"q{i % 6}" for i in range(40)]
    valid = RNG.uniform(size=40) < 0.6
    valid[[i for i in range(40) if groups[i] == "q5"]] = False  # a group with no valid row
    valid[[i for i in range(40) if groups[i] == "q4"][1:]] = False  # a group with one
    ours = grpo.group_advantages(r, np.array(groups, object), std_norm=std_norm, valid=valid)
    want = np_advantages(r, groups, std_norm, valid=valid)
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)
    assert (np.asarray(ours)[~valid] == 0).all() and np.abs(want[valid]).min() > 0
    # the same numbers as the kept rows scored on their own
    kept = grpo.group_advantages(r[valid], np.array(groups, object)[valid], std_norm=std_norm)
    np.testing.assert_allclose(np.asarray(ours)[valid], kept, rtol=1e-6, atol=1e-7)


def np_agg(values, mask, mode, horizon):
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        rows = [(v * m).sum() / m.sum() for v, m in zip(values, mask) if m.sum() > 0]
        return sum(rows) / len(rows)
    return (values * mask).sum() / horizon


def np_kl(logp, ref, kind):
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    kl = ref - logp
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


def np_loss(logp, old, ref, adv, ent, mask, clip_low, clip_high, dual, kl_coef, kl_type, ent_coef, mode, h,
            sampler=None, tis_cap=None):
    ratio = np.exp(np.clip(logp - old, -20, 20))
    a = adv[:, None]
    l1 = -a * ratio
    l2 = -a * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    lc = np.maximum(l1, l2)
    if dual is not None:
        lc = np.where(a < 0, np.minimum(-a * dual, lc), lc)
    if tis_cap is not None:  # verl: pg_losses * min(exp(old - rollout), cap), after the dual clip
        lc = lc * np.minimum(np.exp(old - sampler), tis_cap)
    total = np_agg(lc, mask, mode, h) - ent_coef * np_agg(ent, mask, mode, h)
    if kl_coef:
        total += kl_coef * np_agg(np_kl(logp, ref, kl_type), mask, mode, h)
    return total


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
@pytest.mark.parametrize("dual,tis_cap", [(None, None), (3.0, None), (None, 1.5), (3.0, 1.2)])
def test_loss_matches_numpy(mode, kl_type, dual, tis_cap):
    b, t, horizon = 6, 9, 23.0  # Dr.GRPO's horizon: a constant, not the width t
    logp = RNG.normal(-2, 1, size=(b, t))
    old = logp + RNG.normal(0, 0.3, size=(b, t))  # ratios on both sides of the clip range
    sampler = old + RNG.normal(0, 0.5, size=(b, t))  # TIS weights on both sides of the cap
    ref = logp + RNG.normal(0, 0.5, size=(b, t))
    ent = RNG.uniform(0, 3, size=(b, t))
    adv = RNG.normal(size=b)
    mask = (RNG.uniform(size=(b, t)) < 0.7).astype(np.float64)
    mask[2] = 0  # a sequence with no sampled token
    cfg = grpo.LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=dual, kl_coef=0.05, kl_type=kl_type,
                          entropy_coef=0.01, agg=mode, tis_cap=tis_cap)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, metrics = grpo.grpo_loss(f(logp), f(ent), grpo.LossTargets(f(old), f(ref), f(adv), f(mask), f(sampler)),
                                   cfg, grpo.norm_of(f(mask), horizon))
    expected = np_loss(logp, old, ref, adv, ent, mask, 0.2, 0.28, dual, 0.05, kl_type, 0.01, mode, horizon,
                       sampler, tis_cap)
    assert abs(float(loss) - expected) <= 1e-6 * max(1, abs(expected))
    assert abs(float(metrics["kl"]) - np_agg(np_kl(logp, ref, kl_type), mask, mode, horizon)) <= 1e-6
    if tis_cap is not None:
        w = np.exp(old - sampler)[mask > 0]
        assert (w > tis_cap).any() and (w < tis_cap).any()  # the cap binds at some tokens only


def test_hand_worked_clipping():
    cfg = grpo.LossConfig(kl_coef=0.0, dual_clip=3.0)
    norm = grpo.norm_of(jnp.ones((1, 1)))
    one = lambda x: jnp.array([[x]], jnp.float32)  # noqa: E731
    targets = lambda a: grpo.LossTargets(one(0.0), None, jnp.array([a]), one(1.0))  # noqa: E731
    # ratio e^0.5 = 1.6487 with A = +1: clipped at 1.2 -> loss -1.2
    loss, m = grpo.policy_loss(one(0.5), targets(1.0), cfg, norm)
    assert float(loss) == pytest.approx(-1.2) and float(m["pg_clipfrac"]) == 1.0
    # ratio e^-0.5 = 0.6065 with A = +1: pessimistic max(-0.6065, -0.8) -> -0.6065, no clip
    loss, m = grpo.policy_loss(one(-0.5), targets(1.0), cfg, norm)
    assert float(loss) == pytest.approx(-np.exp(-0.5), rel=1e-6) and float(m["pg_clipfrac"]) == 0.0
    # ratio e^2 = 7.389 with A = -1: max(7.389, 1.2) = 7.389, dual clip caps at 3
    loss, m = grpo.policy_loss(one(2.0), targets(-1.0), cfg, norm)
    assert float(loss) == pytest.approx(3.0) and float(m["pg_clipfrac_lower"]) == 1.0


def test_tis_hand_worked():
    """One token, A = +1, ratio 1 (no clip), entropy 2 with coef 0.1, KL coef 0.5: the TIS
    weight min(pi_old / pi_sampler, cap) multiplies the policy term only (verl's
    `pg_losses * tis_imp_ratio`); the clip fraction and ppo_kl do not see it."""
    cfg = grpo.LossConfig(kl_coef=0.5, kl_type="k1", entropy_coef=0.1, tis_cap=2.0)
    norm = grpo.norm_of(jnp.ones((1, 1)))
    one = lambda x: jnp.array([[x]], jnp.float32)  # noqa: E731
    kl = 0.5 * (-1.0 - -1.3)  # k1 = logp - ref
    for sampler, weight in [(-1.0 - np.log(3.0), 2.0), (-1.0 - np.log(1.5), 1.5), (-1.0 + np.log(2.0), 0.5)]:
        targets = grpo.LossTargets(one(-1.0), one(-1.3), jnp.array([1.0]), one(1.0), one(sampler))
        loss, m = grpo.grpo_loss(one(-1.0), one(2.0), targets, cfg, norm)
        assert float(m["pg_loss"]) == pytest.approx(-weight, rel=1e-6)
        assert float(loss) == pytest.approx(-weight - 0.1 * 2.0 + kl, rel=1e-6)
        assert float(m["pg_clipfrac"]) == 0.0 and float(m["ppo_kl"]) == 0.0
    off = grpo.LossConfig(kl_coef=0.5, kl_type="k1", entropy_coef=0.1)  # TIS off: the sampler is not read
    targets = grpo.LossTargets(one(-1.0), one(-1.3), jnp.array([1.0]), one(1.0), one(-9.0))
    loss, _ = grpo.grpo_loss(one(-1.0), one(2.0), targets, off, norm)
    assert float(loss) == pytest.approx(-1.0 - 0.2 + kl, rel=1e-6)


def test_sum_norm_needs_a_horizon():
    """Dr.GRPO divides by a constant horizon: without one it refuses, rather than divide by
    the batch's padded width."""
    mask = jnp.ones((2, 5), jnp.float32)
    with pytest.raises(ValueError, match="max_response_length"):
        grpo.aggregate(mask, mask, "seq-mean-token-sum-norm", grpo.norm_of(mask))
    with pytest.raises(ValueError, match="max_response_length"):
        grpo.token_weights(mask, "seq-mean-token-sum-norm", grpo.norm_of(mask))
    assert float(grpo.aggregate(mask, mask, "seq-mean-token-sum-norm", grpo.norm_of(mask, 40))) == 10 / 40


def test_low_var_kl_hand_worked():
    # logp = -1, ref = -2: kl = ref - logp = -1; exp(-1) + 1 - 1 = 0.36788
    assert float(grpo.kl_penalty(jnp.array(-1.0), jnp.array(-2.0), "low_var_kl")) == pytest.approx(np.exp(-1), rel=1e-6)
    # clamped at 10 for very different policies
    assert float(grpo.kl_penalty(jnp.array(-30.0), jnp.array(-1.0), "k3")) == 10.0


def test_bad_settings():
    with pytest.raises(ValueError, match="dual_clip=0.5"):
        grpo.LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_type='k9'"):
        grpo.kl_penalty(jnp.zeros(1), jnp.zeros(1), "k9")
    with pytest.raises(ValueError, match="tis_cap=0.5"):
        grpo.LossConfig(tis_cap=0.5)
    x = jnp.zeros((1, 1))
    with pytest.raises(ValueError, match="tis_cap=2.0 .*sampler_logp"):
        grpo.grpo_loss(x, x, grpo.LossTargets(x, x, jnp.zeros(1), x + 1), grpo.LossConfig(tis_cap=2.0),
                       grpo.norm_of(x))


# ---------------------------------------------------------------- GSPO (rl.loss.ratio = sequence)
def np_gspo(logp, old, adv, mask, low, high, tis=None):
    """GSPO as its paper states it (Zheng et al. 2025, eqs. 5-7): s_i = exp(mean over the
    response's tokens of log pi - log pi_old), J = mean over responses of min(s_i A_i,
    clip(s_i, 1 - low, 1 + high) A_i); the loss is -J. With TIS weights (car_jax's addition)
    each token's term is weighted and the response's tokens averaged. Also the gradient
    d loss / d logp: -A_i s_i w_t / (n_i N) where the unclipped term is the minimum, else 0
    (both terms' gradients at a tie: s_i inside the range, where they are equal)."""
    n = mask.sum(-1)
    rows = n > 0
    s = np.exp(np.where(rows, ((logp - old) * mask).sum(-1) / np.maximum(n, 1), 0.0))
    unclipped, clipped = s * adv, np.clip(s, 1 - low, 1 + high) * adv
    w = np.ones_like(logp) if tis is None else tis
    per_token = -np.minimum(unclipped, clipped)[:, None] * w
    loss = sum((per_token[i] * mask[i]).sum() / n[i] for i in np.flatnonzero(rows)) / rows.sum()
    live = (unclipped <= clipped) | ((s >= 1 - low) & (s <= 1 + high))
    grad = np.where(live[:, None], -(adv * s)[:, None] * w * mask / (np.maximum(n, 1)[:, None] * rows.sum()), 0.0)
    return loss, grad, s


@pytest.mark.parametrize("tis_cap", [None, 1.5])
def test_gspo_value_and_gradient_equal_the_paper_in_numpy(tis_cap):
    b, t = 8, 7
    rng = np.random.default_rng(3)
    logp = rng.normal(-2, 1, size=(b, t))
    old = logp + rng.normal(0, 0.08, size=(b, t))  # sequence ratios on both sides of the clip range
    sampler = old + rng.normal(0, 0.5, size=(b, t))
    adv = rng.normal(size=b)
    mask = (rng.uniform(size=(b, t)) < 0.8).astype(np.float64)
    mask[3] = 0  # a response with no sampled token
    cfg = grpo.LossConfig(ratio="sequence", agg="seq-mean-token-mean", seq_clip_low=0.02, seq_clip_high=0.03,
                          kl_coef=0.0, tis_cap=tis_cap)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    targets = grpo.LossTargets(f(old), None, f(adv), f(mask), f(sampler))
    norm = grpo.norm_of(f(mask))
    loss, grad = jax.value_and_grad(lambda lp: grpo.grpo_loss(lp, f(np.zeros((b, t))), targets, cfg, norm)[0])(f(logp))
    tis = None if tis_cap is None else np.minimum(np.exp(old - sampler), tis_cap)
    want, want_grad, s = np_gspo(logp, old, adv, mask, 0.02, 0.03, tis)
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    rows = mask.sum(-1) > 0
    binding = rows & (np.clip(s, 0.98, 1.03) * adv < s * adv)  # the clipped term is the minimum
    assert binding.any() and (rows & ~binding).any()  # both branches of the clip
    assert np.all(want_grad[binding] == 0) and np.all(np.abs(want_grad[rows & ~binding]).sum(-1) > 0)


def test_gspo_equals_the_sequence_level_objective_under_autodiff():
    """Without TIS the token-written surrogate (`sequence_old_logp`) has the value and the
    autodiff gradient of the sequence-level objective written directly: s_i from the
    log-probs, clipped per response, -mean_i min(s_i A_i, clip(s_i) A_i)."""
    b, t = 6, 9
    rng = np.random.default_rng(4)
    logp = jnp.asarray(rng.normal(-2, 1, size=(b, t)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.05, size=(b, t)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=b), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(b, t)) < 0.7, jnp.float32)
    cfg = grpo.LossConfig(ratio="sequence", agg="seq-mean-token-mean", seq_clip_low=0.01, seq_clip_high=0.015,
                          kl_coef=0.0)

    def sequence_level(lp):
        n = mask.sum(-1)
        s = jnp.exp(((lp - old) * mask).sum(-1) / jnp.maximum(n, 1.0))
        j = jnp.minimum(s * adv, jnp.clip(s, 1 - 0.01, 1 + 0.015) * adv)
        return -jnp.where(n > 0, j, 0.0).sum() / (n > 0).sum()

    ours = lambda lp: grpo.policy_loss(lp, grpo.LossTargets(old, None, adv, mask), cfg, grpo.norm_of(mask))[0]  # noqa: E731
    np.testing.assert_allclose(float(ours(logp)), float(sequence_level(logp)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(logp)), np.asarray(jax.grad(sequence_level)(logp)),
                               rtol=1e-5, atol=1e-8)


def test_gspo_settings():
    with pytest.raises(ValueError, match="agg='token-mean' must be seq-mean-token-mean with ratio=sequence"):
        grpo.LossConfig(ratio="sequence")
    with pytest.raises(ValueError, match="seq_clip_low=1.0"):
        grpo.LossConfig(ratio="sequence", agg="seq-mean-token-mean", seq_clip_low=1.0)
    cfg = grpo.LossConfig(ratio="sequence", agg="seq-mean-token-mean")
    assert cfg.clip_bounds == (3e-4, 4e-4) and grpo.LossConfig().clip_bounds == (0.2, 0.2)
