"""Token sampling: greedy, temperature, top-k, top-p. Static and hashable, so a Sampler
can be a static argument of the jitted decode loop.

Recorded log-probs: every sampled token gets log softmax(logits / T)[token], the
temperature-scaled policy *before* top-k / top-p truncation (what verl's "old log-prob"
recomputes), with T = 1 for greedy decoding.

How the greedy pick and the draw are computed is the model's execution policy's
(`ExecutionPolicy.argmax` / `.draw`: plain `argmax` and `jax.random.categorical`, or
their XLA:CPU kernels).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from car_jax.config import require
from car_jax.models.policy import PLAIN, ExecutionPolicy


@dataclasses.dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off

    def __post_init__(self):
        require(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 is greedy)")
        require(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        require(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def policy_logprobs(self, logits: jax.Array) -> jax.Array:
        """float32[..., V] log-probabilities the recorded log-prob refers to."""
        t = 1.0 if self.greedy else self.temperature
        return jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)

    def __call__(self, logits: jax.Array, key: jax.Array,
                 execution: ExecutionPolicy = PLAIN) -> tuple[jax.Array, jax.Array]:
        """logits float32[B, V] -> (tokens int32[B], logp float32[B]); `execution` is the
        model's execution policy (how the pick and the draw are computed)."""
        logp_all = self.policy_logprobs(logits)
        if self.greedy:
            tokens = execution.argmax(logits)
        else:
            scaled = truncate(logits.astype(jnp.float32) / self.temperature, self.top_k, self.top_p)
            tokens = execution.draw(scaled, key)
        return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]


def truncate(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """logits [B, V] with those outside the top-k and outside the top-p nucleus set to the
    lowest finite value (never drawn)."""
    neg = jnp.finfo(logits.dtype).min
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < top_p  # the most likely token is always kept
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return logits
