"""DAPO's dynamic sampling: a step trains only on GRPO groups that carry a signal.

Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (2025), section
3.2 ("Dynamic Sampling"): a group whose G outputs are all right (or all wrong) has equal
rewards, so its advantages are zero and it only shrinks the batch; DAPO over-samples and
filters such groups out, sampling more prompts until the batch is full (the constraint
0 < |{o_i : o_i correct}| < G in its objective). With a confidence term in the reward the
rewards of an all-wrong group are rarely exactly equal, and GRPO's std normalisation turns
their ~1e-3 spread into advantages of +-1, so car_jax offers two filters:

  reward    a group carries a signal when the rewards of its kept rows are not all equal
            (exact float32 comparison; `groups/equal_reward_share` counts the others);
  accuracy  when its kept rows are neither all right nor all wrong (DAPO's constraint;
            `groups/equal_correct_share` counts the others).

A group needs at least two kept rows to carry a signal (a void TIR trajectory is not kept).

A step samples rounds of `prompts_per_step` prompts (the same shapes each round, so nothing
recompiles) until every process holds its share of signal-carrying groups, or until
`max_rounds` rounds; a process still short then fills its batch with the groups it dropped,
earliest first (`filled` in the metrics), so the batch keeps its size. Each process keeps its
own groups (its trajectories never leave it); the rounds are collective (the decode runs on
the whole mesh), so every process runs the same number of them, decided from the gathered
counts, and every process can name the kept groups of all (`Selection`). Host-side numpy.
Letters: B rows of one round (this process's), U its groups (B = U * G).
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

from car_jax.config import require

Filter = Literal["off", "reward", "accuracy"]


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    """The `rl.dynamic_sampling` section."""
    filter: Filter = "off"  # off: train on every sampled group (GRPO as before)
    max_rounds: int = 4  # sampling rounds a step at most, the first included

    def __post_init__(self):
        require(self.filter in ("off", "reward", "accuracy"), "filter", self.filter,
                "one of off, reward (rewards not all equal), accuracy (some right, some wrong)")
        require(self.max_rounds >= 1, "max_rounds", self.max_rounds,
                ">= 1 (rounds of sampling a step at most, the first included)")


def group_signal(rewards: np.ndarray, correct: np.ndarray, keep: np.ndarray, group_size: int,
                 filter: Filter) -> np.ndarray:
    """bool[U]: which groups carry a signal under `filter` (module doc). rewards float32[B],
    correct bool[B], keep bool[B]; group u is rows u*G .. u*G + G - 1 (the trainer's layout)."""
    b = len(rewards)
    if b % group_size:
        raise ValueError(f"{b} rows are not whole groups of {group_size}")
    shape = (b // group_size, group_size)
    if filter == "off":
        return np.ones(shape[0], bool)
    keep = np.asarray(keep, bool).reshape(shape)
    values = (np.asarray(rewards, np.float32) if filter == "reward" else np.asarray(correct, bool)).reshape(shape)
    # the first kept value of each group; a group differs where a kept row has another value
    first = values[np.arange(shape[0]), np.argmax(keep, axis=1)]
    differs = (keep & (values != first[:, None])).any(axis=1)
    return differs & (keep.sum(axis=1) >= 2)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The groups a step trains on, of this process's rounds: `picked` lists (round, group)
    pairs in batch order; `signal` the per-round flags (bool[U] each) they were chosen from."""
    picked: tuple[tuple[int, int], ...]
    signal: tuple[np.ndarray, ...]

    @property
    def filled(self) -> int:
        """Groups without a signal taken to fill the batch."""
        return sum(not self.signal[r][u] for r, u in self.picked)


def select(signal: Sequence[np.ndarray], need: int) -> Selection:
    """The first `need` signal-carrying groups in round order, then, if there are fewer, the
    dropped groups in round order until `need` (module doc). signal: bool[U] per round."""
    order = [(r, u) for r, s in enumerate(signal) for u in np.flatnonzero(s)]
    order += [(r, u) for r, s in enumerate(signal) for u in np.flatnonzero(~np.asarray(s, bool))]
    if len(order) < need:
        raise ValueError(f"{len(order)} groups sampled, {need} needed")
    return Selection(tuple((r, int(u)) for r, u in order[:need]), tuple(np.asarray(s, bool) for s in signal))


def short(signal: Sequence[np.ndarray], need: int) -> bool:
    """Whether this process holds fewer than `need` signal-carrying groups so far."""
    return sum(int(np.sum(s)) for s in signal) < need
