"""The KV cache: an explicit pytree passed into the forward pass and returned by it.

Slots are written left to right at one shared `index` for the whole batch, so rows stay
aligned: a left-padded prompt, a decode step, and an observation appended after a tool
call are all "write T slots at index". A slot that holds padding (a short prompt's left
pad, or the tail of a row whose observation is shorter than the chunk) is marked invalid
and is never attended to; RoPE positions count only valid tokens, per row, so holes in
the cache do not shift the positions the model sees.

Layout: kv heads before slots, keys stored transposed: keys [.., B, K, H, S] and values
[.., B, K, S, H], so both attention products are plain (non-transposed) batched matmuls,
q [T*G, H] @ k [H, S] and p [T*G, S] @ v [S, H], reading the cache in place. The plain
layout stacks the layers: keys [L, B, K, H, S], values [L, B, K, S, H], carried through
the layer scan, each layer writing its new slots into the stack and attending over its
slice (`StackedKV`). The execution policy may hold one array per layer instead (a tuple
of L arrays [B, K, H, S]; `xla_cpu`), each layer's view then being a `LayerKV`. Either
way a layer sees keys [B, K, H, S] and values [B, K, S, H], and everything below indexes
the B, K, S and H axes from the end, so it serves both layouts.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from car_jax import sharding as shd
from car_jax.models.config import ModelConfig


@struct.dataclass
class KVCache:
    k: Any  # keys: [L, B, K, H, S] (stacked), or a tuple of L arrays [B, K, H, S] (per layer)
    v: Any  # values: [L, B, K, S, H], or a tuple of L arrays [B, K, S, H]
    valid: jax.Array  # bool[B, S]  slot holds a real token
    next_pos: jax.Array  # int32[B]  RoPE position of each row's next real token
    index: jax.Array  # int32[]  next free slot, shared by all rows

    @property
    def capacity(self) -> int:  # S
        return jax.tree.leaves(self.v)[0].shape[-2]

    @property
    def batch_size(self) -> int:  # B
        return jax.tree.leaves(self.k)[0].shape[-4]

    @property
    def dtype(self) -> jnp.dtype:
        return jax.tree.leaves(self.k)[0].dtype

    def prefix(self, window: int) -> "KVCache":
        """The first `window` slots (a copy): every slot at or after `window` must be
        empty, and stays so while the cache is used."""
        return KVCache(k=jax.tree.map(lambda k: k[..., :window], self.k),
                       v=jax.tree.map(lambda v: v[..., :window, :], self.v),
                       valid=self.valid[:, :window], next_pos=self.next_pos, index=self.index)

    def put_prefix(self, part: "KVCache") -> "KVCache":
        """This cache with its first slots replaced by `part` (from `prefix`), and part's
        index and positions."""
        put = lambda a, b: jax.lax.dynamic_update_slice(a, b, (0,) * a.ndim)  # noqa: E731
        return KVCache(k=jax.tree.map(put, self.k, part.k), v=jax.tree.map(put, self.v, part.v),
                       valid=put(self.valid, part.valid), next_pos=part.next_pos, index=part.index)

    def rows(self, index: jax.Array) -> "KVCache":
        """Row index[b] of this cache as row b (index int32[B'] into B)."""
        take = lambda a: a[..., index, :, :, :]  # noqa: E731  (B is the 4th axis from the end)
        return KVCache(k=jax.tree.map(take, self.k), v=jax.tree.map(take, self.v), valid=self.valid[index],
                       next_pos=self.next_pos[index], index=self.index)


@struct.dataclass
class LayerKV:
    """One layer's own cache arrays: keys [B, K, H, S], values [B, K, S, H]."""
    k: jax.Array
    v: jax.Array

    def write(self, k: jax.Array, v: jax.Array, index) -> tuple[jax.Array, jax.Array, "LayerKV"]:
        """Writes a chunk's keys k [B, K, H, T] and values v [B, K, T, H] at slots
        [index, index + T); returns (keys [B, K, H, S], values [B, K, S, H], the view)."""
        keys = jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), (0, 0, 0, index))
        values = jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), (0, 0, index, 0))
        return keys, values, LayerKV(keys, values)


@struct.dataclass
class StackedKV:
    """Layer `layer` (int32[]) of the stacked cache: keys [L, B, K, H, S], values [L, B, K, S, H]."""
    k: jax.Array
    v: jax.Array
    layer: jax.Array

    def write(self, k: jax.Array, v: jax.Array, index) -> tuple[jax.Array, jax.Array, "StackedKV"]:
        """Writes a chunk's keys k [B, K, H, T] and values v [B, K, T, H] into the layer's
        slots [index, index + T) of the stack, in place; returns (the layer's keys
        [B, K, H, S] and values [B, K, S, H], the view of the updated stack)."""
        i = self.layer
        ks = jax.lax.dynamic_update_slice(self.k, k[None].astype(self.k.dtype), (i, 0, 0, 0, index))
        vs = jax.lax.dynamic_update_slice(self.v, v[None].astype(self.v.dtype), (i, 0, 0, index, 0))
        layer = lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False)  # noqa: E731
        return layer(ks), layer(vs), StackedKV(ks, vs, i)


def zeros(shape, dtype, mesh: Mesh | None, name: str, one_layer: bool = False) -> jax.Array:
    """Zeros of `shape`, on `mesh` in the sampling sharding of the `name` entry of
    `sharding.DATA_AXES` when given (one_layer: one layer's slice of that entry)."""
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return jnp.zeros(shape, dtype, device=shd.data_sharding(name, shape, mesh, "sample", one_layer=one_layer))


def empty_rows(batch_size: int, capacity: int, mesh: Mesh | None = None) -> dict[str, jax.Array]:
    """The valid / next_pos / index fields of an empty cache."""
    return dict(valid=zeros((batch_size, capacity), bool, mesh, "cache_rows"),
                next_pos=zeros((batch_size,), jnp.int32, mesh, "rows"), index=jnp.zeros((), jnp.int32))


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32,
               mesh: Mesh | None = None) -> KVCache:
    """An empty stacked cache for `batch_size` rows and `capacity` slots (S); on `mesh`,
    rows split over fsdp and kv heads over tp (the sampling table)."""
    k_shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, cfg.head_dim, capacity)
    v_shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, capacity, cfg.head_dim)
    return KVCache(k=zeros(k_shape, dtype, mesh, "cache_k"), v=zeros(v_shape, dtype, mesh, "cache_v"),
                   **empty_rows(batch_size, capacity, mesh))
