"""Several processes on loopback for the multi-process tests: N processes of D CPU devices
each, joined by `jax.distributed` over 127.0.0.1 (gloo collectives), from the environment
that `car_jax/cli/distributed.py` reads (each child calls `maybe_init_distributed()`, or
`car_jax.cli.main`, which does)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import COMPILE_FLAGS

REPO = Path(__file__).resolve().parents[1]
VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
             "CAR_JAX_DISTRIBUTED", "JAX_LOCAL_DEVICE_IDS", "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "XLA_FLAGS")

# `car-jax ARGS`, or (TEST_KILL_AT_STEP=N) the same command whose processes SIGKILL themselves
# when training step N starts, once step N-1's checkpoint is on disk: a crash of every process
# right after a step
CLI = """
import os, signal, sys
from car_jax.cli import distributed, main
kill_at = int(os.environ.get("TEST_KILL_AT_STEP", "0"))
if kill_at:
    distributed.maybe_init_distributed()  # before the trainer's imports touch a device
    from car_jax.train import trainer
    step = trainer.Trainer.step
    def dying_step(self, n, timer):
        if n == kill_at:
            self.ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, n, timer)
    trainer.Trainer.step = dying_step
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(argv: list[str], processes: int, devices: int, *, timeout: float = 420,
                  env: dict | None = None) -> list[tuple[int, str, str]]:
    """Runs `argv` as `processes` processes of `devices` CPU devices each (one process: no
    cluster variables), from the repository root; returns [(returncode, stdout, stderr)] in
    process order. A process still running after `timeout` seconds is killed."""
    base = {k: v for k, v in os.environ.items()
            if k not in VARIABLES and "proxy" not in k.lower()}  # gRPC would use a proxy
    base |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}",
             **(env or {})}
    if processes > 1:
        port = free_port()
        base |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
                 "JAX_NUM_PROCESSES": str(processes)}
    procs = [subprocess.Popen(argv, env=base | ({"JAX_PROCESS_ID": str(rank)} if processes > 1 else {}), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(processes)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:  # a hang fails the test instead of blocking the suite
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def launch(args: list[str], processes: int, devices: int, kill_at: int = 0, timeout: float = 420):
    """`car-jax ARGS` as `processes` x `devices` (see `CLI` for kill_at)."""
    return run_processes([sys.executable, "-c", CLI, *args], processes, devices, timeout=timeout,
                         env={"TEST_KILL_AT_STEP": str(kill_at)})


def succeeded(results) -> None:
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"process {rank} exited {code}:\n{err[-4000:]}"
