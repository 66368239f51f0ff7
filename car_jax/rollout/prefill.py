"""The jitted prefills: new tokens written into the KV cache, giving each row's next-token
logits for the decode loop (`decode.DecodeLoop`).

- `prefill`: a chunk into every row at the cache's index (a prompt batch, or each row's
  pending token + tool observation).
- `prefill_rows`: the same, keeping the old logits of the rows that get no token (the
  engine's chunks for some slots).
- `prefill_distinct`: fresh prompts into some rows, each distinct prompt run once on a
  small cache and copied into its rows (a GRPO group shares a prompt). With every row
  refilled on an empty cache it is `generate`'s prefill; with some rows (the others kept)
  it is the engine's slot refill.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from car_jax.models.cache import KVCache
from car_jax.models.decoder import Decoder


def _forward_last(module: Decoder, params, cache: KVCache, tokens, valid):
    """Writes tokens int32[B, T] (valid bool[B, T]) into the cache; returns (logits
    float32[B, V] at each row's last valid token, cache)."""
    hidden, cache = module.apply({"params": params}, tokens, valid, cache, return_hidden=True)
    t = tokens.shape[1]
    last = t - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # index of the last valid token per row
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = module.apply({"params": params}, h_last, method=Decoder.unembed)
    return logits, cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill(module: Decoder, params, cache: KVCache, tokens, valid):
    """Writes tokens int32[B, T] (valid bool[B, T], left-padded) at the cache's index into
    every row; returns (logits float32[B, V] at each row's last valid token, cache)."""
    return _forward_last(module, params, cache, tokens, valid)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def prefill_rows(module: Decoder, params, cache: KVCache, logits, tokens, valid):
    """Writes tokens int32[B, T] (valid bool[B, T], left-padded) at the cache's index.
    Returns (logits float32[B, V]: the new ones for rows with a valid token, the old
    `logits` elsewhere, cache)."""
    new, cache = _forward_last(module, params, cache, tokens, valid)
    return jnp.where(valid.any(axis=1)[:, None], new, logits), cache


def _put_rows(big, small, rows, index, axis: int):
    """A k / v leaf big [..., B, K, ., .] (B the 4th axis from the end, slots at `axis`)
    with small's slots (same shape but T slots) written at slot `index` in the rows where
    rows bool[B] holds; other rows keep what they had there."""
    start = [0] * big.ndim
    start[axis % big.ndim] = index
    old = jax.lax.dynamic_slice(big, start, small.shape)
    mask = rows.reshape((1,) * (big.ndim - 4) + (-1, 1, 1, 1))
    return jax.lax.dynamic_update_slice(big, jnp.where(mask, small.astype(big.dtype), old), start)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnames=("cache", "logits"))
def prefill_distinct(module: Decoder, *, params, cache: KVCache, tokens, valid, inverse, logits=None):
    """Fresh prompts into rows of the cache, each distinct prompt run once: tokens
    int32[U, P] (valid bool[U, P], left-padded) go through a small cache of U rows; row b
    with inverse[b] >= 0 (int32[B] into U; -1: not refilled) starts a new episode (its old
    slots invalidated, positions from 0) with prompt inverse[b]'s keys and values at slots
    [index, index + P) and its next-token logits. logits float32[B, V]: the rows' current
    ones, kept where not refilled; None when every row is refilled (an empty cache).
    Returns (logits float32[B, V], cache with index + P)."""
    u, p = tokens.shape
    small = module.policy.layers.init_cache(module.cfg, u, p, cache.dtype)
    new, small = _forward_last(module, params, small, tokens, valid)
    rows = inverse >= 0
    pick = jnp.maximum(inverse, 0)
    small = small.rows(pick)  # [B] rows
    # the refilled rows start afresh: no valid slot, positions from 0
    cache = cache.replace(valid=cache.valid & ~rows[:, None], next_pos=jnp.where(rows, 0, cache.next_pos))
    at = cache.index
    k = jax.tree.map(lambda a, s: _put_rows(a, s, rows, at, -1), cache.k, small.k)
    v = jax.tree.map(lambda a, s: _put_rows(a, s, rows, at, -2), cache.v, small.v)
    old_valid = jax.lax.dynamic_slice(cache.valid, (0, at), small.valid.shape)
    valid_slots = jax.lax.dynamic_update_slice(cache.valid, jnp.where(rows[:, None], small.valid, old_valid), (0, at))
    cache = KVCache(k=k, v=v, valid=valid_slots, next_pos=jnp.where(rows, small.next_pos, cache.next_pos),
                    index=at + p)
    new = new[pick]
    return (new if logits is None else jnp.where(rows[:, None], new, logits)), cache
