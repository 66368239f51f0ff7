"""The engine's cache rows (`engine.py`): jitted moves of KV rows between and within
caches. The episode slots are rows B of one KV cache; their decoding is the one decode loop
(`decode.DecodeLoop.run`) and their refills are `prefill.py`'s.

- `compact`: the cache's index is shared by all rows, so it grows with every step and
  prefill of any row; when it would overflow, each row's valid slots are packed to the
  front (order kept, so attention and RoPE positions are unchanged) and the index drops to
  the longest row's token count.
- `move_rows`: episodes moved between caches (a decode cache, its park, the tail's narrower
  decode cache), packed as `compact` packs them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from car_jax.models.cache import KVCache


def _pack(a, order, axis: int):
    """a [..., B, ..., S(axis)...] with each row's slots reordered by order int32[B, S];
    a stacked leaf [L, ...] one layer at a time (the extra memory is one layer's)."""
    def one(x):  # x [B, K, H, S] or [B, K, S, H]
        idx = order[:, None, None, :] if axis == -1 else order[:, None, :, None]
        return jnp.take_along_axis(x, idx, axis=axis)

    if a.ndim == 4:
        return one(a)
    return jax.lax.fori_loop(0, a.shape[0], lambda i, s: s.at[i].set(one(s[i])), a)


@functools.partial(jax.jit, donate_argnums=(0,))
def compact(cache: KVCache) -> KVCache:
    """Each row's valid slots moved to its front, in order; the index becomes the most
    valid slots of any row. Attention sees the same keys in the same order, and positions
    are per row (`next_pos`), so the model's outputs are unchanged."""
    order = jnp.argsort(~cache.valid, axis=1, stable=True).astype(jnp.int32)  # valid slots first
    k = jax.tree.map(lambda a: _pack(a, order, -1), cache.k)
    v = jax.tree.map(lambda a: _pack(a, order, -2), cache.v)
    valid = jnp.take_along_axis(cache.valid, order, axis=1)
    return KVCache(k=k, v=v, valid=valid, next_pos=cache.next_pos, index=jnp.max(valid.sum(axis=1)).astype(jnp.int32))


def _set_rows(a, rows, new):
    """a [..., B, x, y, z] (B the 4th axis from the end) with rows int32[N] set to new
    [..., N, x, y, z]; a row index out of range (B) drops its row."""
    return a.at[(slice(None),) * (a.ndim - 4) + (rows,)].set(new.astype(a.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnums=(2, 3))
def move_rows(src: KVCache, src_logits, dst: KVCache, dst_logits, src_rows, dst_rows):
    """Episodes moved between caches of the same capacity S (a decode cache, its park, a
    narrower decode cache): row src_rows[i] of src becomes row dst_rows[i] of dst, its
    valid slots packed to the front (order and positions kept, as `compact`), and its
    next-token logits with it (src_logits float32[B, V] into dst_logits float32[B', V];
    both None for a park, which has none). src_rows, dst_rows int32[N]; dst_rows[i] < 0:
    no move. dst's index becomes at least the most valid slots moved, so its next write
    lands after them. Returns (dst, dst_logits)."""
    b = dst.batch_size
    to = jnp.where(dst_rows < 0, b, dst_rows)  # out of range: dropped
    part = src.rows(jnp.maximum(src_rows, 0))
    order = jnp.argsort(~part.valid, axis=1, stable=True).astype(jnp.int32)
    k = jax.tree.map(lambda a, s: _set_rows(a, to, _pack(s, order, -1)), dst.k, part.k)
    v = jax.tree.map(lambda a, s: _set_rows(a, to, _pack(s, order, -2)), dst.v, part.v)
    valid = jnp.take_along_axis(part.valid, order, axis=1)
    moved = jnp.max(jnp.where(dst_rows >= 0, valid.sum(axis=1), 0)).astype(jnp.int32)
    dst = KVCache(k=k, v=v, valid=dst.valid.at[to].set(valid, mode="drop"),
                  next_pos=dst.next_pos.at[to].set(part.next_pos, mode="drop"), index=jnp.maximum(dst.index, moved))
    if dst_logits is not None:
        dst_logits = dst_logits.at[to].set(src_logits[jnp.maximum(src_rows, 0)], mode="drop")
    return dst, dst_logits
