"""The device side of the episode engine (`engine.py`): a fixed number of episode slots
(rows B of one KV cache) that episodes move through, and the jitted operations on them.

Every row is in one of three states, tracked on the host: *decoding* a segment, *waiting*
(for a tool result, or free for the next episode), or *empty*. The operations:

- `decode_slots`: samples for the decoding rows until a row's segment ends (a stop
  pattern, EOS, or its budget of `max_steps` tokens) and either every row has stopped, or
  `min_idle` rows are not decoding (a refill is worth doing), or `limit` (at most
  `max_steps`) steps ran (a tool result is due for a row that waits).
  Unlike `decode.decode_segment` a row's segment may span several calls: its token count
  so far and its stop automata's states go in and come out.
- `prefill_rows`: writes new tokens (a pending token + observation, or a fresh prompt)
  into some rows; the rows in `reset` start a new episode (their old slots are
  invalidated and their positions restart at 0). Rows without tokens keep their logits.
- `prefill_prompts_shared`: the same for fresh prompts, with each distinct prompt run
  once on a small cache and copied into its rows (a GRPO group's shared prompt); the rows
  not refilled are not run (on a mesh the small cache's rows split over fsdp too).
- `compact`: the cache's index is shared by all rows, so it grows with every step and
  prefill of any row; when it would overflow, each row's valid slots are packed to the
  front (order kept, so attention and RoPE positions are unchanged) and the index drops to
  the longest row's token count.

Randomness is per episode: the key of a row's next draw is
fold_in(fold_in(key, episode index), tokens the episode has drawn so far), so an
episode's tokens do not depend on its slot or on which episodes ran beside it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from car_jax.models.cache import KVCache
from car_jax.models.decoder import Decoder
from car_jax.rollout.decode import _grown, _prefill, stop_check
from car_jax.rollout.sampling import Sampler


class SlotOut(NamedTuple):
    """One `decode_slots` call's output; rows not decoding have length 0."""
    tokens: jax.Array  # int32[B, R] tokens sampled in this call (pad after length)
    logp: jax.Array  # float32[B, R] their recorded log-probs
    length: jax.Array  # int32[B] tokens sampled in this call
    stopped: jax.Array  # bool[B] the segment stopped on EOS or a pattern (last token pending)
    eos: jax.Array  # bool[B] the stop was an EOS id
    pattern: jax.Array  # int32[B] the automaton that fired, -1 if none
    dfa: jax.Array  # int32[B, A] the automata's states after the call
    steps: jax.Array  # int32[] loop steps this call ran


class _Loop(NamedTuple):
    step: jax.Array
    cache: KVCache
    logits: jax.Array  # float32[B, V]
    live: jax.Array  # bool[B] decoding
    count: jax.Array  # int32[B] tokens of the current segment
    drawn: jax.Array  # int32[B] tokens the row's episode has drawn
    out: SlotOut


def episode_keys(key: jax.Array, episode: jax.Array, drawn: jax.Array) -> jax.Array:
    """Per-row keys [B] of the next draw: key folded with the episode index int32[B] and
    the episode's drawn-token count int32[B]."""
    return jax.vmap(lambda e, d: jax.random.fold_in(jax.random.fold_in(key, e), d))(episode, drawn)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), static_argnames=("windows",), donate_argnums=(4, 5))
def decode_slots(module: Decoder, sampler: Sampler, max_steps: int, params, cache: KVCache, logits,
                 live, count, dfa, enabled, episode, drawn, eos_ids, tables, key, min_idle, limit,
                 *, windows: tuple[int, ...] = ()):
    """Decodes the live rows of the slots.

    logits float32[B, V] (next-token logits of every row); live bool[B] rows decoding;
    count int32[B] tokens of each row's current segment so far (a segment ends at
    max_steps); dfa int32[B, A] automaton states; enabled bool[B, A] the automata each row
    listens to (its turn's stops); episode int32[B] and drawn int32[B] (the per-episode
    RNG, see the module doc); eos_ids int32[E]; tables int32[A, Z, V]; key: the rollout's
    PRNG key; min_idle int32[]: return once that many rows are not live; limit int32[]:
    return after that many steps at most (a tool result is due: the call ends so its row
    can take it; results do not depend on where calls end). windows: as
    `decode.decode_segment` (index + max_steps <= W_k <= S). Returns (SlotOut, logits,
    cache). A row whose segment stopped has its last token pending; one that used its
    budget has it written."""
    full = cache
    windows = tuple(windows) or (cache.capacity,)
    if list(windows) != sorted(set(windows)) or windows[-1] > cache.capacity:
        raise ValueError(f"windows {windows} must increase and end at most at the capacity {cache.capacity}")
    b = logits.shape[0]
    params = module.policy.loop_params(params, module.dtype)  # once, outside the loop
    out = SlotOut(tokens=jnp.zeros((b, max_steps), jnp.int32), logp=jnp.zeros((b, max_steps), jnp.float32),
                  length=jnp.zeros((b,), jnp.int32), stopped=jnp.zeros((b,), bool), eos=jnp.zeros((b,), bool),
                  pattern=jnp.full((b,), -1, jnp.int32), dfa=dfa, steps=jnp.zeros((), jnp.int32))
    state = _Loop(jnp.zeros((), jnp.int32), None, logits, live, count, drawn, out)
    index = full.index

    def cond(s: _Loop, end):
        idle = jnp.sum(~s.live)
        return (s.step < jnp.minimum(end, limit)) & jnp.any(s.live) & (idle < min_idle)

    def body(s: _Loop):
        one = lambda lg, k: tuple(x[0] for x in sampler(lg[None], k, module.policy))  # noqa: E731
        tok, lp = jax.vmap(one)(s.logits, episode_keys(key, episode, s.drawn))
        live, o = s.live, s.out
        tokens = o.tokens.at[:, s.step].set(jnp.where(live, tok, 0))
        logp = o.logp.at[:, s.step].set(jnp.where(live, lp, 0.0))
        is_eos, fired, dfa = stop_check(tok, live, o.dfa, eos_ids, tables, enabled)
        stop_now = is_eos | (fired >= 0)
        count = s.count + live
        writes = live & ~stop_now  # the row conditions on its token (a stopped row's stays pending)
        out = SlotOut(tokens, logp, o.length + live, o.stopped | stop_now, o.eos | is_eos,
                      jnp.where(fired >= 0, fired, o.pattern), jnp.where(live[:, None], dfa, o.dfa), o.steps + 1)
        step_logits, cache = module.apply({"params": params}, tok[:, None], writes[:, None], s.cache)
        logits = jnp.where(writes[:, None], step_logits[:, 0], s.logits)
        return _Loop(s.step + 1, cache, logits, writes & (count < max_steps), count, s.drawn + live, out)

    for j, slots in enumerate(windows):
        end = max_steps if j == len(windows) - 1 else jnp.minimum(slots - index, max_steps)
        state = state._replace(cache=_grown(full, state.cache, slots))
        state = jax.lax.while_loop(functools.partial(cond, end=end), body, state)
    return state.out, state.logits, _grown(full, state.cache, full.capacity)


def _restart(cache: KVCache, reset) -> KVCache:
    """The cache with rows reset bool[B] emptied: no valid slot, positions from 0."""
    return cache.replace(valid=cache.valid & ~reset[:, None], next_pos=jnp.where(reset, 0, cache.next_pos))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def prefill_rows(module: Decoder, params, cache: KVCache, logits, tokens, valid, reset):
    """Writes tokens int32[B, T] (valid bool[B, T], left-padded) at the cache's index; rows
    in reset bool[B] start afresh first. Returns (logits float32[B, V]: the new ones for rows
    with a valid token, the old ones elsewhere, cache)."""
    new, cache = _prefill(module, params, _restart(cache, reset), tokens, valid)
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


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def prefill_prompts_shared(module: Decoder, params, cache: KVCache, logits, tokens, valid, inverse):
    """Fresh prompts into some rows, each distinct prompt run once: tokens int32[U, P]
    (valid bool[U, P], left-padded) on a small cache of U rows; row b with inverse[b] >= 0
    (int32[B] into U; -1: not refilled) starts a new episode with prompt inverse[b]'s keys,
    values and logits at slots [index, index + P). Returns (logits float32[B, V], cache)."""
    u, p = tokens.shape
    small = module.policy.layers.init_cache(module.cfg, u, p, cache.dtype)
    new, small = _prefill(module, params, small, tokens, valid)
    rows = inverse >= 0
    small = small.rows(jnp.maximum(inverse, 0))  # [B] rows
    cache = _restart(cache, rows)
    at = cache.index
    k = jax.tree.map(lambda a, s: _put_rows(a, s, rows, at, -1), cache.k, small.k)
    v = jax.tree.map(lambda a, s: _put_rows(a, s, rows, at, -2), cache.v, small.v)
    old_valid = jax.lax.dynamic_slice(cache.valid, (0, at), small.valid.shape)
    valid_slots = jax.lax.dynamic_update_slice(cache.valid, jnp.where(rows[:, None], small.valid, old_valid), (0, at))
    cache = KVCache(k=k, v=v, valid=valid_slots, next_pos=jnp.where(rows, small.next_pos, cache.next_pos),
                    index=at + p)
    return jnp.where(rows[:, None], new[jnp.maximum(inverse, 0)], logits), cache


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
