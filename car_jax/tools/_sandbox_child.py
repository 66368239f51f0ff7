"""Runs inside the sandbox process (standard library only; never imported by car_jax).

Invoked as `python -I -u -X utf8 _sandbox_child.py '<json settings>'` with the model's code
on stdin, usually under `unshare` and with the soft stack limit raised (see sandbox.py).
Steps, in order:
1. read the code from stdin, then point stdin at /dev/null;
2. join the call's memory cgroup when sandbox.py made one;
3. with a private mount namespace (we are root inside it): re-expose the Python installation
   if it sits under a directory the sandbox user may not enter (e.g. /root), remount every
   filesystem read-only, then mount fresh size-capped tmpfs on /tmp (the working dir is
   /tmp/work), /var/tmp and /dev/shm, so every write lands in memory that vanishes with the
   namespace;
4. resource limits (CPU seconds, address space, processes, file size, open files, no core);
5. no_new_privs, then drop to the sandbox uid/gid when one is given (the parent was root);
6. a seccomp filter (x86_64 and aarch64) that refuses new namespaces, Unix sockets that
   could reach a path, memfd / SysV memory and io_uring (see the comment above it);
7. report "ready" on the status pipe (" seccomp" appended when the filter is in place,
   " read-only-partial" when some filesystem refused the read-only remount) and close every
   other descriptor;
8. as PID 1 of a PID namespace, fork the program and reap until it ends (PID 1 ignores
   most signals, the program must not); otherwise run the program in this process.
The program runs as `__main__` from `main.py` with `final_answer(x)` predefined, with
`sys.setrecursionlimit` capped (see `_cap_recursion`) and its traceback cut to the last frames.
"""
import ctypes
import json
import operator
import os
import platform
import resource
import stat
import sys
import threading
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC, MS_RELATIME = 1024, 2048, 4096, 8192, 16384, 1 << 21
# statvfs f_flag bit -> mount flag, to keep each mount's flags when remounting it read-only
_KEEP = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
         os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED = 125
TRACEBACK_FRAMES = 50  # printed (the last ones) when the program fails
TRACEBACK_LINE_CHARS = 300  # a longer traceback line (source, caret, message) is cut
THREAD_STACK_BYTES = 8 << 20  # the usual default, and the least a thread gets
# C stack given to new threads per level of the recursion limit: C recursion costs 100-730
# bytes a level (lru_cache, __repr__, __eq__, __getattr__, map, json, pickle; measured on
# CPython 3.11 x86_64), more through a few calls (sorted with a key: ~5 KB)
THREAD_STACK_PER_LEVEL = 1024
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else str(s).encode()  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _blocked(path):
    """(first ancestor others cannot enter, its child on the way to path) or None."""
    parts = os.path.realpath(path).split(os.sep)[1:]
    current = "/"
    for name in parts:
        if not os.stat(current).st_mode & stat.S_IXOTH:
            return current, os.path.join(current, name)
        current = os.path.join(current, name)
    return None


def _expose_python(stash_dir):
    """Make the interpreter's directories enterable: tmpfs over each closed ancestor, with
    the needed child bind-mounted back read-only. Other contents of that ancestor vanish."""
    needed = {p for p in [sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]
              if os.path.isabs(p) and os.path.exists(p)}
    stash_count = 0
    for _ in range(4):  # nested closed directories are handled one level per round
        groups = {}
        for path in needed:
            hit = _blocked(path)
            if hit:
                groups.setdefault(hit[0], set()).add(hit[1])
        if not groups:
            return
        for ancestor, children in groups.items():
            stashes = []
            for child in sorted(children):
                stash = os.path.join(stash_dir, f".expose{stash_count}")
                stash_count += 1
                os.mkdir(stash)
                _mount(child, stash, None, MS_BIND | MS_REC)
                stashes.append((os.path.basename(child), stash))
            _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
            for name, stash in stashes:
                target = os.path.join(ancestor, name)
                os.mkdir(target)
                _mount(stash, target, None, MS_MOVE)
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    raise OSError(f"cannot make {sorted(needed)} readable for the sandbox user")


def _read_only_everything():
    """Remount every mount of this namespace read-only (kernel filesystems aside); returns
    the mount points that refused (possible inside an unprivileged user namespace)."""
    with open("/proc/self/mountinfo") as f:
        points = {line.split()[4].replace("\\040", " ") for line in f}
    refused = []
    for point in sorted(points):
        if point.split("/")[1] in ("proc", "sys", "dev"):
            continue  # private /proc; /sys is root-only; device nodes ignore read-only mounts
        try:
            flags = os.statvfs(point).f_flag
            keep = sum(ms for st, ms in _KEEP.items() if flags & st)
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            refused.append(point)
    return refused


SCRATCH = ("/tmp", "/var/tmp", "/dev/shm")


def _python_dirs():
    return [os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sys.path] if os.path.isabs(p)]


def _stash_python_in_scratch(stash_dir):
    """Before the read-only remount: bind-mount aside every child of a scratch dir that
    leads to the interpreter (a checkout under /tmp), so the scratch dir can still get a
    private tmpfs with those children mounted back. Returns [(scratch, name, stash)]."""
    stashes = []
    for scratch in SCRATCH:
        names = {p[len(scratch) + 1:].split("/")[0] for p in _python_dirs() if p.startswith(scratch + "/")}
        for name in sorted(names):
            if os.path.realpath(stash_dir).startswith(os.path.join(scratch, name)):
                raise OSError(f"the sandbox stash {stash_dir} lies inside {scratch}/{name}")
            stash = os.path.join(stash_dir, f".scratch{len(stashes)}")
            os.mkdir(stash)
            _mount(os.path.join(scratch, name), stash, None, MS_BIND | MS_REC)
            # the stash may itself sit under a scratch dir about to be covered: keep a
            # handle, and move the mount through /proc/self/fd later
            stashes.append((scratch, name, os.open(stash, os.O_PATH | os.O_DIRECTORY)))
    return stashes


def _private_scratch(cfg, stashes):
    """Fresh tmpfs on /tmp, /var/tmp, /dev/shm (interpreter dirs under them mounted back
    read-only from `stashes`); returns the working dir /tmp/work."""
    for scratch in SCRATCH:
        if not os.path.isdir(scratch):
            continue
        _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['disk_mb']}m")
        for where, name, handle in stashes:
            if where == scratch:
                target = os.path.join(scratch, name)
                os.mkdir(target)
                _mount(f"/proc/self/fd/{handle}", target, None, MS_MOVE)
                os.close(handle)
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    if cfg["uid"] is not None:
        os.chown(work, cfg["uid"], cfg["gid"])
    return work


def _limits(cfg):
    cpu, mem = cfg["cpu_s"], cfg["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_procs"], cfg["max_procs"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["max_file_mb"] << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _drop_privileges(cfg):
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if cfg["uid"] is None:
        return
    os.setgroups([])
    os.setgid(cfg["gid"])
    os.setuid(cfg["uid"])
    if os.getuid() != cfg["uid"] or os.geteuid() != cfg["uid"]:
        raise OSError(f"still uid {os.geteuid()} after setuid({cfg['uid']})")


# seccomp, refusing what the namespaces and meters do not cover:
# - new namespaces. A user namespace would make the program root of a fresh namespace (and
#   open the kernel code behind it); the others need privileges it lacks, and are refused
#   too. clone3 passes its flags in memory a filter cannot read: it answers ENOSYS, so the C
#   library falls back to clone, whose flags are checked.
# - Unix sockets that could reach the host: the network namespace does not cover sockets
#   bound to a path, and a read-only mount does not stop connect(). connect() and sendto()
#   carry the address in memory the filter cannot read, so the rule is on creation:
#   socket(AF_UNIX) fails, and socketpair() only makes stream and seqpacket pairs (a
#   datagram socket can be re-connected, or sent from, to any path).
# - memory no meter sees without a memory cgroup: memfd_create (pages of no mount and often
#   of no mapping), SysV shared memory and message queues (shmget, msgget).
# - io_uring_setup: io_uring runs socket operations this filter never sees.
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_*
_SYSCALLS = {  # from the kernel's tables (x86_64: syscall_64.tbl; aarch64: asm-generic)
    "x86_64": dict(unshare=272, clone=56, clone3=435, setns=308, socket=41, socketpair=53,
                   memfd_create=319, shmget=29, msgget=68, io_uring_setup=425),
    "aarch64": dict(unshare=97, clone=220, clone3=435, setns=268, socket=198, socketpair=199,
                    memfd_create=279, shmget=194, msgget=186, io_uring_setup=425),
}
REFUSED = ("setns", "memfd_create", "shmget", "msgget", "io_uring_setup")  # EPERM, whatever the arguments
CLONE_NEW_ANY = 0x7E020000  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET}
CLONE_NEWTIME = 0x80  # unshare only: in clone's flags this bit belongs to the exit signal
AF_UNIX, SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 1, 5, 0xF
X32_SYSCALL_BIT = 0x40000000
_LD_ABS, _AND, _JEQ, _JGE, _JSET, _RET = 0x20, 0x54, 0x15, 0x35, 0x45, 0x06  # BPF opcodes (32-bit)
_ALLOW, _ERRNO, EPERM, ENOSYS = 0x7FFF0000, 0x00050000, 1, 38


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _assemble(lines):
    """[(label, opcode, k, jump-if-true label, jump-if-false label)] -> sock_filter
    tuples; jumps name a later label (BPF jumps forward only), None = the next line."""
    where = {line[0]: i for i, line in enumerate(lines) if line[0]}
    rel = lambda i, target: 0 if target is None else where[target] - i - 1  # noqa: E731
    return [(op, rel(i, jt), rel(i, jf), k) for i, (_, op, k, jt, jf) in enumerate(lines)]


def seccomp_program(machine):
    """The filter for `machine` (platform.machine()), or None where it is not known.
    seccomp_data: nr at offset 0, arch at 4, args[0] (low 32 bits) at 16, args[1] at 24."""
    if machine not in _ARCH:
        return None
    nr = _SYSCALLS[machine]
    return _assemble([
        (None, _LD_ABS, 4, None, None),
        (None, _JEQ, _ARCH[machine], None, "deny"),  # another ABI (i386, int 0x80)
        (None, _LD_ABS, 0, None, None),
        (None, _JGE, X32_SYSCALL_BIT, "deny", None),  # the x32 ABI
        (None, _JEQ, nr["unshare"], "unshare", None),
        (None, _JEQ, nr["clone"], "clone", None),
        (None, _JEQ, nr["clone3"], "nosys", None),
        (None, _JEQ, nr["socket"], "socket", None),
        (None, _JEQ, nr["socketpair"], "socketpair", None),
        *[(None, _JEQ, nr[name], "deny", None) for name in REFUSED],
        (None, _RET, _ALLOW, None, None),
        ("unshare", _LD_ABS, 16, None, None),
        (None, _JSET, CLONE_NEW_ANY | CLONE_NEWTIME, "deny", "allow"),
        ("clone", _LD_ABS, 16, None, None),
        (None, _JSET, CLONE_NEW_ANY, "deny", "allow"),
        ("socket", _LD_ABS, 16, None, None),  # the domain
        (None, _JEQ, AF_UNIX, "deny", "allow"),
        ("socketpair", _LD_ABS, 24, None, None),  # the type, with SOCK_NONBLOCK / SOCK_CLOEXEC
        (None, _AND, SOCK_TYPE_MASK, None, None),
        (None, _JEQ, SOCK_STREAM, "allow", None),
        (None, _JEQ, SOCK_SEQPACKET, "allow", "deny"),
        ("allow", _RET, _ALLOW, None, None),
        ("nosys", _RET, _ERRNO | ENOSYS, None, None),
        ("deny", _RET, _ERRNO | EPERM, None, None),
    ])


def _install_seccomp():
    """Install the filter (needs no_new_privs, set before); False where the CPU is unknown."""
    program = seccomp_program(platform.machine())
    if program is None:
        return False
    insns = (_SockFilter * len(program))(*[_SockFilter(*line) for line in program])
    fprog = _SockFprog(len(program), insns)
    if _libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    return True


def _join_cgroup(procs_file):
    """Move this process (and so everything it starts) into the call's memory cgroup."""
    with open(procs_file, "w") as f:
        f.write("0")


def final_answer(result):
    """SimpleTIR's helper: print the answer as \\boxed{result}."""
    print(f"\\boxed{{{result}}}")


def _cap_recursion(cap):
    """Make `sys.setrecursionlimit` keep at most `cap`: a program asking for 10**7 gets a
    RecursionError after `cap` calls (quickly, with the C stack big enough for that depth)
    instead of recursing until the time limit or overflowing the C stack."""
    real = sys.setrecursionlimit

    def setrecursionlimit(limit):
        """sys.setrecursionlimit, kept at most at the sandbox's cap."""
        real(min(operator.index(limit), cap))

    sys.setrecursionlimit = setrecursionlimit


def _size_thread_stacks(budget):
    """Start each thread with a C stack for the recursion limit in force then (the main
    thread's grows as needed): THREAD_STACK_PER_LEVEL bytes a level, at least
    THREAD_STACK_BYTES. A stack is address space, counted in RLIMIT_AS though touched only
    as used, so the stacks above THREAD_STACK_BYTES take at most `budget` bytes in all;
    past it, or where the address space has no room left, a thread gets THREAD_STACK_BYTES
    (a deep C recursion in it may then still end in SIGSEGV). A size the program sets with
    threading.stack_size is used as it is. (Python >= 3.13 starts threads another way and
    bounds C recursion itself: there every thread gets THREAD_STACK_BYTES.)"""
    real_start, real_size = getattr(threading, "_start_new_thread", None), threading.stack_size
    state = {"own": None, "left": budget}

    def stack_size(size=0):
        """threading.stack_size; the program's own choice, used for every thread it starts."""
        state["own"] = size
        return real_size(size)

    def start_new_thread(function, args, kwargs={}):  # noqa: B006 - _thread's own signature
        size = min(sys.getrecursionlimit() * THREAD_STACK_PER_LEVEL, state["left"])
        if state["own"] is None and size > THREAD_STACK_BYTES:
            real_size(size)
            try:
                ident = real_start(function, args, kwargs)
                state["left"] -= size
                return ident
            except RuntimeError:  # "can't start new thread": no room for that stack
                pass
            finally:
                real_size(THREAD_STACK_BYTES)
        return real_start(function, args, kwargs)

    # with an unlimited stack limit glibc gives new threads 2 MB; keep the usual 8 MB
    real_size(THREAD_STACK_BYTES)
    if real_start is not None:
        threading.stack_size, threading._start_new_thread = stack_size, start_new_thread


def _run_program(source, cfg):
    with open("main.py", "wb") as f:  # so tracebacks can show source lines
        f.write(source)
    _cap_recursion(cfg["max_recursion"])
    _size_thread_stacks((cfg["memory_mb"] << 20) // 4)
    try:
        code = compile(source, "main.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__, "final_answer": final_answer})
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - report like the interpreter would
        tb = err.__traceback__.tb_next if err.__traceback__ else None  # hide this frame
        # the last frames only: a deep recursion leaves up to max_recursion of them; each
        # line cut, so that a huge source line or message cannot pass the output cap
        text = "".join(traceback.format_exception(type(err), err, tb, limit=-TRACEBACK_FRAMES))
        sys.stderr.write("\n".join(_cut(line) for line in text.split("\n")))
        sys.stderr.flush()
        raise SystemExit(1) from None


def _cut(line):
    """`line` with at most TRACEBACK_LINE_CHARS characters: head and tail around a marker."""
    if len(line) <= TRACEBACK_LINE_CHARS:
        return line
    keep = TRACEBACK_LINE_CHARS // 2
    return f"{line[:keep]}...[{len(line) - 2 * keep} chars cut]...{line[-keep:]}"


def _reap(child):
    """PID 1: wait for the program (reaping orphans), exit with its status."""
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main():
    cfg = json.loads(sys.argv[1])
    source = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    refused, filtered = [], False
    try:
        if cfg["cgroup_procs"]:
            _join_cgroup(cfg["cgroup_procs"])
        if cfg["mounts"]:
            if cfg["uid"] is not None:
                _expose_python(cfg["stash_dir"])
            stashes = _stash_python_in_scratch(cfg["stash_dir"])
            refused = _read_only_everything()
            work = _private_scratch(cfg, stashes)
        else:
            work = os.getcwd()
        os.chdir(work)
        os.environ.update(HOME=work, TMPDIR=work, MPLCONFIGDIR=work)
        _limits(cfg)
        _drop_privileges(cfg)
        filtered = _install_seccomp()
    except Exception as err:  # noqa: BLE001
        print(f"sandbox setup failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    os.write(cfg["status_fd"], b"ready" + b" seccomp" * filtered + b" read-only-partial" * bool(refused))
    os.closerange(3, 1 << 16)
    if os.getpid() == 1:
        try:
            child = os.fork()
        except BlockingIOError:  # process budget used up (shared per uid): run as PID 1
            child = 0
        if child:
            _reap(child)
    _run_program(source, cfg)


if __name__ == "__main__":
    main()
