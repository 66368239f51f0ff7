"""The KV cache: an explicit pytree passed into the forward pass and returned by it.

Slots are written left to right at one shared `index` for the whole batch, so rows stay
aligned: a left-padded prompt, a decode step, and an observation appended after a tool
call are all "write T slots at index". A slot that holds padding (a short prompt's left
pad, or the tail of a row whose observation is shorter than the chunk) is marked invalid
and is never attended to; RoPE positions count only valid tokens, per row, so holes in
the cache do not shift the positions the model sees.

Layout: one [B, K, S, H] array per layer (not one stacked [L, ...] array), with the kv
heads before the slots, so a decode step reads each layer's keys and values in place: no
slice of a stack and no transpose is copied per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from car_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # L arrays [B, K, S, H], one per layer
    v: tuple[jax.Array, ...]  # L arrays [B, K, S, H]
    valid: jax.Array  # bool[B, S]  slot holds a real token
    next_pos: jax.Array  # int32[B]  RoPE position of each row's next real token
    index: jax.Array  # int32[]  next free slot, shared by all rows

    @property
    def capacity(self) -> int:  # S
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:  # B
        return self.k[0].shape[0]


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for `batch_size` rows and `capacity` slots (S)."""
    shape = (batch_size, cfg.n_kv_heads, capacity, cfg.head_dim)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)),
        valid=jnp.zeros((batch_size, capacity), bool),
        next_pos=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )
