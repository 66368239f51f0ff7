"""The host side of an update: a step's trajectories as numpy arrays (`HostBatch`), and the
micro-batch layout of a mini-batch's rows (`MicroPlan`). `batches.to_device` moves a
HostBatch to the device; nothing here touches a device.

Prompts are kept apart from responses, so that the rows of a GRPO group share one prompt
forward (`models.prompt_forward`):

  prompts        int32[U, P]    each distinct prompt of the step once, left-padded
  prompts_valid  bool[U, P]
  prompt_of      int32[B]       the prompt row b continues
  tokens         int32[B, R]    row b's response (sampled tokens and tool observations),
                                right-padded; valid bool[B, R]
  mask           float32[B, R]  the loss mask: 1 on the sampled tokens of kept rows
  old_logp       float32[B, R]  the sampler's log-probs (0 on observations and padding)
and per-row scalars:
  correct, q, format_ok   bool[B], float32[B], bool[B]: the reward inputs the host parsed
                          (`calibration.rewards.reward_inputs`)
  group          int32[B]       each row's GRPO group, numbered 0, 1, ...
  keep           bool[B]        rows that take part in the update: a dropped row (a void TIR
                                trajectory) has mask 0 and stays out of its group's reward
                                mean and std too (`grpo.group_advantages(valid=keep)`)

P and R are padded to `length_bucket` sizes, so a run sees few shapes (few compiles).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from car_jax.calibration.rewards import RewardInputs
from car_jax.rl import grpo
from car_jax.rollout.episode import Trajectory
from car_jax.rollout.generate import left_pad, length_bucket


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """A step's rows on the host (the arrays of the module docstring)."""
    prompts: np.ndarray
    prompts_valid: np.ndarray
    prompt_of: np.ndarray
    tokens: np.ndarray
    valid: np.ndarray
    mask: np.ndarray
    old_logp: np.ndarray
    correct: np.ndarray
    q: np.ndarray
    format_ok: np.ndarray
    group: np.ndarray
    keep: np.ndarray

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


def host_batch(trajs: Sequence[Trajectory], pad_id: int, *, keep: np.ndarray | None = None,
               inputs: RewardInputs | None = None, groups: Sequence | None = None,
               lengths: tuple[int, int] | None = None) -> HostBatch:
    """The HostBatch of `trajs`. keep bool[B]: rows where it is False get mask 0 and leave
    the group statistics (default all kept); inputs: the rows' reward inputs (default all
    False / 0, as for SFT, which has no reward); groups: any hashable group id per row
    (default: a group per row); lengths: (longest prompt, longest response) to pad for
    instead of these trajectories' own (`longest`: with several processes, the longest of
    every process's rows, so that all build the same widths)."""
    b = len(trajs)
    ids: dict[tuple[int, ...], int] = {}
    prompt_of = np.array([ids.setdefault(tuple(t.prompt_ids.tolist()), len(ids)) for t in trajs], np.int32)
    prompts = list(ids)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("a trajectory has an empty prompt: every response must follow at least one token")
    longest_prompt, longest_response = longest(trajs) if lengths is None else lengths
    tokens_p, valid_p = left_pad(prompts, length_bucket(longest_prompt, 16), pad_id)
    width = length_bucket(max(1, longest_response), 16)
    keep = np.ones(b, bool) if keep is None else np.asarray(keep, bool)
    if keep.shape != (b,):
        raise ValueError(f"keep has shape {keep.shape}: one flag per trajectory, ({b},)")
    tokens, valid = np.full((b, width), pad_id, np.int32), np.zeros((b, width), bool)
    mask, old_logp = np.zeros((b, width), np.float32), np.zeros((b, width), np.float32)
    for i, t in enumerate(trajs):
        r = len(t.response_ids)
        tokens[i, :r], valid[i, :r], old_logp[i, :r] = t.response_ids, True, t.logprobs
        if keep[i]:
            mask[i, :r] = t.loss_mask
    if inputs is None:
        inputs = RewardInputs(np.zeros(b, bool), np.zeros(b, np.float32), np.zeros(b, bool))
    group = np.arange(b, dtype=np.int32) if groups is None else grpo.group_index(groups)
    return HostBatch(np.asarray(tokens_p, np.int32), np.asarray(valid_p, bool), prompt_of, tokens, valid, mask,
                     old_logp, np.asarray(inputs.correct, bool), np.asarray(inputs.q, np.float32),
                     np.asarray(inputs.format_ok, bool), group, keep)


def longest(trajs: Sequence[Trajectory]) -> tuple[int, int]:
    """(longest prompt, longest response) of `trajs`, in tokens."""
    return max(len(t.prompt_ids) for t in trajs), max(len(t.response_ids) for t in trajs)


@dataclasses.dataclass(frozen=True)
class MicroPlan:
    """Which batch rows and prompts make up each micro-batch of one mini-batch."""
    rows: np.ndarray  # int32[M, b]: the batch rows of micro-batch m
    pick: np.ndarray  # int32[M, u]: the batch prompt in each prompt slot (-1: a spare slot, all padding)
    index: np.ndarray  # int32[M, b]: each row's prompt slot


def micro_plan(prompt_of: np.ndarray, rows: np.ndarray, micro: int, share: bool = True) -> MicroPlan:
    """The chosen batch rows (prompt_of int32[B] from the HostBatch) in micro-batches of
    `micro`. With `share` (one device) rows are ordered by prompt first, so a group's rows
    land in as few micro-batches as possible, and each micro-batch holds each of its
    distinct prompts once (u = the most any micro-batch needs; spare slots are padding).
    Without it (on a mesh, where rows are split over devices), and whenever some
    micro-batch has `micro` distinct prompts anyway, u = micro and row i's prompt is in slot
    i: index is arange(micro) and the step gathers nothing. The micro-batch gradients are
    summed, so the order changes no result."""
    rows = np.asarray(rows)
    if len(rows) % micro:
        raise ValueError(f"micro-batch size {micro} does not divide the {len(rows)} rows of the mini-batch")
    if share:
        rows = rows[np.argsort(prompt_of[rows], kind="stable")]
    chunks = rows.reshape(-1, micro)
    of = prompt_of[chunks]  # [M, micro] batch prompt ids
    uniq = [np.unique(o, return_inverse=True) for o in of]  # sorted ids; rows are sorted by id
    u = max(len(ids) for ids, _ in uniq)
    if not share or u == micro:
        pick, index = of, np.broadcast_to(np.arange(micro), of.shape)
    else:
        pick = np.full((len(chunks), u), -1)
        for m, (ids, _) in enumerate(uniq):
            pick[m, :len(ids)] = ids
        index = np.stack([inv for _, inv in uniq])
    return MicroPlan(chunks.astype(np.int32), np.asarray(pick, np.int32), np.asarray(index, np.int32))
