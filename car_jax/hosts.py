"""Several processes, one program: the few host-side operations a multi-process run
(`jax.distributed`, one process per host) needs, each a plain single-process operation when
there is one process.

Rows of a batch are split over the mesh axis `fsdp`; each process holds the rows its own
devices hold, as one contiguous block (`local_rows`), runs those rows' episodes and tools,
and hands its block to the device with `to_global`. Device results come back with
`fetch_local` (this process's rows of a row-split array) or as replicated scalars. Host
values all processes must agree on (a padded width, "is any row still running") or
global metrics go through `allgather` / `allgather_objects` / `global_max`. Files are written
by process 0 only (`is_writer`); collective work (orbax saves, `gather_full`) is done by
every process.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from car_jax.config import ConfigError

ROWS = P("fsdp")


def count() -> int:
    return jax.process_count()


def index() -> int:
    return jax.process_index()


def is_writer() -> bool:
    """Whether this process writes the run's files (metrics, configs, summaries, exports)."""
    return jax.process_index() == 0


def _row_blocks(n: int, mesh: Mesh) -> dict[int, tuple[int, int]]:
    """{process index: (start, stop)} of the rows of a [n] array split over fsdp."""
    sharding = NamedSharding(mesh, ROWS)
    blocks: dict[int, set[int]] = {}
    for device, (rows,) in sharding.devices_indices_map((n,)).items():
        blocks.setdefault(device.process_index, set()).update(range(*rows.indices(n)))
    out = {}
    for proc, rows in blocks.items():
        lo, hi = min(rows), max(rows) + 1
        if len(rows) != hi - lo:
            raise ValueError(f"process {proc}'s devices hold rows {sorted(rows)[:8]}... of {n}, not one block: "
                             "order the mesh's devices by process (car_jax.make_mesh of jax.devices() does)")
        out[proc] = (lo, hi)
    if sum(hi - lo for lo, hi in out.values()) != n:  # a tp group across processes: shared rows
        raise ValueError(f"the {n} rows of a step are held by more than one process each (mesh {dict(mesh.shape)}); "
                         "keep each tp group within one host (tp at most the devices of a process)")
    return out


def check_mesh(mesh: Mesh | None) -> None:
    """With several processes the run needs one mesh over every process's devices (each
    process's rows live on its own devices); a ConfigError naming mesh.devices otherwise."""
    if count() == 1:
        return
    held = 0 if mesh is None else len({d.process_index for d in mesh.devices.flat})
    if held != count():
        raise ConfigError(f"mesh.devices: a run on {count()} processes needs a mesh over the devices of all of "
                          f"them ({jax.device_count()} devices; the mesh spans {held} processes); "
                          "set mesh.devices=0 (all devices)")


def local_rows(n: int, mesh: Mesh | None) -> slice:
    """The rows of a [n, ...] array split over fsdp that this process's devices hold (all
    of them with one process or no mesh). n must divide over fsdp."""
    if mesh is None or count() == 1:
        return slice(0, n)
    if n % mesh.shape["fsdp"]:
        raise ValueError(f"{n} rows cannot be split over mesh axis fsdp of size {mesh.shape['fsdp']}")
    return slice(*_row_blocks(n, mesh)[index()])


def to_global(local: np.ndarray, mesh: Mesh | None, spec: P = ROWS, rows: int | None = None) -> jax.Array:
    """This process's block of a row-split array (spec ROWS; `rows` the global row count,
    default local rows x processes) or, with spec P(), the whole replicated value (equal
    in every process), as one global jax.Array on `mesh`; without a mesh, on the first
    device."""
    local = np.asarray(local)
    if mesh is None:
        return jax.device_put(local, jax.local_devices()[0])
    sharding = NamedSharding(mesh, spec)
    if count() == 1:
        return jax.device_put(local, sharding)
    shape = local.shape
    if spec == ROWS:
        shape = (rows if rows is not None else local.shape[0] * count(), *local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, shape)


def fetch_local(x: jax.Array, mesh: Mesh | None) -> np.ndarray:
    """This process's rows (`local_rows`) of a global array whose first axis is rows, as
    numpy, read from the shards this process holds; the whole array with one process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding != NamedSharding(mesh, ROWS):  # whatever layout the compiler chose: rows first
        x = _as_rows(mesh)(x)
    rows = local_rows(x.shape[0], mesh)
    out = np.empty((rows.stop - rows.start, *x.shape[1:]), x.dtype)
    filled = np.zeros(len(out), bool)
    for shard in x.addressable_shards:  # laid out as ROWS: each shard holds whole rows
        lo, hi, _ = shard.index[0].indices(x.shape[0])
        a, b = max(lo, rows.start), min(hi, rows.stop)
        if a < b:
            out[a - rows.start:b - rows.start] = np.asarray(shard.data)[a - lo:b - lo]
            filled[a - rows.start:b - rows.start] = True
    if not filled.all():
        raise ValueError(f"rows {rows.start}..{rows.stop - 1} of an array of shape {x.shape} are not all held by "
                         f"this process's devices (sharding {x.sharding}); split its rows over fsdp")
    return out


@functools.lru_cache(maxsize=8)
def _as_rows(mesh: Mesh):
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, ROWS))


def gather_full(x: jax.Array) -> np.ndarray:
    """The whole value of a global array as numpy in every process (a collective: every
    process must call it, in the same order); plain `np.asarray` with one process."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def allgather(local: np.ndarray) -> np.ndarray:
    """Every process's `local` (same shape and dtype in each) concatenated along axis 0 in
    process order; `local` itself with one process. A collective."""
    local = np.asarray(local)
    if count() == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def global_max(value: int) -> int:
    """The largest of every process's `value`. A collective."""
    return int(allgather(np.array([value], np.int64)).max())


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable `obj`, in process order ([obj] with one process).
    A collective; meant for small per-row records and metrics."""
    if count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    width = global_max(len(data))
    padded = np.zeros(width + 8, np.uint8)
    padded[:8] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    padded[8:8 + len(data)] = data
    rows = allgather(padded[None])
    return [json.loads(bytes(r[8:8 + int(np.frombuffer(r[:8].tobytes(), np.int64)[0])]).decode()) for r in rows]


def sync(name: str) -> None:
    """A barrier: every process waits here until all reach it (no-op with one process)."""
    if count() > 1:
            multihost_utils.sync_global_devices(name)
