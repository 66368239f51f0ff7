"""The KV cache: an explicit pytree passed into the forward pass and returned by it.

Slots are written left to right at one shared `index` for the whole batch, so rows stay
aligned: a left-padded prompt, a decode step, and an observation appended after a tool
call are all "write T slots at index". A slot that holds padding (a short prompt's left
pad, or the tail of a row whose observation is shorter than the chunk) is marked invalid
and is never attended to; RoPE positions count only valid tokens, per row, so holes in
the cache do not shift the positions the model sees.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from car_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    valid: jax.Array  # bool[B, S]  slot holds a real token
    next_pos: jax.Array  # int32[B]  RoPE position of each row's next real token
    index: jax.Array  # int32[]  next free slot, shared by all rows

    @property
    def capacity(self) -> int:  # S
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:  # B
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for `batch_size` rows and `capacity` slots (S)."""
    shape = (cfg.n_layers, batch_size, capacity, cfg.n_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        valid=jnp.zeros((batch_size, capacity), bool),
        next_pos=jnp.zeros((batch_size,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )
