"""GRPO math with verl's semantics: group advantages, the clipped surrogate (optional
dual clip), KL estimators to a reference, entropy, and the loss aggregation modes.

All functions are pure and jittable over arrays. Token arrays are aligned to *token
positions* of the full sequence (prompt + response): `logp[b, t]` is the log-prob of
`tokens[b, t]` given `tokens[b, :t]`; `mask[b, t]` is 1 where the model sampled token t.
Letters: B sequences, T positions.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "k3", "low_var_kl", "abs"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # c > 1 bounds the loss of negative-advantage tokens (verl: 3.0)
    kl_coef: float = 0.001  # 0: no KL term and no reference forward
    kl_type: KLType = "low_var_kl"
    entropy_coef: float = 0.0
    agg: AggMode = "token-mean"
    log_ratio_clamp: float = 20.0
    # The rollout's log-prob temperature (logits / T, as sampled). Not a config key: the train
    # step's builder sets it from its `temperature` argument (`steps.make_train_step`), so the
    # episode config is its only source; the fused head (`head_loss`) reads it from here.
    temperature: float = dataclasses.field(default=1.0, metadata={"config": False})

    def __post_init__(self):
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low={self.clip_low} must be in [0, 1): the ratio's lower bound is 1 - clip_low")
        for f in ("clip_high", "kl_coef", "entropy_coef"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 0")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp} must be > 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1 (verl uses 3.0) or None")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use 1.0 for greedy rollouts)")


def group_index(group_ids) -> np.ndarray:
    """int32[B]: group ids (any hashables: strings, tuples, ints) numbered 0, 1, ... in
    order of first appearance. Host-side."""
    seen: dict = {}
    return np.array([seen.setdefault(g, len(seen)) for g in group_ids], np.int32)


def group_advantages(rewards: jax.Array, groups, *, std_norm: bool = True, eps: float = 1e-6) -> jax.Array:
    """float32[B] advantages: (r - mean_g) / (std_g + eps) within each group, std with ddof=1
    (torch.std), and mean 0 / std 1 for a group of one (as verl). Without std_norm (Dr.GRPO)
    A = r - mean_g. rewards float32[B]; groups: int32[B] group numbers in [0, B) (jittable:
    the trainer's device-side scoring, `calibration.sim`), or on the host any hashable ids
    (numbered by `group_index` first)."""
    if not isinstance(groups, jax.Array):
        groups = group_index(groups)
    return _group_advantages(jnp.asarray(rewards, jnp.float32), jnp.asarray(groups, jnp.int32), std_norm, eps)


@functools.partial(jax.jit, static_argnums=2)
def _group_advantages(r: jax.Array, groups: jax.Array, std_norm: bool, eps) -> jax.Array:
    def group_sum(x):  # [B] -> [B]: the sum of x over each row's group
        return jax.ops.segment_sum(x, groups, num_segments=r.shape[0])[groups]

    count = group_sum(jnp.ones_like(r))
    solo = count == 1.0
    centered = jnp.where(solo, r, r - group_sum(r) / count)
    if not std_norm:
        return centered
    std = jnp.sqrt(group_sum(jnp.square(centered)) / jnp.maximum(count - 1.0, 1.0))
    return centered / (jnp.where(solo, 1.0, std) + eps)


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: KLType) -> jax.Array:
    """Per-token KL estimate of pi || pi_ref from sampled-token log-probs."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "abs":
        return jnp.abs(logp - ref_logp)
    if kind == "k2":
        return 0.5 * jnp.square(logp - ref_logp)
    if kind in ("k3", "low_var_kl"):
        kl = jnp.clip(ref_logp - logp, -20.0, 20.0)
        return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_type={kind!r}: choose k1, k2, k3 (low_var_kl) or abs")


@dataclasses.dataclass(frozen=True)
class Norm:
    """Denominators of the aggregation over the *whole* mini-batch, so that micro-batches
    summed give exactly the mini-batch loss: tokens (sum of mask), seqs (sequences with
    at least one masked token), horizon (Dr.GRPO's constant length)."""
    tokens: jax.Array
    seqs: jax.Array
    horizon: jax.Array


jax.tree_util.register_dataclass(Norm, data_fields=["tokens", "seqs", "horizon"], meta_fields=[])


def norm_of(mask: jax.Array, horizon: float | None = None) -> Norm:
    """Norm for a batch mask [B, T] (horizon defaults to T)."""
    return Norm(tokens=jnp.maximum(mask.sum(), 1.0),
                seqs=jnp.maximum((mask.sum(-1) > 0).sum(), 1).astype(jnp.float32),
                horizon=jnp.asarray(mask.shape[-1] if horizon is None else horizon, jnp.float32))


def aggregate(values: jax.Array, mask: jax.Array, mode: AggMode, norm: Norm) -> jax.Array:
    """Scalar loss from per-token values [B, T] under `mode` (verl's agg_loss)."""
    if mode == "token-mean":
        return (values * mask).sum() / norm.tokens
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
        return per_seq.sum() / norm.seqs
    if mode == "seq-mean-token-sum-norm":
        return (values * mask).sum() / norm.horizon
    raise ValueError(f"loss aggregation {mode!r}: choose token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")


def token_weights(mask: jax.Array, mode: AggMode, norm: Norm) -> jax.Array:
    """float32[B, T] weights with aggregate(v, mask, mode, norm) == (v * weights).sum():
    every aggregation is a weighted sum of per-token values, which is what lets
    `head_loss` differentiate the loss one position at a time."""
    if mode == "token-mean":
        return mask / norm.tokens
    if mode == "seq-mean-token-mean":
        return mask / (jnp.maximum(mask.sum(-1, keepdims=True), 1.0) * norm.seqs)
    if mode == "seq-mean-token-sum-norm":
        return mask / norm.horizon
    raise ValueError(f"loss aggregation {mode!r}: choose token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")


def _surrogate(logp, old_logp, adv, cfg: LossConfig):
    """Per-token clipped surrogate, adv broadcast to logp's shape. Returns (losses, the
    clamped log-ratio, -adv * ratio, -adv * clipped ratio, their max: the loss before
    the dual clip)."""
    log_ratio = jnp.clip(logp - old_logp, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    clipped = jnp.maximum(loss1, loss2)
    losses = clipped
    if cfg.dual_clip is not None:
        losses = jnp.where(adv < 0, jnp.minimum(-adv * cfg.dual_clip, clipped), clipped)
    return losses, log_ratio, loss1, loss2, clipped


def token_loss(logp, entropy, old_logp, ref_logp, adv, cfg: LossConfig):
    """The total loss of each token, before aggregation: clipped surrogate -
    entropy_coef * entropy + kl_coef * KL. All arrays of one shape (adv broadcast);
    ref_logp is unused when kl_coef == 0. `grpo_loss` == (token_loss * token_weights).sum()."""
    loss = _surrogate(logp, old_logp, adv, cfg)[0] - cfg.entropy_coef * entropy
    if cfg.kl_coef:
        loss = loss + cfg.kl_coef * kl_penalty(logp, ref_logp, cfg.kl_type)
    return loss


def policy_loss(logp, old_logp, advantages, mask, cfg: LossConfig, norm: Norm):
    """Clipped surrogate. logp, old_logp, mask [B, T]; advantages [B] (broadcast over
    tokens). Returns (loss, metrics) with the clip fractions and the approximate KL to
    the sampling policy."""
    adv = advantages[:, None]
    losses, log_ratio, loss1, loss2, clipped = _surrogate(logp, old_logp, adv, cfg)
    metrics = {"pg_clipfrac": aggregate((loss2 > loss1).astype(jnp.float32), mask, "token-mean", norm),
               "ppo_kl": aggregate(-log_ratio, mask, "token-mean", norm)}
    if cfg.dual_clip is not None:
        metrics["pg_clipfrac_lower"] = aggregate(((clipped > -adv * cfg.dual_clip) & (adv < 0)).astype(jnp.float32),
                                                 mask, "token-mean", norm)
    return aggregate(losses, mask, cfg.agg, norm), metrics


def grpo_loss(logp, entropy, old_logp, ref_logp, advantages, mask, cfg: LossConfig, norm: Norm):
    """Total loss = policy loss - entropy_coef * entropy + kl_coef * KL (each aggregated
    under cfg.agg). ref_logp may be None when kl_coef == 0. Returns (loss, metrics)."""
    pg, metrics = policy_loss(logp, old_logp, advantages, mask, cfg, norm)
    ent = aggregate(entropy, mask, cfg.agg, norm)
    loss = pg - cfg.entropy_coef * ent
    metrics = {**metrics, "pg_loss": pg, "entropy": ent}
    if cfg.kl_coef:
        kl = aggregate(kl_penalty(logp, ref_logp, cfg.kl_type), mask, cfg.agg, norm)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl
    return loss, metrics
