"""Host side of an update: trajectories -> padded arrays -> train-step micro-batches.

Prompts are kept apart from responses, so that the G rows of a GRPO group share one
prompt forward (`models.prompt_forward`):

  prompts       int32[U, P]  each distinct prompt of the step once, left-padded
  prompts_valid bool[U, P]
  prompt_of     int32[N]     the prompt row n continues
  tokens        int32[N, R]  row n's response (sampled tokens and tool observations),
                             right-padded; valid bool[N, R]
  mask, old_logp, ref_logp   float32[N, R]: loss mask (1 on sampled tokens of kept
                             rows), the sampler's log-probs, the reference log-probs
  advantages    float32[N]

A micro-batch (`micro_batches`, the train step's input) carries its own prompts
[u, P] and `prompt_index` int32[b] into them. P and R are padded to `length_bucket`
sizes, so a run sees few shapes (few compiles).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from car_jax.rl import grpo
from car_jax.rollout.decode import SegmentOut
from car_jax.rollout.episode import Trajectory
from car_jax.rollout.generate import left_pad, length_bucket

ROW_KEYS = ("tokens", "valid", "mask", "old_logp", "ref_logp", "advantages")


def batch_arrays(trajs: list[Trajectory], advantages: np.ndarray, pad_id: int, keep: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """The arrays above for `trajs`; mask is 0 on the rows where `keep` is False."""
    ids: dict[tuple[int, ...], int] = {}
    prompt_of = np.array([ids.setdefault(tuple(t.prompt_ids), len(ids)) for t in trajs], np.int32)
    prompts = list(ids)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("a trajectory has an empty prompt: every response must follow at least one token")
    tokens_p, valid_p = left_pad(prompts, length_bucket(max(len(p) for p in prompts), 16), pad_id)
    n, width = len(trajs), length_bucket(max(1, max(len(t.response_ids) for t in trajs)), 16)
    out = {"prompts": tokens_p, "prompts_valid": valid_p, "prompt_of": prompt_of,
           "tokens": np.full((n, width), pad_id, np.int32), "valid": np.zeros((n, width), bool),
           "mask": np.zeros((n, width), np.float32), "old_logp": np.zeros((n, width), np.float32),
           "ref_logp": np.zeros((n, width), np.float32), "advantages": np.asarray(advantages, np.float32)}
    for i, t in enumerate(trajs):
        r = len(t.response_ids)
        out["tokens"][i, :r] = t.response_ids
        out["valid"][i, :r] = True
        if keep[i]:
            out["mask"][i, :r] = t.loss_mask
        out["old_logp"][i, :r] = t.logprobs
    return out


def single_turn_arrays(prompt_ids, out: SegmentOut, rewards: np.ndarray, groups: np.ndarray,
                       pad_id: int) -> dict[str, np.ndarray]:
    """`batch_arrays` for one tool-free turn per row: the row's sampled tokens and their
    recorded log-probs from `generate_ids`, all kept, with GRPO advantages of `rewards`
    within `groups` (a group id per row)."""
    trajs = [Trajectory(list(p), [int(t) for t in out.tokens[i, :out.length[i]]],
                        [float(x) for x in out.logp[i, :out.length[i]]], [1] * int(out.length[i]))
             for i, p in enumerate(prompt_ids)]
    adv = grpo.group_advantages(np.asarray(rewards, np.float64), np.asarray(groups))
    return batch_arrays(trajs, adv, pad_id, np.ones(len(trajs), bool))


def micro_batch_rows(arrays: dict[str, np.ndarray], rows: np.ndarray, micro: int, share: bool) -> np.ndarray:
    """int[M, micro]: the rows of one mini-batch in micro-batches. With `share` they are
    ordered by prompt first, so a group's rows land in as few micro-batches as possible.
    The micro-batch gradients are summed, so the order changes no result."""
    rows = np.asarray(rows)
    if len(rows) % micro:
        raise ValueError(f"micro-batch size {micro} does not divide the {len(rows)} rows of the mini-batch")
    if share:
        rows = rows[np.argsort(arrays["prompt_of"][rows], kind="stable")]
    return rows.reshape(-1, micro)


def micro_batches(arrays: dict[str, np.ndarray], rows: np.ndarray, micro: int, share: bool = True
                  ) -> dict[str, jnp.ndarray]:
    """The chosen rows of `batch_arrays` as a train-step batch: the ROW_KEYS as
    [M, micro, ...] plus prompt int32[M, u, P], prompt_valid bool[M, u, P] and
    prompt_index int32[M, micro]. With `share` (one device), each micro-batch holds each
    of its distinct prompts once (u = the most any micro-batch needs; spare prompt slots
    are all padding). Without it (on a mesh, where rows are split over devices), and
    whenever some micro-batch has `micro` distinct prompts anyway, u = micro and row i's
    prompt is prompt i: prompt_index is arange(micro) and the step gathers nothing."""
    chunks = micro_batch_rows(arrays, rows, micro, share)
    of = arrays["prompt_of"][chunks]  # [M, micro] global prompt ids
    uniq = [np.unique(o, return_inverse=True) for o in of]  # sorted ids; rows are sorted by id
    u = max(len(ids) for ids, _ in uniq)
    if not share or u == micro:
        pick, index = of, np.broadcast_to(np.arange(micro, dtype=np.int32), of.shape)
    else:
        pick = np.full((len(chunks), u), -1)
        for m, (ids, _) in enumerate(uniq):
            pick[m, :len(ids)] = ids
        index = np.stack([inv for _, inv in uniq]).astype(np.int32)
    prompt = np.where((pick >= 0)[..., None], arrays["prompts"][pick], 0)
    prompt_valid = (pick >= 0)[..., None] & arrays["prompts_valid"][pick]
    out = {k: jnp.asarray(arrays[k][chunks]) for k in ROW_KEYS}
    return {**out, "prompt": jnp.asarray(prompt, jnp.int32), "prompt_valid": jnp.asarray(prompt_valid),
            "prompt_index": jnp.asarray(index, jnp.int32)}


def chunked_logprobs(logprob_fn, params, arrays: dict[str, np.ndarray], micro: int, share: bool = True
                     ) -> np.ndarray:
    """float32[N, R] log-probs of every row's response under params, in micro-batches of
    `micro` rows, all in one call of the jitted `logprob_fn(params, batch)` (reference and
    old-policy log-probs; `train_step.make_logprob_fn`)."""
    n = len(arrays["tokens"])
    batch = micro_batches(arrays, np.arange(n), micro, share)
    rows = micro_batch_rows(arrays, np.arange(n), micro, share)
    logp = np.asarray(logprob_fn(params, batch))  # [M, micro, R]
    out = np.zeros(arrays["tokens"].shape, np.float32)
    for m in range(len(rows)):
        out[rows[m]] = logp[m]
    return out
