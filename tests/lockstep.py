"""The lockstep episode runner: every episode at once, turn by turn, each turn one segment
of the decode loop (`DecodeLoop.segment`, a turn's key for the batch). The episode loop
before the engine (`car_jax/rollout/engine.py`), kept beside the tests as the reference
the engine is tested against (tests/test_engine.py: greedy episodes are the same) and
measured against (`benchmarks/rollout_engine.py`). Training and eval run the engine
(`episode.run_episodes`); nothing in the package imports this file.

    prefill(prompts) -> [decode segment (device) -> parse actions, call tools,
    tokenize observations (host) -> prefill(pending token + observation)] x turns

Every row's cache is allocated at once (episodes x one episode's slots), and a turn waits
for its slowest row and for every tool call.
"""
from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from car_jax import hosts
from car_jax.rollout.decode import DecodeLoop
from car_jax.rollout.generate import decode_windows, eos_ids, left_pad, prefill_prompts, prompt_texts, round_up
from car_jax.rollout.prefill import prefill
from car_jax.rollout.protocols import ANSWER, VOID, Action, SearchR1
from car_jax.rollout.stops import stop_tables
from car_jax.rollout.tool_calls import Tool, run_tools
from car_jax.rollout.trajectory import EpisodeStats, Trajectory, observation_ids


def run_lockstep(model, tokenizer, prompts: Sequence, tools: dict[str, Tool], *, config,
                 protocol=SearchR1(), seed: int = 0, stats: EpisodeStats | None = None) -> list[Trajectory]:
    """Runs one episode per prompt (a string or chat messages; repeat a prompt G times
    for a GRPO group). `tools` maps an action kind ("search", "code") to a batched tool.
    Returns one Trajectory per prompt.

    With several processes every process calls this with its own rows (as many in each:
    `hosts.local_rows` of the step's rows), runs the tools for those only, and the device
    work runs on all rows at once; the loop's decisions (another turn, a prefill's width)
    are agreed between the processes."""
    stats = stats if stats is not None else EpisodeStats()
    texts = prompt_texts(tokenizer, prompts)
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    trajs = [Trajectory(p) for p in prompt_ids]
    b = len(trajs)
    stats.slots = stats.decode_slots = b * hosts.count()
    pad = tokenizer.pad_token_id or 0
    chunk_width = round_up(1 + config.max_obs_tokens)
    after_prompt = (config.max_turns + 1) * config.max_response_tokens + config.max_turns * chunk_width
    eos = jnp.asarray(eos_ids(model, tokenizer))
    tables = jnp.asarray(stop_tables(tokenizer, protocol.stops))
    final_tables = jnp.asarray(stop_tables(tokenizer, protocol.final_stops))
    key = jax.random.key(seed)

    t0 = time.perf_counter()
    logits, cache, n_prefilled = prefill_prompts(model, prompt_ids, after_prompt, pad)  # a group's prompt runs once
    stats.prefilled_tokens += n_prefilled
    active = np.ones(b, bool)
    for turn in range(config.max_turns + 1):
        final = turn == config.max_turns
        key, sub = jax.random.split(key)
        # attend over the slots this turn can reach, not the whole episode's cache
        windows = decode_windows(int(cache.index), config.max_response_tokens, cache.capacity)
        loop = DecodeLoop(module=model.module, sampler=config.sampler, max_steps=config.max_response_tokens,
                          windows=windows)
        out, cache = loop.segment(params=model.params, cache=cache, logits=logits,
                                  live=hosts.to_global(active, model.mesh), eos_ids=eos,
                                  tables=final_tables if final else tables, key=sub)
        out = out._replace(**{f: hosts.fetch_local(getattr(out, f), model.mesh)  # this process's rows
                              for f in out._fields if f != "steps"})
        stats.seconds_device += time.perf_counter() - t0
        steps = hosts.global_max(int(out.length.max()))  # the loop ran to the longest row
        stats.decode_steps += steps
        stats.slot_steps += stats.slots * steps

        actions: dict[int, Action] = {}
        for i in np.flatnonzero(active):
            n = int(out.length[i])
            trajs[i].add(out.tokens[i, :n], out.logp[i, :n])
            trajs[i].n_turns += 1
            stats.sampled_tokens += n
            action = protocol.parse(tokenizer.decode(out.tokens[i, :n], skip_special_tokens=True))
            trajs[i].void_turns += action.kind == VOID
            # Search-R1: only an answer (or the last turn) ends an episode; an invalid
            # action is answered with a message even after EOS. A void TIR turn that
            # ended in EOS has nothing left to do.
            if action.kind == ANSWER or final or (action.kind == VOID and out.eos[i]):
                trajs[i].answered = action.kind == ANSWER
                active[i] = False
                continue
            actions[int(i)] = action
        if not hosts.global_max(int(active.any())):  # every process's rows have ended
            break

        t1 = time.perf_counter()
        results = run_tools(actions, tools, config.tool_timeout_s, trajs)
        stats.seconds_tools += time.perf_counter() - t1

        t0 = time.perf_counter()
        chunks = [[] for _ in range(b)]
        for i, action in actions.items():
            parts = protocol.wrap(action, results.get(i, ""))
            obs_ids = observation_ids(tokenizer, parts, config.max_obs_tokens)
            pending = [int(out.tokens[i, out.length[i] - 1])] if out.stopped[i] else []
            trajs[i].add(obs_ids, sampled=False)
            trajs[i].observations.append("".join(parts))
            chunks[i] = pending + obs_ids
            # TIR: the program printed the boxed answer (and it fit the budget)
            if protocol.ends_episode(tokenizer.decode(obs_ids, skip_special_tokens=True)):
                trajs[i].answered = True
                active[i] = False
            if not chunks[i]:  # a void turn cut by the budget: nothing new to condition on
                active[i] = False
            if not active[i]:
                chunks[i] = []
        if not hosts.global_max(int(active.any())):
            break
        # pad to the longest new chunk of this turn (of any process; bucketed), not to the budget
        tokens, valid = left_pad(chunks, round_up(hosts.global_max(max(len(c) for c in chunks))), pad)
        logits, cache = prefill(model.module, model.params, cache, hosts.to_global(tokens, model.mesh),
                                hosts.to_global(valid, model.mesh))
        stats.prefilled_tokens += int(valid.sum())
    for traj in trajs:
        traj.text = tokenizer.decode(traj.response_ids, skip_special_tokens=True)
        traj.pieces = traj.decode_pieces(tokenizer)
    return trajs
