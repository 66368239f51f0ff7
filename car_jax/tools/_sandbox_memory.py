"""The memory of a whole sandbox call, all its processes together: `open_meter(limit, ...)`.

RLIMIT_AS caps each process; a program that forks could still hold (processes x limit).
A meter bounds the sum, in one of two ways, chosen per call:
- `CgroupMeter`, when this process can make a child of its own memory cgroup (root on
  cgroup v1, or a cgroup v2 tree with the memory controller delegated): the launcher joins
  a fresh cgroup whose limit the kernel enforces on every page (anonymous memory, tmpfs,
  page cache); past it the kernel OOM-kills inside the group, and the meter reports that
  kill so the sandbox ends the whole call.
- `TreeMeter` otherwise: every `interval_s` it sums the proportional set size (PSS: a page
  shared by n processes, e.g. after fork, counts 1/n in each) of the launcher's process
  tree, and reports when the sum passes the limit. It may overshoot by what the program
  allocates within one interval, and sees only processes still in the tree (with a PID
  namespace that is all of them: orphans are adopted by the namespace's PID 1).
"""
from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import signal
import time

log = logging.getLogger(__name__)
_ids = itertools.count()


def _cgroup_dir() -> tuple[str, int] | None:
    """(this process's memory cgroup directory, cgroup version), from mountinfo and
    /proc/self/cgroup; None when no memory hierarchy is mounted."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:
            member = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for version in (1, 2):
        for fields in mounts:
            fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
            if version == 1 and not (fstype == "cgroup" and "memory" in options):
                continue
            if version == 2 and fstype != "cgroup2":
                continue
            for _, controllers, path in member:
                if (version == 1 and "memory" in controllers.split(",")) or (version == 2 and not controllers):
                    root, point = fields[3], fields[4]
                    if not path.startswith(root):
                        continue  # our cgroup lies outside what this mount shows
                    return os.path.join(point, path[len(root):].lstrip("/")), version
    return None


@functools.lru_cache(maxsize=None)
def memory_cgroup() -> tuple[str, int] | None:
    """(where to make the calls' cgroups, version) when this process may make a child
    memory cgroup there (cached per process); else None."""
    found = _cgroup_dir()
    if found is None:
        return None
    parent, version = found
    probe = os.path.join(parent, f"car_jax_probe_{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError:
        return None
    try:
        limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
        return found if os.path.exists(os.path.join(probe, limit_file)) else None
    finally:
        os.rmdir(probe)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CgroupMeter:
    """A fresh memory cgroup capped at `limit_bytes`; the launcher joins it through
    `procs_file`. `exceeded()`: the kernel OOM-killed something in it."""

    kind = "memcg"

    def __init__(self, parent: str, version: int, limit_bytes: int):
        self.path = os.path.join(parent, f"car_jax_sandbox_{os.getpid()}_{next(_ids)}")
        os.mkdir(self.path)
        self.procs_file = self._file("cgroup.procs")
        try:
            if version == 1:
                _write(self._file("memory.limit_in_bytes"), str(limit_bytes))
                if os.path.exists(self._file("memory.memsw.limit_in_bytes")):  # swap counts too
                    _write(self._file("memory.memsw.limit_in_bytes"), str(limit_bytes))
                self._events = self._file("memory.oom_control")
            else:
                _write(self._file("memory.max"), str(limit_bytes))
                for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if os.path.exists(self._file(name)):
                        _write(self._file(name), value)
                self._events = self._file("memory.events")
        except OSError:
            self.close()
            raise

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def watch(self, pid: int) -> None:
        """The launcher started (it joins the cgroup itself)."""

    def exceeded(self) -> bool:
        try:
            with open(self._events) as f:
                counts = dict(line.split() for line in f if line.strip())
        except OSError:
            return False
        return int(counts.get("oom_kill", 0)) > 0

    def close(self) -> None:
        """Kill what is left in the cgroup (without a PID namespace, processes that left the
        process group), then remove it once its processes are gone."""
        try:
            with open(self.procs_file) as f:
                pids = [int(pid) for pid in f.read().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for _ in range(100):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.EBUSY:
                    break
                time.sleep(0.01)
        log.warning("sandbox: could not remove the memory cgroup %s", self.path)


def _tree(pid: int) -> list[int]:
    """pid and all its descendants (through /proc/<pid>/task/<tid>/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            tids = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
            except OSError:
                pass
    return found


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    try:  # no smaps_rollup (kernel < 4.14): resident pages, shared ones counted in full
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0  # the process is gone


class TreeMeter:
    """Sums the PSS of the process tree under `root_pid` every `interval_s`."""

    kind = "memwatch"
    procs_file = None

    def __init__(self, limit_bytes: int, interval_s: float = 0.05):
        self.limit, self.interval = limit_bytes, interval_s
        self.root_pid: int | None = None
        self._next = 0.0

    def watch(self, pid: int) -> None:
        """The launcher started as `pid`: watch its tree from now on."""
        self.root_pid = pid

    def exceeded(self) -> bool:
        now = time.monotonic()
        if self.root_pid is None or now < self._next:
            return False
        self._next = now + self.interval
        return sum(_pss_bytes(pid) for pid in _tree(self.root_pid)) > self.limit

    def close(self) -> None:
        pass


def open_meter(limit_bytes: int) -> CgroupMeter | TreeMeter:
    """A cgroup where this process may make one, else a process-tree watchdog."""
    found = memory_cgroup()
    if found is not None:
        try:
            return CgroupMeter(*found, limit_bytes)
        except OSError as err:
            log.warning("sandbox: memory cgroup failed (%s); watching process memory instead", err)
    return TreeMeter(limit_bytes)
