"""Episodes: their settings (`EpisodeConfig`) and the one call that runs them
(`run_episodes`), the one place where device generation and host tools alternate:

    prefill(prompt) -> [decode segment (device) -> parse the action, call the tool,
    tokenize the observation (host) -> prefill(pending token + observation)] x turns

Episodes run in the engine (`engine.py`): at most `max_concurrent` of them at once in
slots of one KV cache, a free slot taking the next waiting episode, tools running while
the other slots decode. The KV cache lives across the whole episode: after a tool call
only the new tokens (the pending last token and the observation) are prefilled; the
history is never re-read. Every sampled token keeps its exact id and sampling log-prob;
observation and prompt tokens get loss-mask 0. Each episode draws from its own RNG stream
(the seed and its index), so its tokens do not depend on which slot or wave it ran in.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from car_jax.config import require
from car_jax.rollout.engine import Engine
from car_jax.rollout.protocols import SearchR1
from car_jax.rollout.sampling import Sampler
from car_jax.rollout.tool_calls import Tool
from car_jax.rollout.trajectory import EpisodeStats, Trajectory, observation_ids

MAX_TOKENS = 1_000_000  # a turn's token budgets: beyond any model's context
MAX_TURNS = 1_000  # so an episode's response, (turns + 1) x 10^6 + turns x 10^6 tokens, fits int32
MAX_TIMEOUT_S = 86_400.0  # one day: a tool call's time limit


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    """The settings of a batch of episodes, for training rollouts and evaluation alike (the
    YAML section `rollout` of `car-jax train`, `episode` of `car-jax eval`). The sampler's
    settings are plain fields, so a YAML section stays flat; `sampler` builds the Sampler."""
    max_turns: int = 4  # tool-using turns (at most MAX_TURNS); then one answer-only turn
    max_response_tokens: int = 500  # sampled tokens per turn (at most MAX_TOKENS)
    max_obs_tokens: int = 500  # observation tokens per turn (truncated beyond; at most MAX_TOKENS)
    tool_timeout_s: float = 60.0  # per batched tool call (at most MAX_TIMEOUT_S, a day)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 0.95
    top_k: int = 0  # 0: off
    # episodes in flight at once, all processes together (slots of the KV cache; a free slot
    # takes the next waiting episode); 0: every episode of the call at once. Rounded up to a
    # multiple of the mesh's fsdp; the cache is max_concurrent x one episode's slots.
    max_concurrent: int = 0
    # of the max_concurrent rows, those that park an episode waiting for its tool (its KV
    # row moves there and its decode row takes another episode; used only while episodes
    # outnumber the rows); -1: a quarter. The rest decode.
    park_slots: int = -1
    tool_workers: int = 8  # tool calls (one batched call per tool kind and decode call) running at once

    def __post_init__(self):
        for f in ("max_response_tokens", "max_obs_tokens"):
            value = getattr(self, f)
            require(value >= 1, f"EpisodeConfig.{f}", value, ">= 1")
            require(value <= MAX_TOKENS, f"EpisodeConfig.{f}", value,
                    f"<= {MAX_TOKENS} (tokens a turn: beyond any model's context)")
        require(self.max_turns >= 0, "EpisodeConfig.max_turns", self.max_turns, ">= 0")
        require(self.max_turns <= MAX_TURNS, "EpisodeConfig.max_turns", self.max_turns,
                f"<= {MAX_TURNS} (tool turns an episode)")
        require(self.max_concurrent >= 0, "EpisodeConfig.max_concurrent", self.max_concurrent,
                ">= 0 (0: every episode at once)")
        require(self.park_slots >= -1, "EpisodeConfig.park_slots", self.park_slots,
                ">= 0, or -1 (a quarter of max_concurrent)")
        require(self.tool_workers >= 1, "EpisodeConfig.tool_workers", self.tool_workers, ">= 1")
        require(self.tool_timeout_s > 0, "EpisodeConfig.tool_timeout_s", self.tool_timeout_s, "> 0 (seconds)")
        require(self.tool_timeout_s <= MAX_TIMEOUT_S, "EpisodeConfig.tool_timeout_s", self.tool_timeout_s,
                f"<= {MAX_TIMEOUT_S:g} (seconds: a day)")
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


def run_episodes(model, tokenizer, prompts: Sequence, tools: dict[str, Tool], *,
                 config: EpisodeConfig = EpisodeConfig(), protocol=SearchR1(), seed: int = 0,
                 stats: EpisodeStats | None = None) -> list[Trajectory]:
    """Runs one episode per prompt (a string or chat messages; repeat a prompt G times
    for a GRPO group) in the engine, at most `config.max_concurrent` at once. `tools` maps
    an action kind ("search", "code") to a batched tool; `stats` (if given) collects the
    rollout's counters and times. Returns one Trajectory per prompt, in order.

    With several processes every process calls this with its own rows (as many in each:
    `hosts.local_rows` of the step's rows), runs the tools for those only, and the device
    work runs on every process's slots at once; the loop's decisions (another decode call,
    a prefill's width) are agreed between the processes."""
    if not prompts:
        raise ValueError("run_episodes needs at least one prompt")
    stats = stats if stats is not None else EpisodeStats()
    return Engine(model, tokenizer, prompts, tools, config, protocol, seed, stats).run()


__all__ = ["EpisodeConfig", "EpisodeStats", "Trajectory", "observation_ids", "run_episodes"]
