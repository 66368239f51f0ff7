"""Python sandbox: each hostile program ends within its limit with a clear observation and
leaves nothing behind (no process, no file outside its private working dir)."""
import dataclasses
import math
import os
import platform
import socket
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from car_jax.tools import _sandbox_memory, sandbox
from car_jax.tools.python_tool import (
    MAX_OBSERVATION_CHARS,
    PythonTool,
    extract_code,
    format_observation,
    truncate_middle,
)
from car_jax.tools.sandbox import SandboxConfig, SandboxError, run_python
from car_jax.tools import _sandbox_child as sandbox_child

CFG = SandboxConfig(timeout_s=3, memory_mb=512, max_procs=32)
ROOT = os.geteuid() == 0
# what this machine allows; where a namespace is missing the result must say so instead
NAMESPACES = set(sandbox.probe_isolation().names)
SECCOMP = platform.machine() in ("x86_64", "aarch64")
MEMORY = "memcg" if _sandbox_memory.memory_cgroup() else "memwatch"  # how the call's memory is bounded


@pytest.fixture
def traced(monkeypatch):
    """Runs the sandbox and checks afterwards that its temp dir is gone and that no process
    carrying that dir in its command line (the launcher and all its forks) is alive."""
    made = []
    real = sandbox.tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", mkdtemp)

    def run(code, config=CFG):
        result = run_python(code, config)
        hostdir = made[-1]
        assert not os.path.exists(hostdir), "temp dir left behind"
        strays = []
        for proc in psutil.process_iter(["cmdline", "uids", "status"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if hostdir in cmdline:
                strays.append((proc.pid, proc.info["status"], cmdline[:80]))
        assert not strays, f"processes left behind: {strays}"
        return result, format_observation(result, config)

    return run


def test_plain_program_and_final_answer(traced):
    result, obs = traced("import numpy as np, sympy\nprint(np.arange(4).sum())\nfinal_answer(sympy.sqrt(8))")
    assert result.ok and obs == "Code execution result: 6\n\\boxed{2*sqrt(2)}\n"
    namespaces = [n for n in ("net", "mount", "pid", "ipc") if n in NAMESPACES]
    assert result.isolation.split(",") == ["uid"] * ROOT + namespaces + ["seccomp"] * SECCOMP + [MEMORY]


def test_infinite_loop_hits_the_wall_clock(traced):
    result, obs = traced("while True:\n    pass")
    assert result.timed_out and result.exit_code is None and not result.ok
    assert obs == "Code execution result: TimeoutError: execution exceeded the time limit of 3 s"


def test_cpu_limit_kills_a_busy_program(traced):
    result, obs = traced("while True:\n    pass", SandboxConfig(timeout_s=60, cpu_s=1))
    assert not result.timed_out and result.exit_code == 128 + 24  # SIGXCPU
    assert obs == "Code execution result: killed by SIGXCPU (CPU time limit)"


def test_memory_bomb(traced):
    # The wall clock is not what this test checks, so it gets 30 s instead of CFG's 3: the bomb
    # faults in ~500 MB before RLIMIT_AS stops it (0.4-1.1 s here beside a training run), and on
    # a 2-core CI machine whose other test worker was busy it once ran past 3 s and timed out
    bomb = dataclasses.replace(CFG, timeout_s=30)
    result, obs = traced("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))", bomb)
    assert result.exit_code == 1 and obs == "Code execution result: MemoryError"


def test_process_flood_is_bounded(traced):
    code = ("import os, time\n"
            "for i in range(2000):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "print('forked all')\n")
    result, obs = traced(code)
    assert result.exit_code == 1 and "forked all" not in result.stdout
    assert obs == "Code execution result: BlockingIOError: [Errno 11] Resource temporarily unavailable"


FORK_AND_HOLD = """import os, time
big = bytearray(os.urandom(1)) * ({parent} << 20)  # touched, so resident; the children share it
ready_r, ready_w = os.pipe()
pids = []
for i in range({children}):
    pid = os.fork()
    if pid == 0:
        block = b"x" * ({each} << 20)
        os.write(ready_w, b".")
        time.sleep({hold})
        os._exit(0)
    pids.append(pid)
for _ in pids:
    os.read(ready_r, 1)  # from here on every child holds its block
print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
"""


@pytest.mark.parametrize("meter", ["auto", "watchdog"])
def test_forked_children_share_one_memory_bound(traced, monkeypatch, meter):
    if meter == "watchdog":  # the fallback where no memory cgroup can be made
        monkeypatch.setattr(sandbox, "open_meter", _sandbox_memory.TreeMeter)
    cfg = SandboxConfig(timeout_s=15, memory_mb=192, total_memory_mb=256, max_procs=32)
    # 4 x 80 MB, held until killed: each child is far below RLIMIT_AS, together they pass 256 MB
    result, obs = traced(FORK_AND_HOLD.format(parent=1, children=4, each=80, hold=60), cfg)
    assert result.memory_limited and not result.timed_out and not result.ok, result
    assert obs == "Code execution result: MemoryError: the program's processes together exceeded 256 MB"
    assert result.isolation.split(",")[-1] == (MEMORY if meter == "auto" else "memwatch")
    # pages shared after fork count once: 80 MB in the parent, seen by 3 children (320 MB of
    # summed RSS), plus 3 x 10 MB of their own, is well within 256 MB
    result, obs = traced(FORK_AND_HOLD.format(parent=80, children=3, each=10, hold=0.3), cfg)
    assert result.ok and obs == "Code execution result: [0, 0, 0]\n", result


UNMETERED = """import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno())  # IPC_PRIVATE, IPC_CREAT | 0600
print(libc.msgget(0, 0o1600), ctypes.get_errno())
print(libc.syscall(425, 8, ctypes.create_string_buffer(120)), ctypes.get_errno())  # io_uring_setup
fds = [os.memfd_create(f"m{i}") for i in range(128)]
for fd in fds:  # 16 MB each (RLIMIT_FSIZE), 2 GB in all, in no mapping of any process
    os.write(fd, bytes(16 << 20))
time.sleep(60)
"""


@pytest.mark.parametrize("meter", ["auto", "watchdog"])
def test_memory_no_meter_sees_is_refused(traced, monkeypatch, meter):
    if meter == "watchdog":  # PSS counts only mapped pages: memfd pages are not
        monkeypatch.setattr(sandbox, "open_meter", _sandbox_memory.TreeMeter)
    result, obs = traced(UNMETERED, SandboxConfig(timeout_s=10, memory_mb=192, total_memory_mb=256))
    if not SECCOMP:
        assert "seccomp" not in result.isolation
        return
    assert not result.timed_out and not result.memory_limited and result.exit_code == 1, result
    assert result.stdout.splitlines() == ["-1 1"] * 3
    assert obs == "Code execution result: PermissionError: [Errno 1] Operation not permitted"


def test_deep_recursion_reports_its_error_quickly(traced):
    code = """import sys
sys.setrecursionlimit(10**7)
print(sys.getrecursionlimit())
class A:
    def __repr__(self):
        return repr(A())  # recursion through C: each level costs C stack
try:
    repr(A())
except RecursionError as err:
    print('through C:', err)
def f(n):
    return g(n + 1)
def g(n):
    return f(n + 1)
f(0)
"""
    result, obs = traced(code)
    assert not result.timed_out and result.exit_code == 1, result
    assert result.stdout.startswith(f"{CFG.max_recursion}\nthrough C: maximum recursion depth exceeded")
    assert obs == "Code execution result: RecursionError: maximum recursion depth exceeded"
    # f and g alternate, so no frame repeats the one before and none is folded: a full
    # traceback (2 lines per frame) would pass the output cap; the last frames are printed
    assert result.stderr.count('File "main.py"') <= sandbox_child.TRACEBACK_FRAMES


def test_deep_recursion_through_c_has_the_stack_it_needs(traced):
    # sorted(key=...) puts ~5 KB of C stack between the Python frames: 8,000 levels (24,000
    # of the recursion limit) need ~40 MB, beyond the usual 8 MB main-thread stack (a
    # segfault there from 5,000 levels); deeper still, the RecursionError, not a segfault
    code = """import sys
sys.setrecursionlimit(10**6)
def f(n):
    return 0 if n == 0 else sorted([n], key=lambda _: f(n - 1))[0]
print(f(8_000))
try:
    f(20_000)
except RecursionError:
    print('RecursionError')
"""
    result, obs = traced(code)
    assert result.ok and obs == "Code execution result: 8000\nRecursionError\n", result


def test_printing_a_list_nested_past_the_cap_ends_in_its_error_not_the_timeout(traced):
    # repr of a list nested D deep costs ~D^2/2 in CPython (Py_ReprEnter): at a cap of
    # 100,000 it ran ~5 s, into the 3 s timeout of CFG; at the cap it ends in RecursionError
    code = """import sys
sys.setrecursionlimit(10**6)
x = []
for _ in range(10**6):
    x = [x]
try:
    print(len(repr(x)))
except RecursionError:
    print(sys.getrecursionlimit(), 'RecursionError')
"""
    result, obs = traced(code)
    assert not result.timed_out and result.ok, result
    assert result.stdout == f"{CFG.max_recursion} RecursionError\n"


def test_deep_recursion_in_a_thread_has_the_stack_it_needs(traced):
    # only the main thread's stack grows: a thread needs one sized for the recursion limit
    code = """import functools, sys, threading
sys.setrecursionlimit(10**6)
@functools.lru_cache(maxsize=None)
def depth(n):
    return 0 if n == 0 else depth(n - 1) + 1
class A:
    def __repr__(self):
        return repr(A())
def run():
    print(depth(14_000))  # a segfault in a thread with glibc's default stack
    try:
        repr(A())
    except RecursionError as err:
        print(type(err).__name__)
thread = threading.Thread(target=run)
thread.start()
thread.join()
more = [threading.Thread(target=threading.Event().wait, args=(0.2,)) for _ in range(6)]
[t.start() for t in more]  # past the big stacks' budget, threads still start (with 8 MB)
[t.join() for t in more]
print(len(more))
"""
    result, obs = traced(code)
    assert result.ok and result.stdout == "14000\nRecursionError\n6\n", result


def test_no_new_namespaces(traced):
    code = ("import ctypes, os, shutil, subprocess, threading\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "for flag in (0x10000000, 0x40000000 | 0x10000000, 0x20000):  # NEWUSER, NEWNET|NEWUSER, NEWNS\n"
            "    print(libc.unshare(flag), ctypes.get_errno())\n"
            "print(subprocess.run(['unshare', '-U', 'true']).returncode if shutil.which('unshare') else 1)\n"
            "t = threading.Thread(target=print, args=('thread ok',))\n"  # clone3 -> clone fallback
            "t.start(); t.join()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(7)\n"
            "print(subprocess.run(['true']).returncode, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    result, obs = traced(code)
    assert result.ok, result
    if not SECCOMP:  # no filter for this CPU: the run must say so
        assert "seccomp" not in result.isolation
        return
    assert "seccomp" in result.isolation.split(",")
    assert result.stdout.splitlines() == ["-1 1"] * 3 + ["1", "thread ok", "0 7"]


def _run_bpf(program, data: bytes) -> int:
    """A minimal classic-BPF interpreter (the opcodes the filter uses), as a reference."""
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # ld word at offset k
            acc = int.from_bytes(data[k:k + 4], "little")
        elif code == 0x06:  # ret k
            return k
        elif code == 0x54:  # acc &= k
            acc &= k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        pc += 1


@pytest.mark.parametrize("machine, arch, nrs", [
    ("x86_64", 0xC000003E, {"unshare": 272, "clone": 56, "clone3": 435, "setns": 308, "read": 0}),
    ("aarch64", 0xC00000B7, {"unshare": 97, "clone": 220, "clone3": 435, "setns": 268, "read": 63}),
])
def test_seccomp_program_decisions(machine, arch, nrs):
    # numbers from the kernel's syscall tables (x86_64: syscall_64.tbl; aarch64: asm-generic)
    program = sandbox_child.seccomp_program(machine)
    allow, eperm, enosys = 0x7FFF0000, 0x00050001, 0x00050026

    def decide(nr, flags=0, arch=arch):
        data = nr.to_bytes(4, "little") + arch.to_bytes(4, "little") + bytes(8) + flags.to_bytes(8, "little")
        return _run_bpf(program, data)

    sigchld, newuser, newns, thread = 17, 0x10000000, 0x20000, 0x3D0F00  # glibc's thread flags
    assert decide(nrs["clone"], sigchld) == decide(nrs["clone"], thread) == allow
    assert decide(nrs["clone"], sigchld | newuser) == decide(nrs["clone"], newns) == eperm
    assert decide(nrs["unshare"], 0x400) == allow  # CLONE_FILES: no namespace
    assert decide(nrs["unshare"], newuser) == decide(nrs["unshare"], 0x80) == eperm  # NEWTIME too
    assert decide(nrs["clone3"]) == enosys and decide(nrs["setns"]) == eperm
    assert decide(nrs["read"]) == allow
    assert decide(nrs["read"], arch=0x40000003) == eperm  # i386 ABI
    assert decide(0x40000000 + nrs["unshare"], newuser) == eperm  # x32 ABI numbering
    assert sandbox_child.seccomp_program("riscv64") is None


@pytest.mark.parametrize("machine, arch, nrs", [
    ("x86_64", 0xC000003E, {"socket": 41, "socketpair": 53, "memfd_create": 319, "shmget": 29,
                            "msgget": 68, "io_uring_setup": 425, "connect": 42, "shmat": 30}),
    ("aarch64", 0xC00000B7, {"socket": 198, "socketpair": 199, "memfd_create": 279, "shmget": 194,
                             "msgget": 186, "io_uring_setup": 425, "connect": 203, "shmat": 196}),
])
def test_seccomp_refuses_unix_sockets_and_unmetered_memory(machine, arch, nrs):
    program = sandbox_child.seccomp_program(machine)
    allow, eperm = 0x7FFF0000, 0x00050001

    def decide(nr, *args):  # seccomp_data: nr, arch, instruction pointer, six arguments
        words = [*args] + [0] * (6 - len(args))
        data = nr.to_bytes(4, "little") + arch.to_bytes(4, "little") + bytes(8)
        return _run_bpf(program, data + b"".join(w.to_bytes(8, "little") for w in words))

    unix, inet, inet6, netlink = 1, 2, 10, 16
    stream, dgram, raw, seqpacket, cloexec, nonblock = 1, 2, 3, 5, 0x80000, 0x800
    assert decide(nrs["socket"], unix, stream) == decide(nrs["socket"], unix, dgram | cloexec) == eperm
    assert [decide(nrs["socket"], family, stream) for family in (inet, inet6, netlink)] == [allow] * 3
    assert decide(nrs["socketpair"], unix, stream | cloexec | nonblock) == allow
    assert decide(nrs["socketpair"], unix, seqpacket) == allow
    assert decide(nrs["socketpair"], unix, dgram | cloexec) == decide(nrs["socketpair"], unix, raw) == eperm
    for name in ("memfd_create", "shmget", "msgget", "io_uring_setup"):
        assert decide(nrs[name]) == eperm, name
    assert decide(nrs["connect"], 3) == decide(nrs["shmat"], 0) == allow


def test_daemon_that_leaves_the_process_group_dies_too(traced):
    result, obs = traced("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')")
    assert result.ok and obs == "Code execution result: parent done\n"


def test_100_mb_of_output_is_capped(traced):
    result, obs = traced("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)")
    assert result.output_limited and not result.ok
    assert len(result.stdout) == CFG.max_output_bytes and set(result.stdout) == {"x"}
    assert obs == f"Code execution result: OutputLimitError: output exceeded {CFG.max_output_bytes} bytes"


def test_syntax_error(traced):
    result, obs = traced("def f(:\n    return 1")
    assert result.exit_code == 1 and obs == "Code execution result: SyntaxError: invalid syntax"
    assert 'File "main.py", line 1' in result.stderr


@pytest.mark.parametrize("code, error", [
    ("x = (" + "1 + " * 50_000 + "))\n", "SyntaxError: unmatched ')'"),  # the 200 KB line is echoed
    ("raise ValueError('x' * 10**6)", "ValueError: " + "x" * 138),
])
def test_a_huge_line_in_a_traceback_is_cut(traced, code, error):
    result, obs = traced(code)
    assert result.exit_code == 1 and not result.output_limited, result
    assert obs.startswith(f"Code execution result: {error}") and "chars cut" in result.stderr
    assert max(map(len, result.stderr.splitlines())) < 2 * sandbox_child.TRACEBACK_LINE_CHARS


def test_runtime_error_reports_last_stderr_line(traced):
    result, obs = traced("print('partial')\nimport sys\nprint('warning', file=sys.stderr)\n1 / 0")
    assert obs == "Code execution result: ZeroDivisionError: division by zero"
    assert 'File "main.py", line 4' in result.stderr and "_sandbox_child" not in result.stderr


def test_invalid_utf8_output_is_replaced(traced):
    result, obs = traced("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe bytes \\xc3\\xa9\\n')")
    assert result.ok and obs == "Code execution result: \ufffd\ufffd bytes \u00e9\n"


def test_writes_outside_the_work_dir_do_not_reach_the_host(traced, tmp_path):
    name = f"car_jax_escape_{uuid.uuid4().hex}"
    tmp_path.chmod(0o777)  # even a world-writable host dir must stay untouched
    code = (f"import errno, os\n"
            f"open('/tmp/{name}', 'w').write('x')\n"
            f"open('../{name}', 'w').write('x')\n"
            f"open(os.path.expanduser('~/{name}'), 'w').write('x')\n"
            f"for target in ['{tmp_path}/{name}', '{Path.cwd()}/{name}']:\n"
            f"    try:\n"
            f"        open(target, 'w').write('x')\n"
            f"        print('wrote', target)\n"
            f"    except OSError as err:\n"
            f"        print(errno.errorcode[err.errno])\n"
            f"print(os.getcwd())\n")
    result, obs = traced(code)
    assert result.ok, result.stderr
    if "mount" not in NAMESPACES:  # shared /tmp: the run must at least report it
        assert "mount" not in result.isolation
        return
    assert not Path("/tmp", name).exists() and not (tmp_path / name).exists()
    assert not (Path.cwd() / name).exists() and not Path("/var/tmp", name).exists()
    # host dirs are not visible in the private /tmp; every other filesystem is read-only
    out = result.stdout.split()
    assert out[0] == "ENOENT" and out[1] in ("EACCES", "EROFS") and out[2] == "/tmp/work"


def test_killing_the_parent_or_the_trainer_fails(traced):
    me = os.getpid()
    code = ("import os, signal\n"
            f"for pid in (os.getppid(), {me}, 1):\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as err:\n"
            "        print(pid, type(err).__name__)\n"
            "print('still here')\n")
    result, obs = traced(code)
    assert psutil.pid_exists(me)
    assert result.ok and result.stdout.strip().endswith("still here")


def test_no_network_not_even_loopback(traced):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        result, obs = traced(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
        if "net" not in NAMESPACES:  # no network namespace here: the run must report it
            assert "net" not in result.isolation
            return
        with pytest.raises(socket.timeout):
            listener.accept()
    assert "net" in result.isolation.split(",")
    assert obs == "Code execution result: OSError: [Errno 101] Network is unreachable"


UNIX_SOCKETS = """import asyncio, multiprocessing, socket
for kind, path in (('stream', {stream!r}), ('dgram', {dgram!r})):
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM if kind == 'stream' else socket.SOCK_DGRAM)
        s.connect(path)
        s.send(b'x')
        print(kind, 'sent')
    except OSError as err:
        print(kind, type(err).__name__)
try:  # a datagram pair can be re-connected, or sent from, to any path
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b'x', {dgram!r})
    print('pair sent')
except OSError as err:
    print('pair', type(err).__name__)
a, b = socket.socketpair()  # stream pairs still work: asyncio and multiprocessing use them
a.send(b'ok')
print(b.recv(2).decode(), asyncio.run(asyncio.sleep(0, 'asyncio')))
with multiprocessing.Pool(2) as pool:
    print(pool.map(abs, [-1, -2]))
"""


def test_unix_sockets_of_the_host_are_out_of_reach(traced):
    # a 0777 socket in the (read-only) host tree: the network namespace does not cover it
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent, prefix=".sock_") as where:
        os.chmod(where, 0o755)
        stream, dgram = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with stream, dgram:
            for sock, name in ((stream, "s"), (dgram, "d")):
                sock.bind(os.path.join(where, name))
                os.chmod(os.path.join(where, name), 0o777)
                sock.setblocking(False)
            stream.listen()
            result, obs = traced(UNIX_SOCKETS.format(stream=f"{where}/s", dgram=f"{where}/d"))
            if not SECCOMP:  # no filter for this CPU: the run must say so
                assert "seccomp" not in result.isolation
                return
            with pytest.raises(BlockingIOError):  # the program has ended: nothing came
                stream.accept()
            with pytest.raises(BlockingIOError):
                dgram.recv(1)
    assert result.ok, result
    assert result.stdout.splitlines() == ["stream PermissionError", "dgram PermissionError",
                                          "pair PermissionError", "ok asyncio", "[1, 2]"]


def test_scrubbed_environment_and_identity(traced, monkeypatch):
    monkeypatch.setenv("CAR_JAX_SECRET_TOKEN", "hunter2")
    result, _ = traced("import os, sys\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
                       "print(sorted(os.environ))\nprint(sys.stdin.read() == '')")
    ids, env, stdin_empty = result.stdout.splitlines()
    assert "CAR_JAX_SECRET_TOKEN" not in env and "hunter2" not in result.stdout
    assert stdin_empty == "True"
    if ROOT:
        assert ids == "65534 65534 []"


def test_code_too_long_and_none_isolation():
    result = run_python("x = 1\n" * 10, SandboxConfig(max_code_bytes=20))
    assert not result.ok and "CodeTooLong" in result.stderr
    closed = sandbox._closed_to_others([sandbox.sys.base_prefix])
    if ROOT and closed:  # nobody cannot enter the interpreter's dir and cannot be given access
        with pytest.raises(SandboxError, match="not readable by uid 65534"):
            run_python("print(1)", SandboxConfig(isolation="none"))
    else:
        result = run_python("print(1)", SandboxConfig(isolation="none"))
        assert result.ok and "net" not in result.isolation


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0])
def test_a_timeout_that_is_not_finite_and_positive_is_refused(bad):
    with pytest.raises(ValueError, match="timeout_s must be finite and > 0"):
        SandboxConfig(timeout_s=bad)
    with pytest.raises(ValueError, match="cpu_s must be finite and > 0"):
        SandboxConfig(cpu_s=bad)


def test_a_failed_setup_leaves_nothing_behind(monkeypatch):
    made, meters = [], []
    real_mkdtemp, real_meter = sandbox.tempfile.mkdtemp, sandbox.open_meter
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda *a, **k: made.append(real_mkdtemp(*a, **k)) or made[-1])
    monkeypatch.setattr(sandbox, "open_meter", lambda *a, **k: meters.append(real_meter(*a, **k)) or meters[-1])
    broken = SandboxConfig()
    object.__setattr__(broken, "timeout_s", math.nan)  # past the check: fails after setup began
    with pytest.raises(ValueError):
        run_python("print(1)", broken)
    assert made and not os.path.exists(made[0]), "temp dir left behind"
    if isinstance(meters[0], _sandbox_memory.CgroupMeter):
        assert not os.path.exists(meters[0].path), "memory cgroup left behind"


def test_extract_code_follows_simpletir():
    reply = "think\n```python\nprint(1)\n```\nmore\n```python\nprint(2)\n```"
    assert extract_code(reply) == "print(1)"
    assert extract_code("```py\nx = 2\nprint(x)\n```") == "x = 2\nprint(x)"
    assert extract_code("```\nprint(3)\n```") == "print(3)"
    assert extract_code("no code here \\boxed{4}") is None
    assert extract_code("```bash\nls\n```") is None


def test_truncate_middle():
    text = "".join(chr(65 + i % 26) for i in range(5000))
    cut = truncate_middle(text)
    assert len(cut) == MAX_OBSERVATION_CHARS and cut[:100] == text[:100] and cut[-100:] == text[-100:]
    assert "chars cut" in cut and truncate_middle("short") == "short"


def test_pool_runs_a_turn_concurrently():
    timed = [f"```python\nimport time\nt0 = time.time()\ntime.sleep(1)\nprint(t0, time.time(), {i})\n```"
             for i in range(4)]
    timed.insert(2, "I will answer directly: \\boxed{7}")
    with PythonTool(SandboxConfig(timeout_s=20), max_workers=4) as tool:
        results = tool.run([extract_code(r) for r in timed])
        observations = tool.observe(["```python\nprint(6 * 7)\n```", "\\boxed{7}", "```py\n1/0\n```"])
        as_tool = tool(["print('a')", "import sys; sys.exit(3)"])
    assert [r is None for r in results] == [False, False, True, False, False]
    spans = [[float(x) for x in r.stdout.split()] for r in results if r is not None]
    assert [int(span[2]) for span in spans] == [0, 1, 2, 3]  # order kept
    assert max(s[0] for s in spans) < min(s[1] for s in spans)  # all four slept at once
    assert observations == ["Code execution result: 42\n", None,
                            "Code execution result: ZeroDivisionError: division by zero"]
    assert as_tool == ["Code execution result: a\n", "Code execution result: exit status 3"]
