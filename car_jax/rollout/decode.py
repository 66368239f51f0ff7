"""The one decode loop: `DecodeLoop`, a frozen, hashable object holding the loop's static
parts (the module, the sampler, the segment budget, the window stages), which is the
jitted entry points' static `self`, over a `DecodeState` of arrays.

A *segment* is one stretch of a row's model output: sampled until a stop (EOS, or a stop
automaton of the row's completes) or its budget of `max_steps` tokens. `generate` runs one
segment for a batch from fresh state (`DecodeLoop.segment`); the episode engine keeps its
slots' state between calls (`DecodeLoop.run`): a row's segment may span several calls, and
a call may end early, once `min_idle` rows are not decoding (a refill is worth doing) or
after `limit` steps (a tool result is due). Where a call ends changes no token.

Invariant between segments: a row whose segment *stopped* has its last token *pending*:
sampled but not written to the cache (the next prefill starts with it), so the loop body
is one forward of one token per row and a row never writes a token it will not condition
on. A row that used its budget has its last token written. A row that is not decoding
writes nothing (a hole in the cache that is never attended to) and keeps its logits.

Randomness is per episode: the key of a row's next draw is fold_in(fold_in(key, episode),
tokens the episode has drawn so far), so an episode's tokens depend neither on its row nor
on the rows beside it (in `segment` a row's episode is its row index). Greedy decoding
draws nothing.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from car_jax.models.cache import KVCache
from car_jax.models.decoder import Decoder
from car_jax.rollout.sampling import Sampler
from car_jax.rollout.stops import STOP


class SegmentOut(NamedTuple):
    """What one decode call sampled; rows not decoding have length 0."""
    tokens: jax.Array  # int32[B, R] sampled ids (0 after a row's length)
    logp: jax.Array  # float32[B, R] recorded log-probs (0 after a row's length)
    length: jax.Array  # int32[B] tokens sampled in this call
    stopped: jax.Array  # bool[B] the segment stopped (EOS or pattern; last token pending); False: budget or call end
    eos: jax.Array  # bool[B] the stop was an EOS id
    pattern: jax.Array  # int32[B] index of the stop automaton that fired, -1 if none
    steps: jax.Array  # int32[] loop steps the call ran (replicated)


class DecodeState(NamedTuple):
    """The rows' state that a decode call takes and returns."""
    cache: KVCache
    logits: jax.Array  # float32[B, V] each row's next-token logits
    live: jax.Array  # bool[B] the row is decoding
    count: jax.Array  # int32[B] tokens of the row's current segment so far (it ends at max_steps)
    dfa: jax.Array  # int32[B, A] each stop automaton's state
    enabled: jax.Array  # bool[B, A] the automata the row listens to (its turn's stops)
    episode: jax.Array  # int32[B] the row's episode: its RNG stream
    drawn: jax.Array  # int32[B] tokens that episode has drawn: the position in its stream

    @classmethod
    def fresh(cls, cache: KVCache, logits: jax.Array, live: jax.Array, n_automata: int) -> "DecodeState":
        """The start of one segment for every row: live bool[B] rows decode, every automaton
        listens, row b is episode b with nothing drawn yet."""
        b = logits.shape[0]
        zeros = jnp.zeros((b,), jnp.int32)
        return cls(cache=cache, logits=logits, live=live, count=zeros, dfa=jnp.zeros((b, n_automata), jnp.int32),
                   enabled=jnp.ones((b, n_automata), bool), episode=jnp.arange(b, dtype=jnp.int32), drawn=zeros)


class _Carry(NamedTuple):
    state: DecodeState  # its cache: the current stage's window of the slots
    out: SegmentOut  # out.steps counts the loop's steps


def episode_keys(key: jax.Array, episode: jax.Array, drawn: jax.Array) -> jax.Array:
    """Per-row keys [B] of the next draw: key folded with the episode index int32[B] and
    the episode's drawn-token count int32[B]."""
    return jax.vmap(lambda e, d: jax.random.fold_in(jax.random.fold_in(key, e), d))(episode, drawn)


def stop_check(tok, live, dfa, eos_ids, tables, enabled):
    """One sampled token per row through the stop tests: tok int32[B], live bool[B] (rows
    that sampled it), dfa int32[B, A] each automaton's state, eos_ids int32[E], tables
    int32[A, Z, V], enabled bool[B, A] the automata a row listens to. Returns (is_eos
    bool[B], fired int32[B]: the first listened-to automaton that completed, -1 if none,
    dfa int32[B, A] after the token: 0 where one completed)."""
    n_pat = tables.shape[0]
    is_eos = jnp.any(tok[:, None] == eos_ids[None, :], axis=1) & live
    nxt = tables[jnp.arange(n_pat)[None, :], dfa, tok[:, None]]  # [B, A]
    hit = (nxt == STOP) & live[:, None] & enabled
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeLoop:
    """The decode loop's static parts: hashable, the jitted entry points' static `self`
    (a loop object per distinct value compiles its own programs).

    windows: increasing slot counts W_1 < ... < W_k (index + max_steps <= W_k <= S; see
    `generate.decode_windows`), or () for one stage over all S slots. The loop runs in
    stages: stage j samples while the cache still has room in its first W_j slots and
    attends over those only, so early tokens do not read the empty end of a cache sized
    for a whole episode; the slots are written back at the end. The same result as one
    stage over all S slots, at less cost."""
    module: Decoder
    sampler: Sampler
    max_steps: int  # R: a segment's budget, and the most steps of one call
    windows: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "windows", tuple(int(w) for w in self.windows))  # hashable
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps} must be >= 1")

    @functools.partial(jax.jit, static_argnames=("self",), donate_argnames=("cache",))
    def segment(self, *, params, cache: KVCache, logits, live, eos_ids, tables, key) -> tuple[SegmentOut, KVCache]:
        """One segment for the live rows from fresh state (`DecodeState.fresh`): logits
        float32[B, V] after the prefill, live bool[B] the rows that take part, eos_ids
        int32[E], tables int32[A, Z, V] stop automata (see stops.py), key: PRNG key. Runs
        until every row has stopped or the budget is spent. Returns (SegmentOut, cache)."""
        b = logits.shape[0]
        state = DecodeState.fresh(cache, logits, live, tables.shape[0])
        out, state = self._loop(params, state, eos_ids, tables, key, min_idle=b + 1, limit=self.max_steps)
        return out, state.cache

    @functools.partial(jax.jit, static_argnames=("self",), donate_argnames=("state",))
    def run(self, *, params, state: DecodeState, eos_ids, tables, key, min_idle,
            limit) -> tuple[SegmentOut, DecodeState]:
        """Decodes the live rows of `state` (eos_ids, tables, key as `segment`) until every
        row has stopped or used its budget, or min_idle int32[] rows are not live, or after
        limit int32[] (at most max_steps) steps. Returns (SegmentOut, the state after)."""
        return self._loop(params, state, eos_ids, tables, key, min_idle=min_idle, limit=limit)

    # -- the loop (traced inside the entry points) -------------------------------------
    def _stages(self, capacity: int) -> tuple[int, ...]:
        windows = self.windows or (capacity,)
        if list(windows) != sorted(set(windows)) or windows[-1] > capacity:
            raise ValueError(f"windows {windows} must increase and end at most at the capacity {capacity}")
        return windows

    def _loop(self, params, state: DecodeState, eos_ids, tables, key, *, min_idle,
              limit) -> tuple[SegmentOut, DecodeState]:
        """The while_loop of each stage, over `_step`."""
        full = state.cache
        windows = self._stages(full.capacity)
        b, r = state.logits.shape[0], self.max_steps
        params = self.module.policy.loop_params(params, self.module.dtype)  # once, outside the loop
        out = SegmentOut(tokens=jnp.zeros((b, r), jnp.int32), logp=jnp.zeros((b, r), jnp.float32),
                         length=jnp.zeros((b,), jnp.int32), stopped=jnp.zeros((b,), bool),
                         eos=jnp.zeros((b,), bool), pattern=jnp.full((b,), -1, jnp.int32),
                         steps=jnp.zeros((), jnp.int32))
        carry = _Carry(state._replace(cache=None), out)
        for j, slots in enumerate(windows):
            # the last stage runs to the budget; an earlier one while its slots have room
            end = r if j == len(windows) - 1 else jnp.minimum(slots - full.index, r)
            carry = carry._replace(state=carry.state._replace(cache=_grown(full, carry.state.cache, slots)))
            carry = jax.lax.while_loop(functools.partial(self._running, end=jnp.minimum(end, limit), min_idle=min_idle),
                                       functools.partial(self._step, params, eos_ids, tables, key), carry)
        return carry.out, carry.state._replace(cache=_grown(full, carry.state.cache, full.capacity))

    @staticmethod
    def _running(c: _Carry, end, min_idle):
        live = c.state.live
        return (c.out.steps < end) & jnp.any(live) & (jnp.sum(~live) < min_idle)

    def _draw(self, logits, key, episode, drawn):
        """(tokens int32[B], logp float32[B]) from logits float32[B, V]: greedy at once,
        a draw from each row's episode stream otherwise."""
        policy = self.module.policy
        if self.sampler.greedy:
            return self.sampler(logits, key, policy)  # the key is not used
        one = lambda lg, k: tuple(x[0] for x in self.sampler(lg[None], k, policy))  # noqa: E731
        return jax.vmap(one)(logits, episode_keys(key, episode, drawn))

    def _step(self, params, eos_ids, tables, key, c: _Carry) -> _Carry:
        """One token for every live row: sampled, recorded, through the stop tests, and
        written (rows still decoding) with their next logits."""
        s, o = c.state, c.out
        tok, lp = self._draw(s.logits, key, s.episode, s.drawn)
        live = s.live
        tokens = o.tokens.at[:, o.steps].set(jnp.where(live, tok, 0))
        logp = o.logp.at[:, o.steps].set(jnp.where(live, lp, 0.0))
        is_eos, fired, dfa = stop_check(tok, live, s.dfa, eos_ids, tables, s.enabled)
        stop_now = is_eos | (fired >= 0)
        count = s.count + live
        writes = live & ~stop_now  # the row conditions on its token (a stopped row's stays pending)
        step_logits, cache = self.module.apply({"params": params}, tok[:, None], writes[:, None], s.cache)
        state = s._replace(cache=cache, logits=jnp.where(writes[:, None], step_logits[:, 0], s.logits),
                           live=writes & (count < self.max_steps), count=count,
                           dfa=jnp.where(live[:, None], dfa, s.dfa), drawn=s.drawn + live)
        out = SegmentOut(tokens, logp, o.length + live, o.stopped | stop_now, o.eos | is_eos,
                         jnp.where(fired >= 0, fired, o.pattern), o.steps + 1)
        return _Carry(state, out)
