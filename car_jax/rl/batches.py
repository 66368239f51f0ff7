"""The device side of an update, and the one function that crosses to it.

    host = host_batch(trajs, pad_id, keep=..., inputs=..., groups=...)   # numpy (host_batch.py)
    batch = to_device(host, mesh)                                         # the crossing
    batch, rewards = score(batch)                   # rewards, advantages: on the device
    batch = batch.replace(ref_logp=chunked_logprobs(logprob_fn, ref_params, batch, plan, mesh))
    state, metrics = train_step(state, micro_batches(batch, plan, mesh))

`TrainBatch` holds a HostBatch's arrays (shapes in `host_batch`) as jax.Arrays, plus
sampler_logp float32[B, R] (the sampler's log-probs, kept when the trainer recomputes
old_logp), ref_logp float32[B, R] (the reference policy's log-probs) and advantages
float32[B], computed on the device from the batch itself. Nothing comes back to the host
but metrics.
On a mesh the rows (every [B, ...] array) are split over `fsdp` and the prompts [U, P] are
replicated (U rarely divides the mesh, and they are small).

`micro_batches` gathers one mini-batch's micro-batches (`host_batch.MicroPlan`, index
arrays made on the host from prompt_of) out of the device batch, in the layout and the
shardings the train step takes (`steps.BATCH_KEYS`, `steps.batch_shardings`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from car_jax import hosts
from car_jax.calibration.rewards import RewardFn, shaped_rewards
from car_jax.rl import grpo
from car_jax.rl.host_batch import HostBatch, MicroPlan
from car_jax.rl.mismatch import mismatch_metrics
from car_jax.rl.steps import Batch, batch_shardings

ROW_KEYS = ("tokens", "valid", "mask", "old_logp", "ref_logp", "sampler_logp", "advantages")  # per micro-batch row
PROMPT_FIELDS = ("prompts", "prompts_valid")  # replicated on a mesh; every other field is split by row


@struct.dataclass
class TrainBatch:
    """A step's rows on the device: the HostBatch fields, sampler_logp, ref_logp and advantages."""
    prompts: jax.Array  # int32[U, P]
    prompts_valid: jax.Array  # bool[U, P]
    prompt_of: jax.Array  # int32[B]
    tokens: jax.Array  # int32[B, R]
    valid: jax.Array  # bool[B, R]
    mask: jax.Array  # float32[B, R]
    old_logp: jax.Array  # float32[B, R]: the sampler's, or the trainer's once recomputed
    correct: jax.Array  # bool[B]
    q: jax.Array  # float32[B]
    format_ok: jax.Array  # bool[B]
    group: jax.Array  # int32[B]
    keep: jax.Array  # bool[B]: rows in the update (mask and group statistics)
    sampler_logp: jax.Array  # float32[B, R]: the sampler's log-probs (old_logp as it crossed)
    ref_logp: jax.Array  # float32[B, R]: 0 until computed (`chunked_logprobs`)
    advantages: jax.Array  # float32[B]: 0 until scored (`make_scorer`)

    def mismatch(self, tis_cap: float | None = None) -> dict[str, jax.Array]:
        """The gap between old_logp (once the trainer recomputed it) and sampler_logp over the
        loss tokens: `mismatch.mismatch_metrics`, device scalars."""
        return mismatch_metrics(self.old_logp, self.sampler_logp, self.mask, tis_cap)


HOST_FIELDS = tuple(f.name for f in dataclasses.fields(HostBatch))


def train_batch_shardings(mesh: Mesh) -> TrainBatch:
    """A TrainBatch of NamedShardings: rows over fsdp, prompts replicated."""
    rows, replicated = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    return TrainBatch(**{f.name: replicated if f.name in PROMPT_FIELDS else rows
                         for f in dataclasses.fields(TrainBatch)})


def to_device(host: HostBatch, mesh: Mesh | None = None) -> TrainBatch:
    """The host -> device crossing of a step's rows: the HostBatch's arrays as a TrainBatch,
    committed to the first device (no mesh) or laid out on `mesh` (rows over fsdp, prompts
    replicated); sampler_logp is old_logp (the same device array), ref_logp and advantages
    start at 0, on the device.

    The only place where rollout data enters the device. With several processes `host` is
    this process's rows (`hosts.local_rows`, ids made global by `share_prompts`, the same
    widths in every process): the row arrays are assembled from every process's block
    (`jax.make_array_from_process_local_data`) and the prompt table, the same in every
    process, is replicated."""
    b, r = host.tokens.shape
    total = b * hosts.count()
    if mesh is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = TrainBatch(**{f.name: sharding for f in dataclasses.fields(TrainBatch)})
        arrays = {name: jax.device_put(getattr(host, name), sharding) for name in HOST_FIELDS}
    else:
        if total % mesh.shape["fsdp"]:
            raise ValueError(f"{total} rows cannot be split over mesh axis fsdp of size {mesh.shape['fsdp']}")
        shardings = train_batch_shardings(mesh)
        arrays = {name: hosts.to_global(getattr(host, name), mesh, getattr(shardings, name).spec, rows=total)
                  for name in HOST_FIELDS}
    zeros = {"ref_logp": ((total, r), shardings.ref_logp), "advantages": ((total,), shardings.advantages)}
    return TrainBatch(**arrays, sampler_logp=arrays["old_logp"],
                      **{k: jnp.zeros(shape, jnp.float32, device=sh) for k, (shape, sh) in zeros.items()})


def share_prompts(host: HostBatch, pad_id: int) -> HostBatch:
    """With several processes: this process's rows with the step's whole prompt table (every
    process's distinct prompts, padded to the same count per process, in process order) and
    prompt_of and group numbered in it (group ids offset by the block's first row, so groups
    of different processes never meet). The HostBatch itself with one process."""
    if hosts.count() == 1:
        return host
    u = hosts.global_max(len(host.prompts))
    extra = u - len(host.prompts)
    prompts = np.concatenate([host.prompts, np.full((extra, host.prompts.shape[1]), pad_id, np.int32)])
    valid = np.concatenate([host.prompts_valid, np.zeros((extra, host.prompts.shape[1]), bool)])
    first_row = hosts.index() * host.rows
    return dataclasses.replace(host, prompts=hosts.allgather(prompts), prompts_valid=hosts.allgather(valid),
                               prompt_of=host.prompt_of + hosts.index() * u, group=host.group + first_row)


def micro_batches(batch: TrainBatch, plan: MicroPlan, mesh: Mesh | None = None) -> Batch:
    """The train step's input for one mini-batch (`steps.BATCH_KEYS`): the ROW_KEYS as
    [M, b, ...], prompt int32[M, u, P], prompt_valid bool[M, u, P] and prompt_index
    int32[M, b], gathered on the device (on a mesh: in `steps.batch_shardings`)."""
    return _gather(mesh)(batch, plan.rows, plan.pick, plan.index)


@functools.lru_cache(maxsize=8)
def _gather(mesh: Mesh | None):
    def gather(batch: TrainBatch, rows, pick, index):
        out = {k: getattr(batch, k)[rows] for k in ROW_KEYS}
        spare = (pick < 0)[..., None]
        slot = jnp.maximum(pick, 0)
        return {**out, "prompt": jnp.where(spare, 0, batch.prompts[slot]),
                "prompt_valid": ~spare & batch.prompts_valid[slot], "prompt_index": index}

    return jax.jit(gather) if mesh is None else jax.jit(gather, out_shardings=batch_shardings(mesh))


def chunked_logprobs(logprob_fn, params, batch: TrainBatch, plan: MicroPlan, mesh: Mesh | None = None
                     ) -> jax.Array:
    """float32[B, R] log-probs of every row's response under params (reference and
    old-policy log-probs), in the micro-batches of `plan` (which covers every row), all in
    one call of the jitted `logprob_fn(params, batch [M, b, ...])` (`steps.make_logprob_fn`),
    then put back in row order: on the device, in the batch's row sharding."""
    logp = logprob_fn(params, micro_batches(batch, plan, mesh))  # [M, b, R]
    return _scatter(mesh, batch.tokens.shape[0])(logp, plan.rows)


@functools.lru_cache(maxsize=8)
def _scatter(mesh: Mesh | None, n: int):
    def scatter(logp, rows):
        flat = logp.reshape(-1, logp.shape[-1])
        return jnp.zeros((n, flat.shape[-1]), jnp.float32).at[rows.reshape(-1)].set(flat)

    return jax.jit(scatter) if mesh is None else jax.jit(scatter, out_shardings=NamedSharding(mesh, P("fsdp")))


def make_scorer(reward: RewardFn, std_norm: bool = True, mesh: Mesh | None = None, shaping=None):
    """Jitted `score(batch) -> (batch with advantages, rewards float32[B])`: each row's
    reward from its reward inputs (correct, q, format_ok), plus `shaping` of its number of
    model-written tokens when given (`rewards.overlong_fn`), and the GRPO advantages within
    its group over the kept rows (`grpo.group_advantages(valid=batch.keep)`: a dropped row
    gets advantage 0 and leaves its group's mean and std), on the device: the advantages go
    straight into the train step, and only metrics of the rewards come back."""
    def score(batch: TrainBatch):
        rewards = shaped_rewards(reward, shaping, batch.correct, batch.q, batch.format_ok, batch.mask.sum(-1))
        adv = grpo.group_advantages(rewards, batch.group, std_norm=std_norm, valid=batch.keep)
        return batch.replace(advantages=adv), rewards

    if mesh is None:
        return jax.jit(score)
    return jax.jit(score, out_shardings=(train_batch_shardings(mesh), NamedSharding(mesh, P("fsdp"))))
