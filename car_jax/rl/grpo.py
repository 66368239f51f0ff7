"""GRPO math with verl's semantics: group advantages (over the kept rows), the clipped
surrogate of token ratios or of GSPO's sequence ratios (optional dual clip, optional
truncated importance sampling against the sampler's log-probs), KL estimators to a reference, entropy, and the loss aggregation
modes (Dr.GRPO's with a constant horizon).

All functions are pure and jittable over arrays. Token arrays hold *response positions*
only: a batch keeps each row's response right-padded in its own row [B, R] and the prompts
apart (`rl.host_batch`, `steps.BATCH_KEYS`; the forward runs each distinct prompt once,
`logprobs.response_logprobs`), so no prompt position reaches the loss. `logp[b, r]` is the
log-prob of response token r of row b given its prompt and the response tokens before it;
`mask[b, r]` is 1 where the model sampled that token (0 on tool observations, padding and
dropped rows). Per-row values (advantages, rewards) are [B]. What the loss compares the
policy's log-probs against comes from the batch as one `LossTargets`.
Letters (`car_jax.dims`): B rows, R response positions.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from car_jax.config import require

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "k3", "low_var_kl", "abs"]
Ratio = Literal["token", "sequence"]


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
    # Truncated importance sampling (verl's token-level TIS, `tis_imp_ratio_cap`): each token's
    # policy-gradient term times min(pi_old / pi_sampler, tis_cap), the old policy's log-probs
    # recomputed by the trainer (needs rl.recompute_old_logp). None: off.
    tis_cap: float | None = None
    # The importance ratio: "token" (PPO / GRPO: each token's pi / pi_old, clipped to
    # [1 - clip_low, 1 + clip_high]) or "sequence" (GSPO, Zheng et al. 2025, "Group Sequence
    # Policy Optimization", eq. 7: s = (pi(y|x) / pi_old(y|x))^(1/|y|), the geometric mean of
    # the response's token ratios, clipped per response to [1 - seq_clip_low, 1 + seq_clip_high];
    # the paper's ranges are 3e-4 and 4e-4). GSPO averages each response's tokens, then the
    # responses: it needs agg seq-mean-token-mean.
    ratio: Ratio = "token"
    seq_clip_low: float = 3e-4
    seq_clip_high: float = 4e-4
    # The rollout's log-prob temperature and Dr.GRPO's horizon are no fields here: both come
    # from the episode config, and the train step's builder takes them as arguments
    # (`steps.make_train_step(..., temperature=, horizon=)`).

    def __post_init__(self):
        require(0 <= self.clip_low < 1, "clip_low", self.clip_low,
                "in [0, 1): the ratio's lower bound is 1 - clip_low")
        for f in ("clip_high", "kl_coef", "entropy_coef"):
            require(getattr(self, f) >= 0, f, getattr(self, f), ">= 0")
        require(self.log_ratio_clamp > 0, "log_ratio_clamp", self.log_ratio_clamp, "> 0")
        require(self.dual_clip is None or self.dual_clip > 1.0, "dual_clip", self.dual_clip,
                "> 1 (verl uses 3.0) or None")
        require(self.tis_cap is None or self.tis_cap >= 1.0, "tis_cap", self.tis_cap,
                ">= 1 (a cap below 1 shrinks even the tokens where sampler and trainer agree; verl's examples use "
                "2.0) or None (off)")
        require(self.ratio in ("token", "sequence"), "ratio", self.ratio, "token (PPO / GRPO) or sequence (GSPO)")
        require(0 <= self.seq_clip_low < 1, "seq_clip_low", self.seq_clip_low,
                "in [0, 1): the sequence ratio's lower bound is 1 - seq_clip_low (GSPO: 3e-4)")
        require(self.seq_clip_high >= 0, "seq_clip_high", self.seq_clip_high, ">= 0 (GSPO: 4e-4)")
        require(self.ratio == "token" or self.agg == "seq-mean-token-mean", "agg", self.agg,
                "seq-mean-token-mean with ratio=sequence (GSPO averages each response's tokens, then the "
                "responses; set rl.loss.agg=seq-mean-token-mean)")

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
        if self.ratio == "sequence":
            return self.seq_clip_low, self.seq_clip_high
        return self.clip_low, self.clip_high


def group_index(group_ids) -> np.ndarray:
    """int32[B]: group ids (any hashables: strings, tuples, ints) numbered 0, 1, ... in
    order of first appearance. Host-side."""
    seen: dict = {}
    return np.array([seen.setdefault(g, len(seen)) for g in group_ids], np.int32)


def group_advantages(rewards: jax.Array, groups, *, std_norm: bool = True, eps: float = 1e-6,
                     valid=None) -> jax.Array:
    """float32[B] advantages: (r - mean_g) / (std_g + eps) within each group, std with ddof=1
    (torch.std), and mean 0 / std 1 for a group of one (as verl). Without std_norm (Dr.GRPO)
    A = r - mean_g. rewards float32[B]; groups: int32[B] group numbers in [0, B) (jittable:
    the trainer's device-side scoring, `batches.make_scorer`, and `rl.sim`), or on the host any hashable ids
    (numbered by `group_index` first).

    valid bool[B] (default all): the rows that take part. A group's mean and std are over
    its valid rows only, and the other rows get advantage 0: exactly verl's advantages of
    the batch with the invalid rows taken out (SimpleTIR's void trajectories are filtered
    before the advantages). So a group left with one valid row is a group of one, A = r,
    as verl gives it: that row's reward is still a signal (correct vs. wrong), while A = 0
    would throw away the only trajectory of the prompt that was kept."""
    if not isinstance(groups, jax.Array):
        groups = group_index(groups)
    r = jnp.asarray(rewards, jnp.float32)
    valid = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
    return _group_advantages(r, jnp.asarray(groups, jnp.int32), valid, std_norm, eps)


@functools.partial(jax.jit, static_argnums=3)
def _group_advantages(r: jax.Array, groups: jax.Array, valid: jax.Array, std_norm: bool, eps) -> jax.Array:
    def group_sum(x):  # [B] -> [B]: the sum of x over each row's group
        return jax.ops.segment_sum(x, groups, num_segments=r.shape[0])[groups]

    v = valid.astype(jnp.float32)
    count = group_sum(v)  # valid rows in the row's group
    solo = count <= 1.0
    centered = jnp.where(solo, r, r - group_sum(r * v) / jnp.maximum(count, 1.0))
    if std_norm:
        std = jnp.sqrt(group_sum(jnp.square(centered) * v) / jnp.maximum(count - 1.0, 1.0))
        centered = centered / (jnp.where(solo, 1.0, std) + eps)
    return jnp.where(valid, centered, 0.0)


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
    at least one masked token), horizon (Dr.GRPO's constant length; None when not given,
    and then `seq-mean-token-sum-norm` refuses to aggregate)."""
    tokens: jax.Array
    seqs: jax.Array
    horizon: jax.Array | None


jax.tree_util.register_dataclass(Norm, data_fields=["tokens", "seqs", "horizon"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class LossTargets:
    """The batch's side of the loss, what the policy's log-probs are compared against
    (`grpo_loss`, `head_loss.grpo_head_loss`): old_logp float32[B, R] (the old policy's
    log-probs), ref_logp float32[B, R] (the reference's; None when kl_coef == 0),
    advantages float32[B] (one per row, broadcast over its tokens), mask float32[B, R]
    (the sampled tokens), sampler_logp float32[B, R] (the sampler's log-probs: needed with
    LossConfig.tis_cap, else None and never read)."""
    old_logp: jax.Array
    ref_logp: jax.Array | None
    advantages: jax.Array
    mask: jax.Array
    sampler_logp: jax.Array | None = None


jax.tree_util.register_dataclass(LossTargets, data_fields=["old_logp", "ref_logp", "advantages", "mask",
                                                           "sampler_logp"], meta_fields=[])

NO_HORIZON = ("loss aggregation seq-mean-token-sum-norm (Dr.GRPO) divides by a constant horizon, the "
              "configured maximum response length, and none was given: build the train step with "
              "make_train_step(..., horizon=EpisodeConfig.max_response_length), or "
              "pass norm_of(mask, horizon)")


def norm_of(mask: jax.Array, horizon: float | None = None) -> Norm:
    """Norm for a batch mask [B, R]. horizon: Dr.GRPO's constant divisor, never the padded
    width R, which changes with the batch's length bucket."""
    return Norm(tokens=jnp.maximum(mask.sum(), 1.0),
                seqs=jnp.maximum((mask.sum(-1) > 0).sum(), 1).astype(jnp.float32),
                horizon=None if horizon is None else jnp.asarray(horizon, jnp.float32))


def _horizon(norm: Norm) -> jax.Array:
    if norm.horizon is None:
        raise ValueError(NO_HORIZON)
    return norm.horizon


def aggregate(values: jax.Array, mask: jax.Array, mode: AggMode, norm: Norm) -> jax.Array:
    """Scalar loss from per-token values [B, R] under `mode` (verl's agg_loss)."""
    if mode == "token-mean":
        return (values * mask).sum() / norm.tokens
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)
        return per_seq.sum() / norm.seqs
    if mode == "seq-mean-token-sum-norm":
        return (values * mask).sum() / _horizon(norm)
    raise ValueError(f"loss aggregation {mode!r}: choose token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")


def token_weights(mask: jax.Array, mode: AggMode, norm: Norm) -> jax.Array:
    """float32[B, R] weights with aggregate(v, mask, mode, norm) == (v * weights).sum():
    every aggregation is a weighted sum of per-token values, which is what lets
    `head_loss` differentiate the loss one position at a time."""
    if mode == "token-mean":
        return mask / norm.tokens
    if mode == "seq-mean-token-mean":
        return mask / (jnp.maximum(mask.sum(-1, keepdims=True), 1.0) * norm.seqs)
    if mode == "seq-mean-token-sum-norm":
        return mask / _horizon(norm)
    raise ValueError(f"loss aggregation {mode!r}: choose token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")


def tis_weights(old_logp: jax.Array, sampler_logp: jax.Array | None, cfg: LossConfig) -> jax.Array | None:
    """float32[B, R] truncated importance weights min(exp(old_logp - sampler_logp), tis_cap),
    a constant (no gradient), or None with TIS off. old_logp: the old policy's log-probs
    as the trainer computes them; sampler_logp: the ones recorded while sampling."""
    if cfg.tis_cap is None:
        return None
    if sampler_logp is None:
        raise ValueError(f"tis_cap={cfg.tis_cap} weighs tokens by the sampler's log-probs: give "
                         "LossTargets(..., sampler_logp=)")
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - sampler_logp), cfg.tis_cap))


def sequence_old_logp(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
    """GSPO's sequence ratio written as token ratios (the paper's GSPO-token with one advantage
    per response): float32[B, R] sg(logp) - sg(log s_b), where log s_b = sum_r mask (logp -
    old_logp) / sum_r mask is the log of row b's sequence ratio. Against it each token's
    log-ratio logp - sg(logp) + sg(log s_b) has the value log s_b and the gradient of logp,
    so the token-level clipped surrogate, aggregated by seq-mean-token-mean, has GSPO's value
    and gradient: -A_b s_b (1/|y_b|) sum_r grad logp where s_b is inside the clip range, 0
    where it is clipped. The clipping, dual clip, TIS and aggregation code is shared."""
    now = jax.lax.stop_gradient(logp)
    log_s = ((now - old_logp) * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)  # [B]
    return now - jax.lax.stop_gradient(log_s)[:, None]


def _surrogate(logp, old_logp, adv, cfg: LossConfig):
    """Per-token clipped surrogate, adv broadcast to logp's shape. Returns (losses, the
    clamped log-ratio, -adv * ratio, -adv * clipped ratio, their max: the loss before
    the dual clip)."""
    log_ratio = jnp.clip(logp - old_logp, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    loss1 = -adv * ratio
    low, high = cfg.clip_bounds
    loss2 = -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    clipped = jnp.maximum(loss1, loss2)
    losses = clipped
    if cfg.dual_clip is not None:
        losses = jnp.where(adv < 0, jnp.minimum(-adv * cfg.dual_clip, clipped), clipped)
    return losses, log_ratio, loss1, loss2, clipped


def token_loss(logp, entropy, old_logp, ref_logp, adv, cfg: LossConfig, tis=None):
    """The total loss of each token, before aggregation: clipped surrogate (times the TIS
    weight `tis`, when given) - entropy_coef * entropy + kl_coef * KL. All arrays of one
    shape (adv broadcast); ref_logp is unused when kl_coef == 0.
    `grpo_loss` == (token_loss * token_weights).sum()."""
    pg = _surrogate(logp, old_logp, adv, cfg)[0]
    loss = (pg if tis is None else pg * tis) - cfg.entropy_coef * entropy
    if cfg.kl_coef:
        loss = loss + cfg.kl_coef * kl_penalty(logp, ref_logp, cfg.kl_type)
    return loss


def policy_loss(logp, targets: LossTargets, cfg: LossConfig, norm: Norm):
    """Clipped surrogate of logp float32[B, R] against targets' old_logp, advantages
    (broadcast over tokens) and mask; targets.sampler_logp is needed with cfg.tis_cap
    (each token's term is weighted by `tis_weights`, as verl multiplies pg_losses after
    the dual clip). With cfg.ratio="sequence" the ratio is GSPO's (`sequence_old_logp`; the
    TIS weights stay the tokens'). Returns (loss, metrics) with the clip fractions and the
    approximate KL to the old policy (with GSPO: of the sequence ratios, per token)."""
    mask = targets.mask
    adv = targets.advantages[:, None]
    tis = tis_weights(targets.old_logp, targets.sampler_logp, cfg)
    old = sequence_old_logp(logp, targets.old_logp, mask) if cfg.ratio == "sequence" else targets.old_logp
    losses, log_ratio, loss1, loss2, clipped = _surrogate(logp, old, adv, cfg)
    metrics = {"pg_clipfrac": aggregate((loss2 > loss1).astype(jnp.float32), mask, "token-mean", norm),
               "ppo_kl": aggregate(-log_ratio, mask, "token-mean", norm)}
    if cfg.dual_clip is not None:
        metrics["pg_clipfrac_lower"] = aggregate(((clipped > -adv * cfg.dual_clip) & (adv < 0)).astype(jnp.float32),
                                                 mask, "token-mean", norm)
    return aggregate(losses if tis is None else losses * tis, mask, cfg.agg, norm), metrics


def grpo_loss(logp, entropy, targets: LossTargets, cfg: LossConfig, norm: Norm):
    """Total loss = policy loss - entropy_coef * entropy + kl_coef * KL (each aggregated
    under cfg.agg) of the policy's logp and entropy float32[B, R] against `targets`
    (targets.ref_logp may be None when kl_coef == 0; targets.sampler_logp is needed with
    cfg.tis_cap: the TIS weight multiplies the policy term only). Returns (loss, metrics)."""
    pg, metrics = policy_loss(logp, targets, cfg, norm)
    ent = aggregate(entropy, targets.mask, cfg.agg, norm)
    loss = pg - cfg.entropy_coef * ent
    metrics = {**metrics, "pg_loss": pg, "entropy": ent}
    if cfg.kl_coef:
        kl = aggregate(kl_penalty(logp, targets.ref_logp, cfg.kl_type), targets.mask, cfg.agg, norm)
        loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl
    return loss, metrics
