"""How far the sampler's log-probs are from the trainer's, measured once a step on the device.

The rollout samples with one program (bf16 decode, a KV cache, top-p / top-k truncation)
and the trainer scores the same tokens with another (`steps.make_logprob_fn`), so the two
log-probs of a token differ even for the same weights. With `rl.recompute_old_logp` the
trainer's are the old policy of the PPO ratio, and `LossConfig.tis_cap` corrects for the gap
(`grpo.tis_weights`); these metrics show its size. Letters: B rows, R response positions.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames="tis_cap")
def mismatch_metrics(trainer_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array,
                     tis_cap: float | None = None) -> dict[str, jax.Array]:
    """Scalars over the tokens of the loss (mask float32[B, R] > 0), with d = trainer_logp -
    sampler_logp (float32[B, R] each) and ratio = exp(d) = pi_trainer / pi_sampler:
      mismatch/abs_dlogp      mean |d|
      mismatch/k3             mean (ratio - 1 - d): the k3 estimate of KL(sampler || trainer)
                              from the sampler's tokens (verl's mismatch_k3_kl)
      mismatch/max_ratio      the largest ratio (0 with no token)
      mismatch/tis_clipfrac   (with tis_cap) the fraction of tokens whose ratio exceeds the
                              cap, i.e. whose TIS weight is truncated
    d is clamped to [-20, 20] inside the exponentials (as the PPO log-ratio). Only these
    scalars leave the device."""
    on = mask > 0
    n = jnp.maximum(on.sum(), 1).astype(jnp.float32)
    d = (trainer_logp - sampler_logp).astype(jnp.float32)
    dc = jnp.clip(d, -20.0, 20.0)
    mean = lambda x: jnp.where(on, x, 0.0).sum() / n  # noqa: E731
    out = {"mismatch/abs_dlogp": mean(jnp.abs(d)),
           "mismatch/k3": mean(jnp.exp(dc) - dc - 1.0),
           "mismatch/max_ratio": jnp.exp(jnp.max(jnp.where(on, dc, -jnp.inf)))}
    if tis_cap is not None:
        out["mismatch/tis_clipfrac"] = mean((jnp.exp(dc) > tis_cap).astype(jnp.float32))
    return out
