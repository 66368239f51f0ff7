"""`host_batch` for one tool-free turn per row, the batch of the learning test
(tests/test_learning.py) and the GRPO step benchmark (benchmarks/bench_grpo_step.py): training
runs episodes (`rl.host_batch.host_batch` of their trajectories); nothing in the package
imports this file."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from car_jax.calibration.rewards import RewardInputs
from car_jax.rl.host_batch import HostBatch, host_batch
from car_jax.rollout.decode import SegmentOut
from car_jax.rollout.episode import Trajectory


def single_turn_batch(prompt_ids: Sequence[Sequence[int]], out: SegmentOut, pad_id: int, inputs: RewardInputs,
                      groups: Sequence) -> HostBatch:
    """`host_batch` for one tool-free turn per row: the row's sampled tokens and their
    recorded log-probs from `generate_ids`, all kept, with the rows' reward inputs and
    GRPO groups."""
    trajs = [Trajectory(p, out.tokens[i, :out.length[i]], out.logp[i, :out.length[i]],
                        np.ones(int(out.length[i]), bool)) for i, p in enumerate(prompt_ids)]
    return host_batch(trajs, pad_id, inputs=inputs, groups=groups)
