"""The episode engine: continuous batching of episodes through a fixed number of slots.

    waiting episodes --refill--> slots (rows of one KV cache)
        [device] prefill prompts / pending token + observation (`prefill.py`), decode the
                 live slots (`decode.DecodeLoop.run`), pack or move cache rows (`slots.py`)
        [host]   parse each ended segment: answer -> the slot frees up for the next
                 waiting episode; tool call -> a tool job in a thread pool, which runs
                 while the device keeps decoding the other slots

At most `max_concurrent` episodes are in flight, so the KV caches hold max_concurrent rows
of capacity slots (one episode's worth plus one prefill or decode call of slack),
whatever the step's episode count. While episodes wait for a row, `park_slots` of those
rows are a *park* (`schedule.py`): an episode waiting for its tool moves its cache row
there and its decode row takes another episode, so a tool wait does not idle a decode
row. In the tail (no episode waits, every process's episodes fit in half the decode
rows) the decode rows are halved, as often as they fit, down to an eighth, so the last
episodes do not decode beside empty rows (the narrower cache is allocated before the
wider one is freed: at most 1.5 x the rows for a moment). A round of the loop: collect
finished tool jobs (their rows get observation chunks); unpark episodes whose
observation is back into free decode rows, then park episodes waiting for a tool (in the
park rows just left too), and refill free rows from the waiting episodes; narrow in the
tail; prefill; then one decode call that returns when every live slot has stopped or,
while episodes wait for a slot or a tool job is out, once `REFILL` of the slots are idle,
or when a tool result that a row waits for is due (`schedule.Clock`: the running mean of
a tool job's time over the running mean of a decode step's), so that row does not idle
to the end of the call. Where a call ends does not change an episode's tokens. Every
call into the device is made by every process in the same order; what the host knows
only locally (rows to prefill, live rows, waiting episodes, tool jobs out, steps until
a result is due) is agreed in one `hosts.allgather` a round (`schedule.Round`).

With several processes each owns a contiguous block of the slots (rows over fsdp, as
`hosts.local_rows`) and refills them from its own episodes; its episode i is the step's
episode offset + i, which seeds its RNG stream (`decode.episode_keys`), so tokens do not
depend on slots, waves or processes.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from car_jax import hosts
from car_jax.models.cache import KVCache
from car_jax.rollout.decode import DecodeLoop, DecodeState, SegmentOut
from car_jax.rollout.generate import BUCKET, decode_windows, eos_ids, left_pad, length_bucket, prompt_texts, round_up
from car_jax.rollout.prefill import prefill_distinct, prefill_rows
from car_jax.rollout.protocols import ANSWER, VOID, Action
from car_jax.rollout.schedule import Clock, Round, Rows, pad_moves, split_rows
from car_jax.rollout.slots import compact, move_rows
from car_jax.rollout.stops import stop_tables
from car_jax.rollout.tool_calls import Tool, run_tools
from car_jax.rollout.trajectory import EpisodeStats, Trajectory, observation_ids

REFILL = 1 / 8  # a decode call returns early for a refill once this share of the slots is idle


def slot_count(max_concurrent: int, episodes: int, mesh) -> int:
    """Slots of all processes together: max_concurrent (0: every episode), at most the
    episode count, rounded up to a multiple of the mesh's fsdp (rows split over it)."""
    n = min(max_concurrent or episodes, episodes)
    split = 1 if mesh is None else mesh.shape["fsdp"]
    return round_up(max(n, 1), split)


def capacity(prompt_width: int, config) -> int:
    """Cache slots S per row: one episode's most tokens (prompt, every turn's budget, every
    observation chunk) plus the widest single write (a prompt, a chunk or a decode call),
    so that a compacted cache always has room for the next one."""
    chunk = round_up(1 + config.max_obs_tokens)
    episode = (prompt_width + (config.max_turns + 1) * config.max_response_tokens + config.max_turns * chunk)
    return episode + max(prompt_width, chunk, config.max_response_tokens)


class Engine:
    """One rollout's episodes (this process's) through the slots; `run()` returns their
    trajectories in order. See the module doc."""

    def __init__(self, model, tokenizer, prompts, tools: dict[str, Tool], config, protocol, seed: int,
                 stats: EpisodeStats):
        self.model, self.tok, self.tools, self.cfg, self.protocol, self.stats = (
            model, tokenizer, tools, config, protocol, stats)
        self.mesh = model.mesh
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts(tokenizer, prompts)]
        self.trajs = [Trajectory(p) for p in ids]
        n = len(ids)
        self.offset = hosts.local_rows(n * hosts.count(), self.mesh).start  # this process's first episode
        kv_rows = slot_count(config.max_concurrent, n * hosts.count(), self.mesh)
        self.fsdp = 1 if self.mesh is None else self.mesh.shape["fsdp"]  # rows split over this many devices
        self.n_slots, n_park = split_rows(kv_rows, config.park_slots, n * hosts.count(), self.fsdp)
        self.decode_rows = self._local_count(self.n_slots)
        self.park_rows = self._local_count(n_park)
        self.min_rows = max(1, self.decode_rows // 8)  # the tail narrows the decode rows down to an eighth
        self.pad = tokenizer.pad_token_id or 0
        # the prompt width in coarse buckets (16, 24, 32, 48, 64, ..., 256, 384, ...): it sets
        # the cache capacity, and every program that reads the cache compiles per capacity,
        # so the steps of a run (and the batches of an evaluation) share their programs
        self.prompt_width = length_bucket(hosts.global_max(max(len(p) for p in ids)), BUCKET)
        self.capacity = capacity(self.prompt_width, config)
        self.eos = jnp.asarray(eos_ids(model, tokenizer))
        stops, final = list(protocol.stops), list(protocol.final_stops)
        self.tables = jnp.asarray(stop_tables(tokenizer, stops + final))
        self.turn_stops = np.array([True] * len(stops) + [False] * len(final))
        self.slots = Rows(self.decode_rows, self.park_rows, len(self.turn_stops))
        self.ready: dict[int, list[int]] = {}  # parked episode -> its chunk (observation back)
        self.clock = Clock()  # step and tool-job times: a decode call ends when a waited-for result is due
        self.key = jax.random.key(seed)
        self.waiting = collections.deque(range(n))
        self.jobs: dict[cf.Future, dict[int, tuple[Action, list[int]]]] = {}
        self.chunks: dict[int, list[int]] = {}  # slot -> pending token + observation to prefill
        stats.slots = kv_rows
        stats.decode_slots, stats.park_slots = self.n_slots, n_park
        stats.capacity = self.capacity

    # -- helpers ----------------------------------------------------------------------
    def _local_count(self, rows: int) -> int:
        """This process's share of `rows` rows split over fsdp (0 of none)."""
        if not rows:
            return 0
        mine = hosts.local_rows(rows, self.mesh)
        return mine.stop - mine.start

    def _global(self, x) -> jax.Array:
        return hosts.to_global(np.asarray(x), self.mesh)

    def _local(self, x) -> np.ndarray:
        return hosts.fetch_local(x, self.mesh)

    def _stops_for(self, e: int) -> np.ndarray:
        """The automata of episode e's next segment: the answer-only ones in its last turn."""
        final = self.trajs[e].n_turns == self.cfg.max_turns
        return ~self.turn_stops if final else self.turn_stops

    def _room(self, cache, width: int):
        """The cache, compacted first if `width` more slots would overflow it."""
        if int(cache.index) + width > self.capacity:
            cache = compact(cache)
            self.stats.compactions += 1
        return cache

    # -- device -----------------------------------------------------------------------
    def _distinct_prompts(self, rows: list[int]) -> dict[tuple[int, ...], int]:
        """The distinct prompts of the episodes in decode rows `rows` -> their order."""
        distinct: dict[tuple[int, ...], int] = {}
        for r in rows:
            distinct.setdefault(tuple(self.trajs[self.slots.episode[r]].prompt_ids.tolist()), len(distinct))
        return distinct

    def _prefill_prompts(self, cache, logits, rows: list[int], most: int):
        """Fresh prompts into decode rows `rows`: each distinct prompt (a GRPO group's) runs
        once, on a small cache of u rows a process (`most`: the most distinct prompts of any
        process, bucketed and split over fsdp, so few shapes compile and every process
        makes the same call), and is copied into its rows; the other rows are not run."""
        distinct = self._distinct_prompts(rows)
        inverse = np.full(self.decode_rows, -1, np.int32)
        for r in rows:
            inverse[r] = distinct[tuple(self.trajs[self.slots.episode[r]].prompt_ids.tolist())]
        split = self.fsdp // math.gcd(self.fsdp, hosts.count())  # u x processes splits over fsdp
        u = min(self.decode_rows, round_up(1 << (most - 1).bit_length(), split))
        first = hosts.local_rows(u * hosts.count(), self.mesh).start if self.mesh is not None else 0
        inverse = np.where(inverse >= 0, inverse + first, -1).astype(np.int32)
        tokens, valid = left_pad(list(distinct) + [[]] * (u - len(distinct)), self.prompt_width, self.pad)
        cache = self._room(cache, self.prompt_width)
        logits, cache = prefill_distinct(self.model.module, params=self.model.params, cache=cache, logits=logits,
                                         tokens=self._global(tokens), valid=self._global(valid),
                                         inverse=self._global(inverse))
        self.stats.prefilled_tokens += sum(len(self.trajs[self.slots.episode[r]].prompt_ids) for r in rows)
        return cache, logits

    def _prefill_chunks(self, cache, logits, width: int):
        per_row = [self.chunks.get(r, []) for r in range(self.decode_rows)]
        tokens, valid = left_pad(per_row, width, self.pad)
        cache = self._room(cache, width)
        logits, cache = prefill_rows(self.model.module, self.model.params, cache, logits, self._global(tokens),
                                     self._global(valid))
        self.stats.prefilled_tokens += int(valid.sum())
        self.chunks = {}
        return cache, logits

    def _decode(self, cache: KVCache, logits, min_idle: int,
                limit: int) -> tuple[SegmentOut, np.ndarray, KVCache, jax.Array]:
        """One decode call over the slots. It attends over one window, the cache's first
        slots up to the bucket that holds index + max_response_tokens: a call is at most a
        segment long and the index of mixed slots is rarely small, so staged windows would
        save little and cost one compile each. Returns (this process's rows of the call's
        output, as numpy; their automata's states int32[b, A] after it; cache; logits)."""
        r_max = self.cfg.max_response_tokens
        cache = self._room(cache, r_max)
        s = self.slots
        episode = np.where(s.episode >= 0, s.episode + self.offset, 0).astype(np.int32)
        loop = DecodeLoop(module=self.model.module, sampler=self.cfg.sampler, max_steps=r_max,
                          windows=decode_windows(int(cache.index), r_max, cache.capacity, stages=1))
        t0 = time.perf_counter()
        state = DecodeState(cache=cache, logits=logits, live=self._global(s.live), count=self._global(s.count),
                            dfa=self._global(s.dfa), enabled=self._global(s.enabled), episode=self._global(episode),
                            drawn=self._global(s.drawn))
        out, state = loop.run(params=self.model.params, state=state, eos_ids=self.eos, tables=self.tables,
                              key=self.key, min_idle=np.int32(min_idle), limit=np.int32(limit))
        out = out._replace(**{f: self._local(getattr(out, f)) for f in out._fields if f != "steps"})
        steps = int(out.steps)
        self.clock.decoded(time.perf_counter() - t0, steps)
        free = int((s.episode < 0).sum())
        st = self.stats
        st.idle_refill += free * steps if self.waiting else 0
        st.idle_tail += 0 if self.waiting else free * steps
        st.idle_tool += int(((s.episode >= 0) & ~s.live).sum()) * steps
        st.idle_stopped += int((steps - out.length[s.live]).sum())
        self.stats.decode_steps += steps
        self.stats.slot_steps += self.n_slots * steps
        self.stats.waiting_steps += len(self.waiting) * steps
        return out, self._local(state.dfa), state.cache, state.logits

    # -- host -------------------------------------------------------------------------
    def _take_output(self, out: SegmentOut, dfa: np.ndarray) -> dict[int, tuple[Action, list[int]]]:
        """Each live slot's new tokens (out: this process's rows of a decode call, numpy;
        dfa int32[b, A] their automata's states after it); ended segments are parsed: the
        episode ends, or its action is returned. Returns {episode: (action, pending tokens:
        the stopped segment's last token, or none)}."""
        s, r_max = self.slots, self.cfg.max_response_tokens
        actions = {}
        for r in np.flatnonzero(s.live):
            n = int(out.length[r])
            s.tokens[r].extend(out.tokens[r, :n].tolist())
            s.logps[r].extend(out.logp[r, :n].tolist())
            s.count[r] += n
            s.drawn[r] += n
            s.dfa[r] = dfa[r]
            if not (out.stopped[r] or s.count[r] >= r_max):
                continue
            s.live[r] = False
            e = int(s.episode[r])
            traj = self.trajs[e]
            final = traj.n_turns == self.cfg.max_turns
            traj.add(s.tokens[r], s.logps[r])
            traj.n_turns += 1
            self.stats.sampled_tokens += len(s.tokens[r])
            action = self.protocol.parse(self.tok.decode(s.tokens[r], skip_special_tokens=True))
            traj.void_turns += action.kind == VOID
            # Search-R1: only an answer (or the last turn) ends an episode; an invalid
            # action is answered with a message even after EOS. A void TIR turn that
            # ended in EOS has nothing left to do.
            if action.kind == ANSWER or final or (action.kind == VOID and out.eos[r]):
                traj.answered = action.kind == ANSWER
                s.episode[r] = -1
                continue
            actions[e] = (action, [s.tokens[r][-1]] if out.stopped[r] else [])
        return actions

    def _tool_job(self, actions: dict[int, tuple[Action, list[int]]]):
        """Runs in the pool: the tools of one decode call's ended segments (one batched call
        per tool kind, `run_tools`). Returns (results {episode: text}, seconds)."""
        t0 = time.perf_counter()
        results = run_tools({e: a for e, (a, _) in actions.items()}, self.tools, self.cfg.tool_timeout_s,
                            self.trajs)
        return results, time.perf_counter() - t0

    def _submit(self, pool: cf.ThreadPoolExecutor, actions) -> None:
        if not actions:
            return
        if any(a.kind in self.tools for a, _ in actions.values()):
            job = pool.submit(self._tool_job, actions)
            self.jobs[job], self.clock.started[job] = actions, time.perf_counter()
        else:  # no tool to call (invalid / void actions): the observation is known now
            self._observe(actions, *self._tool_job(actions))

    def _observe(self, actions, results: dict[int, str], seconds: float) -> None:
        """A finished tool job's observations: appended to their trajectories, and queued
        as chunks (pending token + observation) for their rows' next prefill (a parked
        episode's once it has a decode row again)."""
        self.stats.seconds_tools += seconds
        s = self.slots
        for e, (action, pending) in actions.items():
            traj = self.trajs[e]
            parts = self.protocol.wrap(action, results.get(e, ""))
            obs = observation_ids(self.tok, parts, self.cfg.max_obs_tokens)
            traj.add(obs, sampled=False)
            traj.observations.append("".join(parts))
            chunk = pending + obs
            # TIR: the program printed the boxed answer (and it fit the budget)
            if self.protocol.ends_episode(self.tok.decode(obs, skip_special_tokens=True)):
                traj.answered = True
                chunk = []
            rows = np.flatnonzero(s.episode == e)
            if not len(rows):  # parked
                if chunk:
                    self.ready[e] = chunk
                else:
                    s.parked[s.parked == e] = -1
                continue
            r = int(rows[0])
            if not chunk:  # answered, or a void turn cut by the budget: nothing to condition on
                s.episode[r] = -1
                continue
            self.chunks[r] = chunk
            s.start_segment(r, self._stops_for(e))

    def _collect(self, block: bool) -> None:
        """Observations of the tool jobs that have finished (block: wait for one first)."""
        if block and self.jobs:
            t0 = time.perf_counter()
            cf.wait(list(self.jobs), return_when=cf.FIRST_COMPLETED)
            self.stats.seconds_tool_wait += time.perf_counter() - t0
        for future in [f for f in self.jobs if f.done()]:
            results, seconds = future.result()
            self.clock.finished(future, seconds)
            self._observe(self.jobs.pop(future), results, seconds)

    def _schedule(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
        """The round's moves on the host, in the order the device makes them: parked
        episodes whose observation is back take free decode rows (their chunk queued);
        then decode rows whose episode waits for a tool are parked (in the park rows just
        left too) while others want a decode row; free decode rows take the next waiting
        episodes. Returns (unpark moves, park moves, refilled rows)."""
        s = self.slots
        unparked = s.unpark(list(self.ready))
        for _, r in unparked:
            e = int(s.episode[r])
            self.chunks[r] = self.ready.pop(e)
            s.start_segment(r, self._stops_for(e))
        want = len(self.ready) + len(self.waiting) - int((s.episode < 0).sum())
        tool_out = [r for r in np.flatnonzero((s.episode >= 0) & ~s.live).tolist() if r not in self.chunks]
        parked = s.park(tool_out[:max(want, 0)])
        rows = []
        for r in np.flatnonzero(s.episode < 0):
            if not self.waiting:
                break
            e = self.waiting.popleft()
            s.episode[r], s.drawn[r] = e, 0
            s.start_segment(int(r), self._stops_for(e))
            rows.append(int(r))
        return unparked, parked, rows

    def _due_jobs(self) -> list[cf.Future]:
        """Tool jobs out whose result a decode row waits for: one of their episodes holds
        its decode row, or is parked while a decode row is free."""
        s = self.slots
        held, free = set(s.episode[s.episode >= 0].tolist()), bool((s.episode < 0).any())
        return [j for j, actions in self.jobs.items() if free or not held.isdisjoint(actions)]

    def _move(self, moves, src: KVCache, src_logits, dst: KVCache, dst_logits, n: int):
        """Moves (local src row, local dst row) of every process in one call, padded to n
        moves a process (this process's rows offset by its first row of each cache)."""
        a, b = pad_moves(moves, n, hosts.local_rows(src.batch_size, self.mesh).start,
                         hosts.local_rows(dst.batch_size, self.mesh).start)
        return move_rows(src, src_logits, dst, dst_logits, self._global(a), self._global(b))

    def _width(self, waiting: int, in_flight: int) -> int:
        """The decode rows for this round: b halved (down to an eighth of the first b) while
        no episode waits and every process's episodes in flight (parked ones included)
        fit in half, the halves still splitting over fsdp."""
        b = self.decode_rows
        while (not waiting and b // 2 >= self.min_rows and in_flight <= b // 2
               and (b // 2 * hosts.count()) % self.fsdp == 0):
            b //= 2
        return b

    def _narrowed(self, cache, logits, b: int, new: list[int]):
        """The tail's narrower decode rows: the held rows packed into a new cache of b rows
        (their queued chunks and the rows just refilled, `new`, follow them). Returns
        (cache, logits, new)."""
        self.slots, held = self.slots.narrowed(b)
        self.chunks = {held.index(r): c for r, c in self.chunks.items()}
        rows = b * hosts.count()
        narrow = self.model.init_cache(rows, self.capacity)
        narrow_logits = self._global(np.zeros((b, self.model.config.vocab_size), np.float32))
        narrow, narrow_logits = self._move(list(zip(held, range(len(held)))), cache, logits, narrow, narrow_logits,
                                           self.decode_rows)
        self.decode_rows, self.n_slots = b, rows
        self.stats.narrowings += 1
        return narrow, narrow_logits, [held.index(r) for r in new]

    def run(self) -> list[Trajectory]:
        stats = self.stats
        cache = self.model.init_cache(self.n_slots, self.capacity)
        park = self.model.init_cache(stats.park_slots, self.capacity) if self.park_rows else None
        logits = self._global(np.zeros((self.decode_rows, self.model.config.vocab_size), np.float32))
        with cf.ThreadPoolExecutor(self.cfg.tool_workers, thread_name_prefix="tools") as pool:
            while True:
                self._collect(block=False)
                unparked, parked, new = self._schedule()
                longest = max((len(c) for c in self.chunks.values()), default=0)
                r_max = self.cfg.max_response_tokens
                limit = self.clock.steps_until(self._due_jobs(), time.perf_counter(), max(1, r_max // 8), r_max)
                agreed = Round(new=len(new), longest=longest, live=int(self.slots.live.sum()),
                               waiting=len(self.waiting), jobs=len(self.jobs), unparked=len(unparked),
                               parked=len(parked), in_flight=self.slots.in_flight(), limit=limit,
                               distinct=len(self._distinct_prompts(new))).agreed()
                t0 = time.perf_counter()
                # unpark first: the park rows it leaves take this round's parked episodes
                if agreed.unparked:
                    cache, _ = self._move(unparked, park, None, cache, None, self.park_rows)
                if agreed.parked:
                    park, _ = self._move(parked, cache, None, park, None, self.park_rows)
                    stats.parkings += agreed.parked
                b = self._width(agreed.waiting, agreed.in_flight)
                if b < self.decode_rows:
                    cache, logits, new = self._narrowed(cache, logits, b, new)
                if agreed.new:
                    cache, logits = self._prefill_prompts(cache, logits, new, agreed.distinct)
                if agreed.longest:
                    cache, logits = self._prefill_chunks(cache, logits, round_up(agreed.longest))
                if agreed.live:
                    idle = self.n_slots - agreed.live
                    refill = max(1, int(self.n_slots * REFILL))
                    min_idle = idle + refill if agreed.waiting + agreed.jobs else self.n_slots + 1
                    out, dfa, cache, logits = self._decode(cache, logits, min_idle, agreed.limit)
                    stats.seconds_device += time.perf_counter() - t0
                    self._submit(pool, self._take_output(out, dfa))
                elif agreed.jobs:
                    stats.seconds_device += time.perf_counter() - t0
                    self._collect(block=True)
                else:
                    break
        for traj in self.trajs:
            traj.text = self.tok.decode(traj.response_ids, skip_special_tokens=True)
            traj.pieces = traj.decode_pieces(self.tok)
        return self.trajs
