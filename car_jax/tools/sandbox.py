"""Run model-written Python in a separate, limited process: `run_python(code, config)`.

What is isolated (Linux; each call is a fresh process tree):
- time: a wall-clock timeout (the whole process group is SIGKILLed) and RLIMIT_CPU;
- memory: RLIMIT_AS per process (`memory_mb`), and all the call's processes together at most
  `total_memory_mb` (see _sandbox_memory: a memory cgroup where this process may make one,
  else a watchdog summing the process tree's PSS); past it the whole call is killed;
- stack and recursion: the soft RLIMIT_STACK is raised to the hard one (so the C stack of
  the main thread is bounded by RLIMIT_AS) and `sys.setrecursionlimit` is capped at
  `max_recursion`, so deep recursion ends in a RecursionError, not a segfault (the traceback
  printed keeps the last frames only, each line cut); a thread gets a C stack sized for the
  recursion limit when it starts, within a budget of a quarter of `memory_mb`;
- processes: RLIMIT_NPROC. It counts every process of the sandbox uid, so concurrent
  sandboxes running as the same uid share that budget; root ignores it, hence the next point;
- privileges: when the trainer runs as root the program runs as uid/gid 65534 (nobody) with
  no supplementary groups and no_new_privs, so it cannot signal the trainer, read root-only
  files or regain privileges through setuid binaries;
- system calls: a seccomp filter (x86_64, aarch64; needs only no_new_privs, so root or not)
  refuses unshare/clone with any CLONE_NEW* flag and setns (no user namespace), Unix sockets
  that could reach a path (socket(AF_UNIX), datagram socketpairs), memory no meter sees
  (memfd_create, shmget, msgget) and io_uring_setup; see _sandbox_child;
- network, with namespaces (`unshare`, used when it works): a private network namespace
  whose loopback is down, so no IP connection, 127.0.0.1 included (path-based Unix sockets,
  which a network namespace does not cover, are the filter's);
- processes seen and left behind, with namespaces: a PID namespace; when the program ends
  the kernel kills everything it started, even daemons that left the process group;
- files, with namespaces: a private mount namespace in which every filesystem is read-only
  and /tmp, /var/tmp and /dev/shm are fresh size-capped tmpfs (the working dir is
  /tmp/work); nothing the program writes reaches the host and all of it vanishes at exit
  (SysV/POSIX IPC objects too: a private IPC namespace). When Python lives under a directory the sandbox
  uid cannot enter (e.g. /root/.pyenv), that directory is replaced by an empty tmpfs with
  only the Python tree bind-mounted back read-only (the rest of /root is hidden);
- environment: a scrubbed one (PATH, LANG, HOME/TMPDIR = the working dir, one BLAS thread),
  Python started with -I (no PYTHON* variables, no user site), stdin at /dev/null;
- output: stdout and stderr are read with a hard byte cap; exceeding it kills the program;
  bytes are decoded as UTF-8 with errors="replace".
What is NOT isolated: the program can read every world-readable file (the repository, the
venv, /etc), use the CPU and memory allowed above, and call any other system call. Without
a memory cgroup, kernel memory (socket and pipe buffers) is not counted. Printing a container
nested D deep costs ~D^2/2 steps in CPython (Py_ReprEnter scans the containers being
printed), so the recursion cap is what bounds it: ~0.2-0.5 s at the default 30,000, seconds
at 100,000.
Without namespaces (no `unshare`, or not permitted; the result's `isolation` says which
parts applied and a warning is logged once): no network isolation, /tmp is the host's, and a
process that calls setsid() can outlive the call (unless the call has a memory cgroup, whose
leftovers are killed). Without root, no uid change is possible:
the program runs as the trainer's user (unprivileged user namespaces are used when allowed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from car_jax.tools._sandbox_memory import open_meter

log = logging.getLogger(__name__)
LAUNCHER = str(Path(__file__).with_name("_sandbox_child.py"))
SETUP_FAILED = 125  # the launcher's exit code when it could not set the sandbox up


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): misconfiguration, missing tools."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    timeout_s: float = 5.0  # wall clock
    cpu_s: int | None = None  # RLIMIT_CPU; default ceil(timeout_s) + 1
    memory_mb: int = 1024  # RLIMIT_AS per process
    total_memory_mb: int | None = None  # all the call's processes together; default memory_mb + 256
    # the most sys.setrecursionlimit may set. 30,000: memoized recursion 25,000 deep still
    # runs, and printing a list nested past the cap ends in its RecursionError in ~0.5 s
    # (the cost is quadratic in the depth: ~5 s at 100,000, past a typical timeout_s)
    max_recursion: int = 30_000
    max_procs: int = 64  # RLIMIT_NPROC (per uid)
    max_output_bytes: int = 1 << 16  # per stream; more kills the program
    max_file_mb: int = 16  # RLIMIT_FSIZE
    disk_mb: int = 64  # size of each private tmpfs (namespaces only)
    max_open_files: int = 256
    max_code_bytes: int = 1 << 20
    uid: int | None = 65534  # identity of the program when the trainer is root; None keeps
    gid: int = 65534  # root (unsafe: the program could signal the trainer, and NPROC is void)
    isolation: str = "auto"  # "auto": best available | "namespaces": required | "none"
    python: str | None = None  # interpreter; default the trainer's (sys.executable)

    def __post_init__(self):
        if self.isolation not in ("auto", "namespaces", "none"):
            raise ValueError(f"isolation {self.isolation!r}: use 'auto', 'namespaces' or 'none'")
        # checked here, before any call makes a folder or a cgroup (NaN fails every comparison)
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s must be finite and > 0, got {self.timeout_s}")
        if self.cpu_s is not None and not 0 < self.cpu_s < math.inf:
            raise ValueError(f"cpu_s must be finite and > 0 (or None), got {self.cpu_s}")
        if self.total_memory_mb is not None and self.total_memory_mb <= 0:
            raise ValueError(f"total_memory_mb must be positive (or None), got {self.total_memory_mb}")
        if self.max_recursion < 100:
            raise ValueError(f"max_recursion={self.max_recursion} would break ordinary programs: use >= 100")

    @property
    def call_memory_mb(self) -> int:
        """The bound on all the call's processes together (one full-size process + helpers)."""
        return self.total_memory_mb or self.memory_mb + 256


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by us (timeout, output cap)
    timed_out: bool = False
    output_limited: bool = False  # stdout/stderr passed max_output_bytes
    memory_limited: bool = False  # the call's processes together passed total_memory_mb
    duration_s: float = 0.0
    isolation: str = "none"  # e.g. "uid,net,mount,pid,ipc,seccomp,memcg"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.output_limited or self.memory_limited)


@dataclasses.dataclass(frozen=True)
class _Isolation:
    prefix: tuple[str, ...]  # unshare argv before the interpreter
    names: tuple[str, ...]  # namespaces obtained
    mounts: bool  # the launcher may mount (private mount namespace, root inside it)


_FULL = ("--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc")


@functools.lru_cache(maxsize=None)
def probe_isolation(mode: str = "auto") -> _Isolation:
    """Find the strongest `unshare` setup that works here (cached per process)."""
    none = _Isolation((), (), False)
    unshare = shutil.which("unshare")
    if mode == "none":
        return none
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    candidates = [
        (user + _FULL, ("net", "mount", "pid", "ipc"), True),
        (user + ("--net",), ("net",), False),
    ]
    for flags, names, mounts in candidates if unshare else []:
        try:
            probe = subprocess.run([unshare, *flags, "--", "true"], capture_output=True, timeout=10)
            ok = probe.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok and (mode == "auto" or mounts):
            if not mounts:
                log.warning("sandbox: only a network namespace is available; /tmp is shared and "
                            "escaped processes may survive (see car_jax.tools.sandbox)")
            return _Isolation((unshare, *flags, "--"), names, mounts)
    if mode == "namespaces":
        raise SandboxError("isolation='namespaces' but `unshare` with net/mount/pid namespaces "
                           "does not work here (needs root or unprivileged user namespaces)")
    log.warning("sandbox: no namespaces available: network is NOT blocked, /tmp is shared")
    return none


def _closed_to_others(paths) -> list[str]:
    """Paths with an ancestor that uid 65534 cannot enter (no o+x)."""
    bad = []
    for path in paths:
        parts = Path(os.path.realpath(path)).parents
        if any(not os.stat(p).st_mode & 0o001 for p in parts):
            bad.append(path)
    return bad


def _raise_stack() -> list[str]:
    """argv prefix that execs the launcher with the soft stack limit at the hard one
    (usually unlimited): the main thread's C stack then grows until RLIMIT_AS, enough for
    `max_recursion` frames of C recursion. It must happen before the interpreter starts:
    the kernel lays out the address space for the stack limit seen at exec time. With an
    unlimited limit, glibc gives new threads its small default stack instead of the limit."""
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    value = "unlimited" if hard == resource.RLIM_INFINITY else str(hard >> 10)
    return ["/bin/sh", "-c", 'ulimit -S -s "$0" && exec "$@"', value]


def _scrubbed_env() -> dict:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


def run_python(code: str, config: SandboxConfig = SandboxConfig()) -> SandboxResult:
    """Run `code` as a Python program under the limits of `config` (see the module doc).

    Returns the program's decoded stdout/stderr and how it ended; raises SandboxError only
    when the sandbox could not be set up (never because of what the program did).
    """
    source = code.encode("utf-8", "surrogatepass")
    if len(source) > config.max_code_bytes:
        return SandboxResult("", f"CodeTooLong: {len(source)} bytes > {config.max_code_bytes}", 1)
    iso = probe_isolation(config.isolation)
    python = config.python or sys.executable
    drop = os.geteuid() == 0 and config.uid is not None
    if drop and not iso.mounts and _closed_to_others([sys.base_prefix, sys.prefix]):
        raise SandboxError(
            f"the interpreter under {sys.base_prefix} is not readable by uid {config.uid} and mount "
            "namespaces are unavailable to re-expose it: install Python in a world-readable place "
            "(or, unsafely, keep root with SandboxConfig(uid=None))"
        )
    with contextlib.ExitStack() as undo:  # whatever was made is undone, on any exception too
        hostdir = tempfile.mkdtemp(prefix="car_jax_sandbox_")
        undo.callback(shutil.rmtree, hostdir, ignore_errors=True)
        if drop:
            os.chown(hostdir, config.uid, config.gid)
        meter = open_meter(config.call_memory_mb << 20)
        undo.callback(meter.close)
        status_r, status_w = os.pipe()
        undo.callback(os.close, status_r)
        try:
            settings = {
                "mounts": iso.mounts, "uid": config.uid if drop else None, "gid": config.gid,
                "stash_dir": hostdir, "status_fd": status_w, "disk_mb": config.disk_mb,
                "cpu_s": config.cpu_s or math.ceil(config.timeout_s) + 1, "memory_mb": config.memory_mb,
                "max_procs": config.max_procs, "max_file_mb": config.max_file_mb,
                "max_open_files": config.max_open_files, "max_recursion": config.max_recursion,
                "cgroup_procs": meter.procs_file,
            }
            cmd = [*iso.prefix, *_raise_stack(), python, "-I", "-u", "-X", "utf8", LAUNCHER,
                   json.dumps(settings)]
            start = time.monotonic()
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=hostdir, env=_scrubbed_env(), start_new_session=True, pass_fds=(status_w,),
            )
        finally:
            os.close(status_w)
        ended = None
        try:
            meter.watch(proc.pid)
            threading.Thread(target=_feed, args=(proc.stdin, source), daemon=True).start()
            out, err, ended = _collect(proc, start + config.timeout_s, config.max_output_bytes, meter)
        finally:
            _terminate(proc, "pid" in iso.names)
            status = os.read(status_r, 64)
            for stream in (proc.stdout, proc.stderr):
                stream.close()
            if not ended and meter.exceeded():  # e.g. a child OOM-killed, the program went on
                ended = "memory"
    timed_out, limited, memory = ended == "timeout", ended == "output", ended == "memory"
    code_ = None if ended else _exit_code(proc.returncode)
    stderr = err.decode("utf-8", "replace")
    if not status.startswith(b"ready") and not timed_out:
        raise SandboxError(
            f"sandbox setup failed (exit {proc.returncode}): {stderr.strip()[-2000:]}; "
            "SandboxConfig(isolation='none') runs without namespaces"
        )
    names = (("uid",) if drop else ()) + iso.names + (("seccomp",) if b" seccomp" in status else ())
    names += (meter.kind,)
    if b"read-only-partial" in status:  # some host filesystem stayed writable
        names = tuple("mount(partial)" if n == "mount" else n for n in names)
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"), stderr=stderr, exit_code=code_, timed_out=timed_out,
        output_limited=limited, memory_limited=memory, duration_s=time.monotonic() - start,
        isolation=",".join(names),
    )


def _feed(stdin, data: bytes) -> None:
    try:
        stdin.write(data)
    except (BrokenPipeError, OSError):
        pass  # the launcher died early; its exit status tells why
    finally:
        try:
            stdin.close()
        except OSError:
            pass


def _collect(proc, deadline: float, cap: int, meter) -> tuple[bytes, bytes, str | None]:
    """Read stdout/stderr until both close, the deadline passes ("timeout"), a stream
    exceeds `cap` bytes ("output") or the meter reports the memory bound passed ("memory").
    Once the launcher has exited, stragglers holding the pipes are killed."""
    bufs = {"out": bytearray(), "err": bytearray()}
    ended = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        while sel.get_map() and not ended:
            left = deadline - time.monotonic()
            if left <= 0:
                ended = "timeout"
                break
            events = sel.select(timeout=min(left, 0.05))
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.data]
                room = cap - len(buf)
                buf += chunk[:room]
                if len(chunk) > room:
                    ended = "output"
            if not ended and meter.exceeded():
                ended = "memory"
            if not events and proc.poll() is not None:
                _kill_group(proc)  # launcher gone: children still holding the pipes
    return bytes(bufs["out"]), bytes(bufs["err"]), ended


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _terminate(proc, pid_namespace: bool) -> None:
    """End the sandbox and reap it. With a PID namespace, kill its init first (the kernel then
    kills the rest and `unshare` reaps it, leaving no orphaned zombie); then SIGKILL the
    process group for whatever is left (everything, without namespaces)."""
    if proc.poll() is None and pid_namespace:
        for child in _children(proc.pid):  # the namespace's PID 1, seen from here
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc)
    proc.wait()


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_code(returncode: int) -> int:
    """Popen returncode -> shell-style code (128 + signal when killed by a signal)."""
    return 128 - returncode if returncode < 0 else returncode
