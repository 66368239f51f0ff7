"""The on-device part of generation: a jitted prefill and a jitted decode loop.

A *segment* is one stretch of model output: prefill some new tokens (a prompt, or the
pending last token plus a tool observation), then sample until every row has stopped
(EOS, a stop pattern, or the row was already finished) or the segment budget is spent.

Invariant between segments: each row's last sampled token is *pending*: it was sampled
but not yet written to the cache. The next segment's prefill starts with it. This keeps
the loop body to one forward of one token per row, and a row that stops never writes
a token it will not condition on.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from car_jax.models.cache import KVCache
from car_jax.models.decoder import Decoder
from car_jax.rollout.sampling import Sampler
from car_jax.rollout.stops import STOP


class SegmentOut(NamedTuple):
    tokens: jax.Array  # int32[B, R] sampled ids (pad after a row's length)
    logp: jax.Array  # float32[B, R] recorded log-probs (0 after a row's length)
    length: jax.Array  # int32[B] tokens sampled in this segment
    stopped: jax.Array  # bool[B] the row stopped (EOS or pattern); False: ran out of budget
    eos: jax.Array  # bool[B] the stop was an EOS id
    pattern: jax.Array  # int32[B] index of the stop pattern that fired, -1 if none


class _Loop(NamedTuple):
    step: jax.Array
    cache: KVCache
    logits: jax.Array  # [B, V] next-token logits
    done: jax.Array  # bool[B]
    dfa: jax.Array  # int32[B, A] each stop automaton's state
    out: SegmentOut
    key: jax.Array


def _prefill(module: Decoder, params, cache: KVCache, tokens, valid):
    """Writes tokens int32[B, T] (valid bool[B, T]) into the cache; returns
    (logits float32[B, V] at each row's last valid token, cache)."""
    hidden, cache = module.apply({"params": params}, tokens, valid, cache, return_hidden=True)
    t = tokens.shape[1]
    last = t - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # index of the last valid token per row
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = module.apply({"params": params}, h_last, method=Decoder.unembed)
    return logits, cache


prefill = jax.jit(_prefill, static_argnums=(0,), donate_argnums=(2,))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill_shared(module: Decoder, params, cache: KVCache, tokens, valid, inverse):
    """`prefill` of an empty cache of B rows whose prompts repeat: the U distinct ones,
    tokens int32[U, P] (valid bool[U, P]), run once, and row b gets a copy of prompt
    inverse[b]'s keys, values and next-token logits (int32[B] into U). Returns
    (logits float32[B, V], cache with P slots written)."""
    u, p = tokens.shape
    small = module.policy.layers.init_cache(module.cfg, u, p, cache.dtype)
    logits, small = _prefill(module, params, small, tokens, valid)
    return logits[inverse], cache.put_prefix(small.rows(inverse))


def stop_check(tok, live, dfa, eos_ids, tables, enabled=None):
    """One sampled token per row through the stop tests: tok int32[B], live bool[B] (rows
    that sampled it), dfa int32[B, A] each automaton's state, eos_ids int32[E], tables
    int32[A, Z, V]; enabled bool[B, A] (default all): the automata a row listens to.
    Returns (is_eos bool[B], fired int32[B]: the first automaton that completed, -1 if
    none, dfa int32[B, A] after the token: 0 where one completed)."""
    n_pat = tables.shape[0]
    is_eos = jnp.any(tok[:, None] == eos_ids[None, :], axis=1) & live
    nxt = tables[jnp.arange(n_pat)[None, :], dfa, tok[:, None]]  # [B, A]
    hit = (nxt == STOP) & live[:, None]
    if enabled is not None:
        hit = hit & enabled
    fired = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), -1)
    return is_eos, fired, jnp.where(nxt == STOP, 0, nxt)


def _grown(full: KVCache, part: KVCache | None, slots: int) -> KVCache:
    """The first `slots` slots of `full` with the loop's cache `part` (its first slots)
    written in: the loop's cache widened for the next stage."""
    if part is not None and part.capacity < full.capacity:
        full = full.put_prefix(part)
    elif part is not None:
        full = part
    return full if slots >= full.capacity else full.prefix(slots)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), static_argnames=("windows",), donate_argnums=(4,))
def decode_segment(module: Decoder, sampler: Sampler, max_steps: int, params, cache: KVCache,
                   logits, active, eos_ids, tables, key, *, windows: tuple[int, ...] = ()):
    """Samples up to `max_steps` tokens per active row.

    logits float32[B, V]: next-token logits after the prefill; active bool[B]: rows that
    take part; eos_ids int32[E]; tables int32[A, Z, V] stop automata (see stops.py);
    key: PRNG key. windows: increasing slot counts W_1 < ... < W_k (the caller guarantees
    index + max_steps <= W_k <= S; see `generate.decode_windows`). The loop runs in
    stages: stage j samples while the cache still has room in its first W_j slots and
    attends over those only, so early tokens do not read the empty end of the cache; the
    slots are written back at the end. The same result as one stage over all S slots
    (the default, `()`), at less cost. Returns (SegmentOut, cache).
    Finished rows leave invalid holes in the cache; positions of the other rows are
    unaffected. A row that *stopped* has its last token pending (not in the cache); a row
    that ran out of budget has it written."""
    full = cache
    windows = tuple(windows) or (cache.capacity,)
    if list(windows) != sorted(set(windows)) or windows[-1] > cache.capacity:
        raise ValueError(f"windows {windows} must increase and end at most at the capacity {cache.capacity}")
    b = logits.shape[0]
    n_pat = tables.shape[0]
    params = module.policy.loop_params(params, module.dtype)  # once, outside the loop
    out = SegmentOut(
        tokens=jnp.zeros((b, max_steps), jnp.int32),
        logp=jnp.zeros((b, max_steps), jnp.float32),
        length=jnp.zeros((b,), jnp.int32),
        stopped=jnp.zeros((b,), bool),
        eos=jnp.zeros((b,), bool),
        pattern=jnp.full((b,), -1, jnp.int32),
    )
    state = _Loop(jnp.zeros((), jnp.int32), None, logits, ~active, jnp.zeros((b, n_pat), jnp.int32), out, key)
    index = full.index

    def cond(s: _Loop, end):
        return (s.step < end) & ~jnp.all(s.done)

    def body(s: _Loop):
        key, sub = jax.random.split(s.key)
        tok, lp = sampler(s.logits, sub, module.policy)
        live = ~s.done
        o = s.out
        tokens = o.tokens.at[:, s.step].set(jnp.where(live, tok, 0))
        logp = o.logp.at[:, s.step].set(jnp.where(live, lp, 0.0))
        length = o.length + live
        is_eos, fired, dfa = stop_check(tok, live, s.dfa, eos_ids, tables)
        stop_now = is_eos | (fired >= 0)
        out = SegmentOut(tokens, logp, length, o.stopped | stop_now, o.eos | is_eos,
                         jnp.where(live & (fired >= 0), fired, o.pattern))
        done = s.done | stop_now
        # rows still running condition on the new token; the others leave a hole
        step_logits, cache = module.apply({"params": params}, tok[:, None], ~done[:, None], s.cache)
        return _Loop(s.step + 1, cache, step_logits[:, 0], done, dfa, out, key)

    for j, slots in enumerate(windows):
        # the last stage runs to the budget; an earlier one while its slots have room
        end = max_steps if j == len(windows) - 1 else jnp.minimum(slots - index, max_steps)
        state = state._replace(cache=_grown(full, state.cache, slots))
        state = jax.lax.while_loop(functools.partial(cond, end=end), body, state)
    return state.out, _grown(full, state.cache, full.capacity)
