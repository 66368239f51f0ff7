"""Joining a multi-process run (a TPU slice, several GPU nodes, a SLURM job) before anything
touches a device: `jax.distributed.initialize`, with its arguments read from the environment.

    JAX_COORDINATOR_ADDRESS=host:port  JAX_NUM_PROCESSES=N  JAX_PROCESS_ID=i
        an explicit cluster: all three in every process (the address of process 0, the same
        N everywhere, i in 0..N-1 and different in each process)
    CAR_JAX_DISTRIBUTED=1
        JAX detects the cluster itself (TPU metadata, SLURM, Open MPI); any of the three
        variables above that is set is passed on and wins over what JAX detects
    JAX_LOCAL_DEVICE_IDS=0,1
        optional, with either: the local devices this process uses (e.g. one GPU a process)

With none of them set the run is a single process and nothing happens. A variable that is
missing or malformed raises `ConfigError` naming it, which the CLI prints as one line."""
from __future__ import annotations

import os
from collections.abc import Mapping

from car_jax.config import ConfigError

ADDRESS, NUM, ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
TRIPLE = (ADDRESS, NUM, ID)
AUTO = "CAR_JAX_DISTRIBUTED"
LOCAL_IDS = "JAX_LOCAL_DEVICE_IDS"
FIX = (f"an explicit cluster needs {ADDRESS} (host:port of process 0), {NUM} and {ID} (0..N-1) "
       f"in every process; or set {AUTO}=1 to let JAX detect a TPU slice, SLURM or Open MPI job")


def _integer(name: str, value: str, low: int, high: int | None, expected: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        raise ConfigError(f"{name}={value!r} must be {expected}")
    return number


def _address(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{ADDRESS}={value!r} must be host:port of process 0, e.g. 10.0.0.2:8476")
    return value


def _device_ids(value: str) -> list[int]:
    parts = [part.strip() for part in value.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise ConfigError(f"{LOCAL_IDS}={value!r} must be comma-separated local device indices, e.g. 0,1")
    return [int(part) for part in parts]


def distributed_args(environ: Mapping[str, str]) -> dict | None:
    """The keyword arguments for `jax.distributed.initialize` that `environ` asks for:
    None for a single-process run, {} (or only what is set) for JAX's auto-detection,
    `coordinator_address`, `num_processes`, `process_id` (and `local_device_ids`) for an
    explicit cluster. Raises ConfigError naming a missing or malformed variable."""
    given = {name: environ.get(name, "").strip() for name in (*TRIPLE, AUTO, LOCAL_IDS)}
    auto = given[AUTO]
    if auto not in ("", "0", "1"):
        raise ConfigError(f"{AUTO}={auto!r} must be 1 (JAX detects the cluster) or 0 / unset")
    present = [name for name in TRIPLE if given[name]]
    if auto != "1":
        if not present:
            return None
        missing = [name for name in TRIPLE if not given[name]]
        if missing:
            raise ConfigError(f"{' and '.join(missing)} not set (but {' and '.join(present)} set): {FIX}")
    kwargs: dict = {}
    if given[ADDRESS]:
        kwargs["coordinator_address"] = _address(given[ADDRESS])
    if given[NUM]:
        kwargs["num_processes"] = _integer(NUM, given[NUM], 1, None, "an integer >= 1, the number of processes")
    if given[ID]:
        count = kwargs.get("num_processes")
        expected = (f"an integer in 0..{count - 1} ({NUM}={count}), each process its own"
                    if count else "an integer >= 0, each process its own")
        kwargs["process_id"] = _integer(ID, given[ID], 0, count - 1 if count else None, expected)
    if given[LOCAL_IDS]:
        kwargs["local_device_ids"] = _device_ids(given[LOCAL_IDS])
    return kwargs


def maybe_init_distributed(environ: Mapping[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize(**distributed_args(environ))` unless the
    environment (default `os.environ`) describes a single process or JAX is already
    initialised. CPU processes exchange data through gloo collectives (set first, unless
    JAX_CPU_COLLECTIVES_IMPLEMENTATION chooses otherwise; TPUs and GPUs ignore it).
    Returns whether this is a multi-process run."""
    environ = os.environ if environ is None else environ
    kwargs = distributed_args(environ)
    if kwargs is None:
        return False
    import jax  # here, so that `car-jax --help` does not load JAX
    if jax.distributed.is_initialized():  # a wrapper or a notebook got there first
        return True
    if not environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as err:  # what JAX could not fill in: no cluster detected
        if environ.get(AUTO, "").strip() != "1":
            raise  # an explicit cluster, checked above: not a missing setting
        raise ConfigError(f"{AUTO}=1: JAX found no TPU slice, SLURM or Open MPI job to join ({err}); "
                          f"elsewhere set {ADDRESS} (host:port of process 0), {NUM} and {ID} "
                          "(0..N-1) in every process") from None
    return True
