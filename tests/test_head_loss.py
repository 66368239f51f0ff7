"""The GRPO loss fused into the vocabulary projection against autodiff of the plain
expression: full logits, log_softmax, `grpo.grpo_loss`, no chunks, no custom gradient
(with the same Norm, Dr.GRPO's horizon and the TIS weights)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from car_jax.models.policy import PLAIN, XLA_CPU
from car_jax.rl import grpo
from car_jax.rl.head_loss import HeadSpec, grpo_head_loss

B, N, D, V = 3, 7, 5, 13


def inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(B, N, D)), dtype)
    w = jnp.asarray(rng.normal(size=(D, V)), dtype)
    y = jnp.asarray(rng.integers(0, V, size=(B, N)), jnp.int32)
    old = jnp.asarray(rng.normal(-2.5, 0.6, size=(B, N)), jnp.float32)
    ref = jnp.asarray(rng.normal(-2.5, 0.6, size=(B, N)), jnp.float32)
    adv = jnp.asarray([1.3, -0.7, -2.0], jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(B, N)) < 0.8, jnp.float32)
    return h, w, y, old, ref, adv, mask


def plain_loss(h, w, y, targets, cfg, norm, temperature=1.0):
    logits = jnp.einsum("bnd,dv->bnv", h.astype(jnp.float32), w.astype(jnp.float32)) / temperature
    full = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(full, y[..., None], axis=-1)[..., 0]
    ent = -(jnp.exp(full) * full).sum(-1)
    return grpo.grpo_loss(logp, ent, targets, cfg, norm)[0], (logp, ent)


# (loss config, the rollout's log-prob temperature, Dr.GRPO's horizon)
CONFIGS = [(grpo.LossConfig(agg="token-mean", kl_coef=0.05, kl_type="low_var_kl", entropy_coef=0.01), 1.0, None),
           (grpo.LossConfig(agg="seq-mean-token-mean", kl_coef=0.1, kl_type="k1", dual_clip=3.0, tis_cap=1.3), 0.7,
            None),
           (grpo.LossConfig(agg="seq-mean-token-sum-norm", kl_coef=0.02, kl_type="k2", clip_high=0.28,
                            entropy_coef=0.03, tis_cap=2.0), 1.0, 40.0),
           (grpo.LossConfig(agg="token-mean", kl_coef=0.0, kl_type="abs", dual_clip=2.0), 1.3, None),
           # GSPO's sequence ratio (its clip range widened so that some responses fall inside it)
           (grpo.LossConfig(agg="seq-mean-token-mean", ratio="sequence", seq_clip_low=0.03, seq_clip_high=0.02,
                            kl_coef=0.05, entropy_coef=0.01, tis_cap=1.5), 0.9, None)]


POLICIES = pytest.mark.parametrize("policy", [PLAIN, XLA_CPU], ids=lambda p: p.name)
CHUNKS = [1, 3, 128]  # one position a chunk; 3 chunks with padding; one chunk
# Every loss config at every chunking (the config's per-sequence weights meet the chunk
# boundaries), each pair under one policy, alternating, so that each policy runs every config
# and every chunking: the policy swaps only the head's vocabulary sums (`policy.row_sum`; in
# float32 its transposes are the plain .T), which see the chunk's rows but not the loss config
# (that only sets the per-token weights of the gradient the head receives).
CASES = [(case, chunk, (PLAIN, XLA_CPU)[(i + j) % 2]) for i, case in enumerate(CONFIGS)
         for j, chunk in enumerate(CHUNKS)]


@pytest.mark.parametrize("case,chunk,policy", CASES,
                         ids=[f"{c.agg}-{c.kl_type}-tis{c.tis_cap}-{n}-{p.name}" for (c, _, _), n, p in CASES])
def test_fused_loss_and_gradient_equal_autodiff(case, chunk, policy):
    cfg, temperature, horizon = case
    h, w, y, old, ref, adv, mask = inputs(jnp.float32)
    norm = grpo.norm_of(mask, horizon)
    # old log-probs near the policy's, so some ratios fall inside the clip range and some outside
    _, (logp0, _) = plain_loss(h, w, y, grpo.LossTargets(old, ref, adv, mask, old), cfg, norm, temperature)
    noise = np.random.default_rng(1).normal(0, 0.3, size=(2, B, N))
    old = logp0 + jnp.asarray(noise[0], jnp.float32)
    # and the sampler's log-probs near those, so some TIS weights are capped and some not
    sampler = old + jnp.asarray(2 * noise[1], jnp.float32)
    targets = grpo.LossTargets(old, ref, adv, mask, sampler)

    def ours(h, w):
        loss, logp, ent = grpo_head_loss(h, w, y, targets, cfg, norm, HeadSpec(chunk, policy, temperature))
        return loss, (logp, ent)

    def plain(h, w):
        return plain_loss(h, w, y, targets, cfg, norm, temperature)

    (l1, (lp1, e1)), g1 = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(h, w)
    (l2, (lp2, e2)), g2 = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(h, w)
    assert abs(float(l1) - float(l2)) <= 1e-6 * max(1.0, abs(float(l2)))
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp2), atol=1e-5)
    np.testing.assert_allclose(np.asarray(e1), np.asarray(e2), atol=1e-5)
    for a, b in zip(g1, g2):
        scale = float(jnp.abs(b).max())
        assert scale > 1e-3
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale)
    # the clip is active at some tokens and not at others (both branches are exercised); with
    # GSPO the ratio is the response's (the geometric mean of its tokens')
    log_ratio = np.asarray(lp2 - old)
    if cfg.ratio == "sequence":
        m = np.asarray(mask)
        log_ratio = np.repeat(((log_ratio * m).sum(-1) / m.sum(-1))[:, None], N, axis=1)
    low, high = cfg.clip_bounds
    inside = (np.exp(log_ratio) > 1 - low) & (np.exp(log_ratio) < 1 + high)
    assert inside.any() and (~inside).any()
    if cfg.tis_cap is not None:  # the TIS cap binds at some sampled tokens and not at others, and it matters
        capped = (np.exp(np.asarray(old - sampler)) > cfg.tis_cap)[np.asarray(mask) > 0]
        assert capped.any() and (~capped).any()
        untruncated = plain_loss(h, w, y, grpo.LossTargets(old, ref, adv, mask),
                                 dataclasses.replace(cfg, tis_cap=None), norm, temperature)[0]
        assert abs(float(untruncated) - float(l2)) > 1e-3


def test_dr_grpo_loss_is_the_same_at_any_padded_width():
    """One batch padded to widths 7 and 12 under seq-mean-token-sum-norm with a constant
    horizon: the same fused loss and gradients (zero on the padding), and the hand-computed
    value: with old = the policy's log-probs (ratio 1), no KL and no entropy term, each
    sampled token contributes -A, so the loss is -sum_b A_b n_b / horizon."""
    cfg = grpo.LossConfig(agg="seq-mean-token-sum-norm", kl_coef=0.0)
    h, w, y, _, ref, adv, mask = inputs(jnp.float32, seed=3)
    old = plain_loss(h, w, y, grpo.LossTargets(ref, ref, adv, mask), cfg, grpo.norm_of(mask, 40.0))[1][0]

    def pad(x):
        return jnp.pad(x, [(0, 0), (0, 5)] + [(0, 0)] * (x.ndim - 2))

    def fused(h, w, y, old, mask):
        return grpo_head_loss(h, w, y, grpo.LossTargets(old, None, adv, mask), cfg, grpo.norm_of(mask, 40.0),
                              HeadSpec(chunk=4))[0]

    grad = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))
    l7, (gh7, gw7) = grad(h, w, y, old, mask)
    l12, (gh12, gw12) = grad(pad(h), w, pad(y), pad(old), pad(mask))
    want = -(np.asarray(adv, np.float64) * np.asarray(mask).sum(1)).sum() / 40.0
    assert abs(float(l7) - want) <= 1e-6 * abs(want) and abs(float(l12) - want) <= 1e-6 * abs(want)
    np.testing.assert_allclose(np.asarray(gw12), np.asarray(gw7), atol=1e-7)
    np.testing.assert_allclose(np.asarray(gh12[:, :N]), np.asarray(gh7), atol=1e-7)
    assert not np.asarray(gh12[:, N:]).any() and float(jnp.abs(gw7).max()) > 1e-3


@POLICIES
def test_bfloat16_gradient_within_rounding(policy):
    """bf16 operands: the logit gradient is rounded to 8 mantissa bits before the two
    products, hence 2% (the reference sees the same rounded inputs, in float32)."""
    cfg = CONFIGS[0][0]
    h, w, y, old, ref, adv, mask = inputs(jnp.bfloat16, seed=2)
    norm, targets = grpo.norm_of(mask), grpo.LossTargets(old, ref, adv, mask)
    g1 = jax.grad(lambda h, w: grpo_head_loss(h, w, y, targets, cfg, norm, HeadSpec(chunk=3, policy=policy))[0],
                  argnums=(0, 1))(h, w)
    g2 = jax.grad(lambda h, w: plain_loss(h, w, y, targets, cfg, norm)[0], argnums=(0, 1))(h, w)
    for a, b in zip(g1, g2):
        assert a.dtype == jnp.bfloat16
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2 * scale)


def test_logprobs_and_entropies_carry_no_gradient():
    h, w, y, old, ref, adv, mask = inputs(jnp.float32)
    cfg, norm, targets = CONFIGS[0][0], grpo.norm_of(mask), grpo.LossTargets(old, ref, adv, mask)
    g = jax.grad(lambda h: grpo_head_loss(h, w, y, targets, cfg, norm)[1].sum()
                 + grpo_head_loss(h, w, y, targets, cfg, norm)[2].sum())(h)
    assert float(jnp.abs(g).max()) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_weights_reproduce_aggregate(mode):
    rng = np.random.default_rng(4)
    v = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(4, 6)) < 0.6, jnp.float32).at[2].set(0.0)  # one empty row
    norm = grpo.norm_of(mask, 17.0)
    want = float(grpo.aggregate(v, mask, mode, norm))
    assert float((v * grpo.token_weights(mask, mode, norm)).sum()) == pytest.approx(want, rel=1e-6)
