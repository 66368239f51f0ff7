"""The episode loop: the one place where device generation and host tools alternate.

    prefill(prompts) -> [decode segment (device) -> parse actions, call tools,
    tokenize observations (host) -> prefill(pending token + observation)] x turns

The KV cache lives across the whole episode: after a tool call only the new tokens
(the row's pending last token and its observation) are prefilled; the history is never
re-read. Every sampled token keeps its exact id and sampling log-prob; observation and
prompt tokens get loss-mask 0.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from car_jax import hosts
from car_jax.rollout.decode import decode_segment, prefill
from car_jax.rollout.generate import (
    decode_windows,
    eos_ids,
    left_pad,
    prefill_prompts,
    prompt_texts,
    round_up,
)
from car_jax.rollout.protocols import ANSWER, VOID, Action, SearchR1
from car_jax.rollout.sampling import Sampler
from car_jax.rollout.stops import stop_tables
from car_jax.rollout.tool_calls import Tool, run_tools

@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    """The settings of a batch of episodes, for training rollouts and evaluation alike (the
    YAML section `rollout` of `car-jax train`, `episode` of `car-jax eval`). The sampler's
    settings are plain fields, so a YAML section stays flat; `sampler` builds the Sampler."""
    max_turns: int = 4  # tool-using turns; then one answer-only turn
    max_response_tokens: int = 500  # sampled tokens per turn
    max_obs_tokens: int = 500  # observation tokens per turn (truncated beyond)
    tool_timeout_s: float = 60.0  # per batched tool call
    temperature: float = 1.0  # 0: greedy
    top_p: float = 0.95
    top_k: int = 0  # 0: off

    def __post_init__(self):
        for f in ("max_response_tokens", "max_obs_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"EpisodeConfig.{f}={getattr(self, f)} must be >= 1")
        if self.max_turns < 0:
            raise ValueError(f"EpisodeConfig.max_turns={self.max_turns} must be >= 0")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"EpisodeConfig.tool_timeout_s={self.tool_timeout_s} must be > 0 (seconds)")
        _ = self.sampler  # Sampler checks temperature, top_p and top_k

    @property
    def sampler(self) -> Sampler:
        return Sampler(self.temperature, self.top_p, self.top_k)

    @property
    def max_response_length(self) -> int:
        """The most response tokens (sampled and observation) one episode can hold: every
        turn's sampling budget plus every tool turn's observation budget. A constant of the
        config, e.g. Dr.GRPO's loss horizon (`seq-mean-token-sum-norm`)."""
        return (self.max_turns + 1) * self.max_response_tokens + self.max_turns * self.max_obs_tokens

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the recorded log-probs (1 for greedy decoding, as
        `Sampler.policy_logprobs`): the one the train step's log-probs must use."""
        return self.temperature or 1.0


def _ids(x) -> np.ndarray:
    return np.asarray(x, np.int32).reshape(-1)


@dataclasses.dataclass
class Trajectory:
    """One episode on the host, as numpy arrays: prompt_ids int32[P]; response_ids int32[R]
    (sampled and observation tokens), logprobs float32[R] (the sampler's, 0 on
    observations), loss_mask bool[R] (True: sampled by the model). Lists given to the
    constructor are converted."""
    prompt_ids: np.ndarray
    response_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    loss_mask: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))
    n_turns: int = 0  # segments generated
    n_tool_calls: int = 0
    tool_log: list[dict] = dataclasses.field(default_factory=list)
    observations: list[str] = dataclasses.field(default_factory=list)  # each tool turn's observation, before truncation
    text: str = ""  # the response decoded (sampled and observation tokens)
    # the response as (text, written by the model) pieces, one per run of sampled or of
    # observation tokens: what the reward parses (answers and confidences are read from
    # the model's own pieces only, never from a tool's)
    pieces: list[tuple[str, bool]] = dataclasses.field(default_factory=list)
    answered: bool = False  # ended with an answer action (or EOS in the last turn)
    void_turns: int = 0  # TIR turns with neither code nor answer

    def __post_init__(self):
        self.prompt_ids, self.response_ids = _ids(self.prompt_ids), _ids(self.response_ids)
        self.logprobs = np.asarray(self.logprobs, np.float32).reshape(-1)
        self.loss_mask = np.asarray(self.loss_mask, bool).reshape(-1)
        if not len(self.response_ids) == len(self.logprobs) == len(self.loss_mask):
            raise ValueError(f"response_ids, logprobs and loss_mask differ in length: {len(self.response_ids)}, "
                             f"{len(self.logprobs)}, {len(self.loss_mask)}")

    def spans(self) -> list[tuple[int, int, bool]]:
        """(start, end, sampled) of each maximal run of sampled / observation tokens."""
        edges = np.flatnonzero(np.diff(self.loss_mask.astype(np.int8))) + 1
        bounds = [0, *edges.tolist(), len(self.loss_mask)]
        return [(a, b, bool(self.loss_mask[a])) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def decode_pieces(self, tokenizer) -> list[tuple[str, bool]]:
        """The response decoded run by run (special tokens skipped): (text, by the model)."""
        return [(tokenizer.decode(self.response_ids[a:b], skip_special_tokens=True), sampled)
                for a, b, sampled in self.spans()]

    def add(self, ids, logps=None, sampled: bool = True):
        """Appends a segment: sampled tokens with their log-probs, or (sampled=False) an
        observation (log-prob 0, loss mask False)."""
        ids = _ids(ids)
        logps = np.asarray(logps, np.float32).reshape(-1) if sampled else np.zeros(len(ids), np.float32)
        self.response_ids = np.concatenate([self.response_ids, ids])
        self.logprobs = np.concatenate([self.logprobs, logps])
        self.loss_mask = np.concatenate([self.loss_mask, np.full(len(ids), sampled, bool)])


@dataclasses.dataclass
class EpisodeStats:
    seconds_device: float = 0.0
    seconds_tools: float = 0.0
    prefilled_tokens: int = 0  # tokens written by prefills (prompt + pending + observations)
    sampled_tokens: int = 0


def run_episodes(model, tokenizer, prompts: Sequence, tools: dict[str, Tool], *,
                 config: EpisodeConfig = EpisodeConfig(), protocol=SearchR1(), seed: int = 0,
                 stats: EpisodeStats | None = None) -> list[Trajectory]:
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
        out, cache = decode_segment(model.module, config.sampler, config.max_response_tokens, model.params,
                                    cache, logits, hosts.to_global(active, model.mesh),
                                    eos, final_tables if final else tables, sub, windows=windows)
        out = jax.tree.map(lambda x: hosts.fetch_local(x, model.mesh), out)  # this process's rows
        stats.seconds_device += time.perf_counter() - t0

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


def observation_ids(tokenizer, parts: tuple[str, str, str], budget: int) -> list[int]:
    """Token ids of the observation head + body + tail, at most `budget` of them: when
    the whole does not fit, the body (the tool's result) is cut and the wrapper kept, so
    `</information>` is never lost to a long result (if the wrapper alone exceeds the
    budget, the whole is cut at it)."""
    text = "".join(parts)
    if not text:
        return []
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= budget:
        return ids
    head, body, tail = (tokenizer(p, add_special_tokens=False)["input_ids"] if p else [] for p in parts)
    room = budget - len(head) - len(tail)
    return head + body[:room] + tail if room >= 0 else ids[:budget]
