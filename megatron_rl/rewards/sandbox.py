"""Run an untrusted Python program in a sandboxed subprocess, on one test or many.

One box per program (``ProgramSession``): the box and the harness's supervisor start once;
per test the supervisor forks a runner, which confines itself and runs the program once with
fresh stdin / stdout / stderr and its own CPU-time limit, under the parent's wall-clock
backstop. Starting the box once instead of per test is what brought the sandbox's cost per
test from 3x a plain ``python3`` start to about that of one (``tools/bench_code_reward.py``);
a runner costs a fork. A test that runs out of wall-clock time ends the box; the next test
gets a new one. Nothing of the expected outputs is ever on the program's side.

Layers, from the outside in:

1. OS box (``megatron_rl.rewards.isolation``): bubblewrap, started as an unprivileged user,
   with read-only binds of only the interpreter, its own pid / network / ipc namespaces and a
   private size-limited tmpfs as cwd. The program never runs as root. Without a box (no
   bwrap, no user namespaces) code rewards refuse to run unless the recipe opts into the
   unsafe mode (``code_allow_unsafe_sandbox``), where layers 2-7 are all there is; there
   the harness ends with the trainer (a parent-death signal) and removes its files.
2. Process: a fresh session / process group; on a wall-clock timeout the parent SIGKILLs the
   group, and again when the session ends. Killing bwrap ends the box: its init has
   ``--die-with-parent`` and a pid namespace ends with its init.
3. System calls: a seccomp filter on the runner (x86_64, aarch64) refuses new processes
   (fork, vfork, clone without CLONE_THREAD), exec, and access to other processes (ptrace,
   process_vm_readv/writev, pidfd_getfd). Threads are allowed: a worker thread with a larger
   stack is how programs recurse deeply. Where no filter can be set, RLIMIT_NPROC=1 (no
   process, no thread).
4. Time. A test's limit is CPU time (``code_test_timeout_s``), so that its verdict does not
   depend on the load on the machine: a CPU-time interval timer (``ITIMER_PROF``, whose
   SIGPROF ends the runner), RLIMIT_CPU a second past it (SIGXCPU, then SIGKILL), and the
   runner's CPU time as the kernel counts it (``wait4``), checked by the parent: a program
   that disarms its timers is still ``timeout_cpu``. A wall-clock backstop of the parent
   (``code_wall_timeout_s``) ends a program that waits without spending CPU time:
   ``timeout_wall``, which is no verdict on the program and is counted apart. Neither limit
   counts starting the box: the harness reports when it is ready, and the clocks start with
   the test.
5. Resources: RLIMIT_AS (memory; it also bounds the number of threads, each with its
   stack), RLIMIT_FSIZE (output and file sizes; the box's tmpfs holds
   ``code_max_output_bytes`` in all), RLIMIT_NOFILE, RLIMIT_CORE=0.
6. The report channel: stdin, stdout and stderr are anonymous files the parent opened and
   refills per test; the supervisor reports each test on a pipe, tagged with a nonce the
   parent drew for that test. The supervisor never runs model code, holds the only copies
   of the pipe and the nonce, and is not dumpable, so the program can reach neither (not
   through frames, ``/proc``, file descriptors or the environment). The parent reads a
   report defensively (bounded header, the nonce first, short digit fields, a capped body)
   and compares outputs itself.
7. Audit hook (``megatron_rl.rewards.guard``): refuses process creation, signals, sockets,
   ctypes, and writes outside the cwd. A second line only: CPython audit hooks are not a
   security boundary against code written to defeat them.

Functional tests pass their arguments and results as Python literals
(``megatron_rl.rewards.literals``): tuples, sets and non-string keys survive both ways.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from megatron_rl.rewards import guard, literals
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.isolation import BOX_DIR, as_user, box_for, source_fd

logger = logging.getLogger(__name__)

_MAX_STDERR_BYTES = 4096
# Starting a box (bwrap, the interpreter, the harness's imports): not counted against a test;
# a box that is not ready after this long (a machine far past its capacity) is timeout_wall.
_START_TIMEOUT_S = 120.0
# Signals of the CPU-time limits: the harness's ITIMER_PROF timer, RLIMIT_CPU's soft limit.
_CPU_SIGNALS = (signal.SIGPROF, signal.SIGXCPU)
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# CPU time a test may spend past its limit, by the kernel's count, before it is timeout_cpu
# although the program's timer did not end it: the harness's own work around the run (the
# timer covers the run only) and the 10 ms granularity of the count.
_CPU_MARGIN_S = 0.25
# Whether the harness installs the audit hook. Always on; tests switch it off to show that
# the OS box alone contains hostile programs (audit hooks can be defeated).
_AUDIT_HOOK = True

# The harness is a supervisor (argv = memory_mb fsize guard(0|1) control_in control_out
# parent_pid unsafe(0|1)) that forks one runner per test. The runner confines itself
# (resource limits, the seccomp filter, the audit hook) and runs the program once; its exit
# status and CPU time come from the kernel (``wait4``), whatever the program did to its own
# timers, and only the result of a functional test travels on a pipe the program could write
# on too (what it writes there is its own returned value in effect). Only the supervisor
# holds the parent's pipes and the nonces; it never runs model code and is not dumpable, so a
# runner can read neither its memory, nor its frames, nor its file descriptors.
#
# Parent -> supervisor, per test: "nonce cpu_ms fn_name\n" (fn_name empty: script mode; else
# the arguments, a Python literal, are the test's stdin). Supervisor -> parent: "nonce kind
# code length cpu_ms\n" + result ("L" literal | "R" repr of a value with no literal), kind
# "r" (code: the runner's exit code, as a fresh ``python3 main.py`` would give it, or minus
# the signal that ended it) or "b" (a result over the size limit: the runner was killed);
# cpu_ms: the runner's CPU time, all its threads, by the kernel's count.
_HARNESS_MAIN = r"""


def _limit(memory_mb, fsize, limit_s, threads):
    # The exact limit is the CPU-time timer (SIGPROF, default action: end the process);
    # RLIMIT_CPU (whole seconds) a second past it, in case the program disarms the timer.
    import resource
    import signal

    mem = memory_mb * 1024 * 1024
    soft = int(limit_s) + 2
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not threads:
        # No seccomp filter here: no process, and so no thread either.
        resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    os.umask(0o077)
    signal.signal(signal.SIGPROF, signal.SIG_DFL)
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_PROF, limit_s)


# seccomp: (AUDIT_ARCH, clone, clone3, denied system calls) per machine. Denied: fork, vfork,
# clone without CLONE_THREAD (a new process; a thread is allowed), exec, and reading or
# writing other processes (ptrace, process_vm_readv/writev, pidfd_getfd). clone3 fails with
# ENOSYS, which makes the C library fall back to clone for threads.
_SECCOMP = {
    "x86_64": (0xC000003E, 56, 435, (57, 58, 59, 322, 101, 310, 311, 438)),
    "aarch64": (0xC00000B7, 220, 435, (221, 281, 117, 270, 271, 438)),
}


def _seccomp_filter(machine):
    import struct

    spec = _SECCOMP.get(machine)
    if spec is None:
        return None
    arch, clone, clone3, denied = spec
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    # (code, jt, jf, k) with jt / jf naming a label, resolved to forward offsets below.
    code = [(0x20, 0, 0, 4), (0x15, 0, "kill", arch), (0x20, 0, 0, 0)]
    if machine == "x86_64":
        code.append((0x35, "eperm", 0, 0x40000000))  # x32 system calls
    code += [(0x15, "eperm", 0, nr) for nr in denied]
    code += [(0x15, "enosys", 0, clone3), (0x15, "clone", 0, clone), (0x06, 0, 0, allow)]
    labels = {"clone": len(code)}
    code += [(0x20, 0, 0, 16), (0x45, "allow", "eperm", 0x00010000)]  # flags & CLONE_THREAD
    for name, ret in (("allow", allow), ("eperm", eperm), ("enosys", enosys), ("kill", kill)):
        labels[name] = len(code)
        code.append((0x06, 0, 0, ret))
    out = b""
    for i, (op, jt, jf, k) in enumerate(code):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out += struct.pack("HBBI", op, jt, jf, k)
    return out


def _prctl():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    return ctypes, libc


def _die_with_parent(libc, parent, sig, orphaned=None):
    # PR_SET_PDEATHSIG; then the parent may already be gone (reparented): end now
    # (``orphaned()`` where given, else exit 1).
    libc.prctl(1, sig, None, 0, 0)
    if parent and os.getppid() != parent:
        (orphaned or (lambda: os._exit(1)))()


def _confine(ctypes, libc, program):
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP(SECCOMP_MODE_FILTER, program): for good.
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    if libc.prctl(38, 1, None, 0, 0) != 0:
        return False
    fprog = Program(len(program) // 8, program)
    return libc.prctl(22, 2, ctypes.cast(ctypes.byref(fprog), ctypes.c_void_p), 0, 0) == 0


def _exit_code(code, err):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    err.write(str(code) + "\n")
    return 1


def _run_one(source, name):
    namespace = {"__name__": "solution" if name else "__main__", "__builtins__": __builtins__}
    code = compile(source, "main.py", "exec")
    if not name:
        exec(code, namespace)
        return None
    args = decode(sys.stdin.read())
    # LeetCode-style solutions annotate with List / Optional and use deque / defaultdict
    # without importing them (the judge's environment has them; LiveCodeBench's and TACO's
    # graders prepend 'from typing import *', 'from collections import *' ...): a NameError
    # at the def line failed right programs. The program's own names override these.
    import collections
    import typing

    for module in (typing, collections):
        namespace.update((key, getattr(module, key)) for key in module.__all__)
    exec(code, namespace)
    owner = namespace.get("Solution")
    fn = getattr(owner(), name) if owner is not None and hasattr(owner, name) else namespace[name]
    return fn(*args)


def _join_threads():
    # As the interpreter does before a script ends (threading._shutdown: the threading
    # atexit calls, such as a thread pool's, then every non-daemon thread to its end):
    # ``threading.Thread(target=main).start()`` without a join, the usual way to recurse
    # deeply on a bigger stack, printed nothing when the runner ended at once.
    threading = sys.modules.get("threading")
    if threading is None:
        return
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
            return
        while True:
            me = threading.current_thread()
            pending = [t for t in threading.enumerate() if t is not me and not t.daemon]
            if not pending:
                return
            for thread in pending:
                thread.join()
    except BaseException:
        return


def _run_exit_functions():
    # Then, as the interpreter does, the script's atexit functions: a fast-output idiom
    # collects the output and writes it from one (nothing came out when the runner ended).
    atexit = sys.modules.get("atexit")
    if atexit is None:
        return
    try:
        atexit._run_exitfuncs()
    except BaseException:
        return


def _encode_result(value):
    try:
        return "L" + encode(value)
    except (ValueError, RecursionError):
        pass
    try:
        return "R" + repr(value)[:1000]
    except Exception:
        return "R<unprintable>"


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


def _runner(box, tools, request, result):
    # A forked runner: it confines itself, then waits for its test ("cpu_ms fn_name" on
    # ``request``; it was forked before the supervisor read the test's nonce, so it never
    # had it) and runs it; its exit code is the test's.
    source, memory_mb, fsize, hook, supervisor = box
    ctypes, libc, program = tools
    import signal

    _die_with_parent(libc, supervisor, signal.SIGKILL)
    confined = program is not None and _confine(ctypes, libc, program)
    for module in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[module]
    del ctypes, libc, tools
    sys.argv = ["main.py"]
    out, err = sys.stdout, sys.stderr
    if hook == 1:
        install_guard((os.getcwd(),))
    with open(request, "rb", closefd=False) as f:
        test = f.readline().decode().rstrip("\n")
    if not test:
        return 0  # the box ends
    limit_ms, _, name = test.partition(" ")
    _limit(memory_mb, fsize, max(int(limit_ms), 1) / 1000, threads=confined)
    code, value = 0, None
    try:
        value = _run_one(source, name)
    except SystemExit as exc:
        code = _exit_code(exc.code, err)
    except BaseException:
        import traceback

        traceback.print_exc(file=err)
        code = 1
    if not name:
        _join_threads()
        _run_exit_functions()
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, out, err)}.values():
        try:
            stream.flush()
        except BaseException:
            code = code or 120  # as CPython when flushing stdout at exit fails
    signal.setitimer(signal.ITIMER_PROF, 0)
    if name and code == 0:
        _write_all(result, _encode_result(value).encode())
    return code


def _read_result(fd, max_bytes):
    # The runner's result, to its end; None when over max_bytes (the caller kills it).
    chunks, size = [], 0
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes + 16:
            return None
        chunks.append(chunk)


_RM_ENV = {"PATH": "/usr/bin:/bin"}


def _sandbox_main():
    memory_mb, fsize, hook, control_in, control_out, parent, unsafe = map(int, sys.argv[1:8])
    import resource  # noqa: F401 - imported once here, not in every runner
    import signal

    cwd, me, runners = os.getcwd(), os.getpid(), []
    if unsafe:
        import shutil  # here, not in ``stop``: a second SIGTERM could land mid-import

    stopping = []

    def stop(*signum):
        # The trainer died (unsafe mode, where no box ends with it): end the runner, remove
        # the files. PR_SET_PDEATHSIG fires each time this process is reparented: first to
        # another thread of the dying trainer (the trainer is still our parent: ignored),
        # then to PID 1. A second SIGTERM while the first is handled returns at once; before,
        # it raised inside the first's rmtree and the files stayed.
        if stopping or (signum and os.getppid() == parent):
            return
        stopping.append(True)
        try:
            for pid in runners:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if unsafe:
                top = os.path.dirname(cwd)
                try:
                    shutil.rmtree(top, ignore_errors=True)
                except RecursionError:  # a tree deeper than the recursion limit
                    pass
                if os.path.lexists(top):
                    os.waitpid(os.posix_spawnp("rm", ["rm", "-rf", "--", top], _RM_ENV), 0)
        finally:
            os._exit(0)

    ctypes, libc = _prctl()
    if unsafe:
        # The handler before the parent-death signal (SIGTERM's default action left the
        # files), and a trainer already gone by then removes them too (it used to _exit(1)).
        signal.signal(signal.SIGTERM, stop)
        _die_with_parent(libc, parent, signal.SIGTERM, orphaned=stop)
    else:
        _die_with_parent(libc, parent, signal.SIGKILL)
    libc.prctl(4, 0, None, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, no /proc/<pid>/mem or fd
    tools = (ctypes, libc, _seccomp_filter(os.uname().machine))
    with open("main.py") as f:
        source = f.read()
    box = (source, memory_mb, fsize, hook, me)
    term = {signal.SIGTERM}

    def spawn():
        # The next test's runner, forked before its nonce is read (nothing of it is copied).
        request_r, request_w = os.pipe()
        result_r, result_w = os.pipe()
        if unsafe:
            # SIGTERM waits until the runner is in ``runners`` and has no ``stop`` of its own.
            signal.pthread_sigmask(signal.SIG_BLOCK, term)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                if unsafe:
                    # A runner dies of SIGTERM as ``python3 main.py`` does; with ``stop`` it
                    # exited 0 and removed the files of the box, which runs the next tests.
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, term)
                for fd in (control_in, control_out, request_w, result_r):
                    os.close(fd)
                code = _runner(box, tools, request_r, result_w)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(request_r)
        os.close(result_w)
        runners[:] = [pid]
        if unsafe:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, term)
        return pid, request_w, result_r

    pid, request_w, result_r = spawn()
    os.write(control_out, b"ready\n")  # the parent's clocks start with the first test
    control = open(control_in, "rb", buffering=0, closefd=False)
    while True:
        request = control.readline()
        if not request:
            stop()
        nonce, _, test = request.decode().rstrip("\n").partition(" ")
        request = None
        if not test.endswith(" "):
            import ast  # noqa: F401 - for functional tests' arguments, in the next runners
            import typing  # noqa: F401 - and their namespace (``_run_one``)
        try:
            _write_all(request_w, test.encode() + b"\n")
        except OSError:
            pass  # the runner is gone (a signal): its status says how
        os.close(request_w)
        body = _read_result(result_r, fsize)
        os.close(result_r)
        kind = "r"
        if body is None:
            os.kill(pid, signal.SIGKILL)
            kind, body = "b", b""
        _, status, usage = os.wait4(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        cpu_ms = int((usage.ru_utime + usage.ru_stime) * 1000)
        header = "%s %s %d %d %d\n" % (nonce, kind, code, len(body), cpu_ms)
        _write_all(control_out, header.encode() + body)
        nonce = header = body = None  # no nonce, not even a spent one, in the next runner
        pid, request_w, result_r = spawn()


_sandbox_main()
"""


@functools.cache
def _harness_source() -> str:
    # Without the modules' __future__ imports (they cost an import; 3.10+ needs none).
    parts = [
        Path(module.__file__).read_text().replace("from __future__ import annotations\n", "")
        for module in (guard, literals)
    ]
    return "\n".join(parts) + _HARNESS_MAIN


@dataclass
class SandboxResult:
    """Outcome of one run. ``status``: ok | failed (non-zero exit) | timeout_cpu (over its
    CPU-time limit) | timeout_wall (stopped by the wall-clock backstop: no verdict on the
    program) | error (the box failed). ``elapsed_s``: wall-clock time of the test, without
    starting the box; ``cpu_s``: CPU time the harness measured (None when it did not report)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    # Functional mode: the returned value, or ``Unrepresentable`` (no Python literal).
    result: object = None
    cpu_s: float | None = None


@dataclass(frozen=True)
class Unrepresentable:
    """A returned value with no Python literal (an object of the program's own class, NaN):
    equal to no expected value. ``text`` is its repr, for diagnostics."""

    text: str


def capabilities(config: RewardConfig) -> dict[str, object]:
    """What the sandbox enforces on this machine (runs one probe program).

    Returns ``isolation`` ("bwrap", or "unsafe": resource limits and audit hook only),
    ``python`` (the programs' interpreter), ``run_as_uid`` (the uid programs see),
    ``network`` and ``pids`` ("own" when the program's network / pid namespace differs
    from ours, else "shared").
    """
    box = box_for(config)
    probe = run_program(
        "import os\nprint(os.getuid())\n"
        "print(os.readlink('/proc/self/ns/net'))\nprint(os.readlink('/proc/self/ns/pid'))\n",
        "",
        config,
        timeout_s=30,
    )
    if probe.status != "ok":
        raise RuntimeError(f"sandbox probe failed: {probe.status} {probe.stderr[-500:]}")
    uid, net, pids = probe.stdout.split()[:3]
    return {
        "isolation": "bwrap" if box.isolated else "unsafe",
        "python": box.python,
        "run_as_uid": int(uid),
        "network": "own" if net != os.readlink("/proc/self/ns/net") else "shared",
        "pids": "own" if pids != os.readlink("/proc/self/ns/pid") else "shared",
    }


def _remove_tree(path: str) -> None:
    """Remove a box's directory (unsafe mode). ``shutil.rmtree`` recurses, one level per
    directory: on a tree deeper than the recursion limit (a program's ``os.mkdir('d');
    os.chdir('d')`` in a loop) it raised RecursionError here, which made the response's
    score an error and left the files; ``rm -rf`` removes what it left."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        pass
    if not os.path.lexists(path):
        return
    env = {"PATH": "/usr/bin:/bin"}
    try:
        subprocess.run(["rm", "-rf", "--", path], env=env, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("code sandbox: could not remove %s: %s", path, exc)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(
    source: str,
    stdin: str,
    config: RewardConfig,
    fn_name: str | None = None,
    timeout_s: float | None = None,
) -> SandboxResult:
    """Run ``source`` once in its own box: as a script (stdin -> stdout), or call
    ``fn_name`` with the arguments in ``stdin`` (a Python literal of their list; JSON
    arrays of numbers and strings are such literals). See ``ProgramSession``."""
    with ProgramSession(source, config) as session:
        return session.run(stdin, fn_name, timeout_s)


class ProgramSession:
    """One program in one box, run on any number of tests in turn (``run``).

    Args:
        source: the program.
        config: limits (``code_test_timeout_s`` per test, memory, output size) and the box.
        max_tests: how many tests it will run at most (unused: each test has its own process
            and CPU-time limit; kept for callers).

    Use as a context manager or call ``close()``. Raises ``SandboxUnavailableError`` where
    no box can be set up and the config does not allow the unsafe mode. Not thread-safe:
    one session per program being scored.
    """

    def __init__(self, source: str, config: RewardConfig, max_tests: int = 1) -> None:
        self.source = source
        self.config = config
        self.max_tests = max(1, max_tests)
        self.box = box_for(config)
        self.boxes_started = 0
        self._proc: subprocess.Popen | None = None
        self._files: list[IO[bytes]] = []
        self._control: tuple[int, int] | None = None  # (to the harness, from the harness)
        self._work: str | None = None
        self._ready = False  # whether the current box's harness said it was ready

    def __enter__(self) -> ProgramSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        stdin: str,
        fn_name: str | None = None,
        timeout_s: float | None = None,
        wall_timeout_s: float | None = None,
    ) -> SandboxResult:
        """Run the program on one test. In functional mode (``fn_name``) ``stdin`` is the
        argument list as a Python literal and ``SandboxResult.result`` the returned value.

        ``timeout_s`` (default ``config.code_test_timeout_s``) is the test's CPU-time limit
        (``timeout_cpu``); ``wall_timeout_s`` (default ``config.code_wall_timeout_s``, at
        least ``timeout_s``) its wall-clock backstop (``timeout_wall``). Neither counts
        starting the box when this test needs a new one."""
        timeout = self.config.code_test_timeout_s if timeout_s is None else timeout_s
        wall = self.config.code_wall_timeout_s if wall_timeout_s is None else wall_timeout_s
        wall = max(wall, timeout)
        if self._proc is None:
            self._start()
            if not self._wait_ready():
                self._stop()
                message = f"the sandbox did not start within {_START_TIMEOUT_S:.0f}s\n"
                return SandboxResult("timeout_wall", None, "", message, 0.0)
        assert self._proc is not None and self._control is not None
        started = time.monotonic()
        fin, fout, ferr = (f.fileno() for f in self._files)
        data = stdin.encode()
        os.ftruncate(fin, 0)
        os.pwrite(fin, data, 0)
        for fd in (fout, ferr):
            os.ftruncate(fd, 0)
        for fd in (fin, fout, ferr):
            os.lseek(fd, 0, os.SEEK_SET)
        nonce = secrets.token_hex(8)
        to_box, from_box = self._control
        limit_ms = max(1, round(timeout * 1000))
        try:
            os.write(to_box, f"{nonce} {limit_ms} {fn_name or ''}\n".encode())
        except OSError:  # the harness is gone (the program killed its supervisor)
            frame: Frame | str | None = None
        else:
            max_bytes = self.config.code_max_output_bytes
            frame = _read_frame(from_box, started + wall, max_bytes, nonce)
        elapsed = time.monotonic() - started
        if frame == "timeout":
            self._stop()
            return SandboxResult("timeout_wall", None, *self._outputs(), elapsed)
        if isinstance(frame, str):  # not the supervisor's report (cannot happen): no verdict
            self._stop()
            stdout, stderr = self._outputs()
            return SandboxResult("failed", None, stdout, f"{frame} test report\n", elapsed)
        if frame is None:
            # The supervisor ended without a report: the program killed it (a runner's own
            # end is reported), or the box failed to start.
            returncode = self._stop(grace_s=max(0.0, started + wall - time.monotonic()))
            stdout, stderr = self._outputs()
            status = "failed"
            if self.box.isolated and not self._ready and stderr.startswith("bwrap:"):
                # The box itself failed (the program never ran): not the program's fault.
                # Only before the harness said it was ready: after it, the program ran, and
                # its stderr may begin with "bwrap:" too (an error status for a program's
                # own doing would count against reward.max_error_fraction).
                logger.warning("code sandbox: bwrap failed: %s", stderr.strip()[:500])
                status = "error"
            return SandboxResult(status, returncode, stdout, stderr, elapsed)
        return self._verdict(frame, fn_name, timeout, elapsed)

    def _verdict(
        self, frame: Frame, fn_name: str | None, timeout: float, elapsed: float
    ) -> SandboxResult:
        """The result of a test from the supervisor's report (see ``_HARNESS_MAIN``)."""
        kind, code, cpu_s, body = frame
        stdout, stderr = self._outputs()
        if kind == "b":
            return SandboxResult("failed", None, stdout, "result too large\n", elapsed, None, cpu_s)
        status = "ok" if code == 0 else "failed"
        if fn_name and status == "ok" and not body:
            status = "failed"  # exited (os._exit) before returning a value
        # Over the limit by the kernel's count (the program outran its own timers), or ended
        # by a CPU-time signal.
        if cpu_s > timeout + _CPU_MARGIN_S or -code in _CPU_SIGNALS:
            status = "timeout_cpu"
        result = SandboxResult(status, code, stdout, stderr, elapsed, cpu_s=cpu_s)
        if fn_name and status == "ok":
            result.result = _decode_result(body)
        return result

    def _wait_ready(self) -> bool:
        """Wait for the harness's "ready" line; False when it is not ready in time. True as
        well when the harness ended first (the test then reports how it ended)."""
        assert self._control is not None
        from_box = self._control[1]
        deadline = time.monotonic() + _START_TIMEOUT_S
        data = b""
        while len(data) < len(b"ready\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([from_box], [], [], remaining)[0]:
                return False
            chunk = os.read(from_box, len(b"ready\n") - len(data))
            if not chunk:
                return True
            data += chunk
        self._ready = True
        return True

    def _outputs(self) -> tuple[str, str]:
        fout, ferr = self._files[1].fileno(), self._files[2].fileno()
        stdout = os.pread(fout, self.config.code_max_output_bytes, 0)
        stderr = os.pread(ferr, _MAX_STDERR_BYTES, 0)
        return (
            stdout.decode("utf-8", errors="replace"),
            stderr.decode("utf-8", errors="replace"),
        )

    def _start(self) -> None:
        config, box = self.config, self.box
        if not self._files:
            self._files = [tempfile.TemporaryFile(buffering=0) for _ in range(3)]
        to_box_read, to_box = os.pipe()
        from_box, from_box_write = os.pipe()
        limits = [config.code_memory_mb, config.code_max_output_bytes, 1 if _AUDIT_HOOK else 0]
        limits += [to_box_read, from_box_write]
        # Unsafe mode: the harness ends with this process, by its pid (the box does so by
        # itself: bwrap --die-with-parent), and removes its files.
        limits += [0, 0] if box.isolated else [os.getpid(), 1]
        argv = [box.python, "-I", "-c", _harness_source(), *map(str, limits)]
        # Single-threaded numeric libraries: thread creation counts against RLIMIT_NPROC.
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        env.update({name: "1" for name in _THREAD_VARS})
        main: int | None = None
        try:
            if box.isolated:
                env.update(HOME=BOX_DIR, TMPDIR=BOX_DIR)
                main = source_fd(self.source)
                command = box.command(argv, env, main, config.code_max_output_bytes)
                cwd, env, pass_fds = "/", {}, (main, to_box_read, from_box_write)
            else:
                cwd = self._unsafe_dir()
                env.update(HOME=cwd, TMPDIR=cwd)
                command, pass_fds = argv, (to_box_read, from_box_write)
            command, user = as_user(command, box.run_as)
            self._proc = subprocess.Popen(
                command,
                stdin=self._files[0],
                stdout=self._files[1],
                stderr=self._files[2],
                cwd=cwd,
                env=env,
                start_new_session=True,
                pass_fds=pass_fds,
                **user,
            )
        except BaseException:
            os.close(to_box)
            os.close(from_box)
            raise
        finally:
            for fd in (to_box_read, from_box_write) + ((main,) if main is not None else ()):
                os.close(fd)
        self._control = (to_box, from_box)
        self._ready = False
        self.boxes_started += 1

    def _unsafe_dir(self) -> str:
        # A fresh cwd per box: a program's files never reach its next box.
        if self._work is not None:
            _remove_tree(self._work)
        self._work = tempfile.mkdtemp(prefix="mrl-sandbox-")
        cwd = os.path.join(self._work, "box")
        os.mkdir(cwd, 0o700)
        Path(cwd, "main.py").write_text(self.source)
        if self.box.run_as is not None:
            # The harness removes the whole directory if this process dies first.
            for path in (self._work, cwd, os.path.join(cwd, "main.py")):
                os.chown(path, self.box.run_as, self.box.run_as)
        return cwd

    def _stop(self, grace_s: float = 0.0) -> int | None:
        """End the box (SIGKILL to its process group, after ``grace_s`` to exit by itself);
        its exit status."""
        if self._proc is None:
            return None
        proc, self._proc = self._proc, None
        if grace_s > 0:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid)
        returncode = proc.wait()
        _kill_group(proc.pid)
        if self._control is not None:
            for fd in self._control:
                os.close(fd)
            self._control = None
        return returncode

    def close(self) -> None:
        """End the box and release its files."""
        self._stop()
        for f in self._files:
            f.close()
        self._files = []
        if self._work is not None:
            _remove_tree(self._work)
            self._work = None


# A report: (kind, code, cpu_s, body), see ``_HARNESS_MAIN``.
Frame = tuple[str, int, float, bytes]
_HEADER_MAX = 128
_HEADER_RE = re.compile(rb"([rb]) (-?[0-9]{1,3}) ([0-9]{1,10}) ([0-9]{1,12})")


def _read_frame(fd: int, deadline: float, max_bytes: int, nonce: str) -> Frame | str | None:
    """One report of the supervisor, read defensively: the header is at most
    ``_HEADER_MAX`` bytes, its nonce is checked before anything else is read, then every
    field must be short ASCII digits and the body at most ``max_bytes`` (+16). "timeout" at
    ``deadline``, "forged" / "malformed" for a report that is not the supervisor's, None
    when the box ended first."""
    data = b""
    want: int | None = None
    frame: tuple[str, int, float] | None = None
    while want is None or len(data) < want:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timeout"
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            return "timeout"
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        data += chunk
        if want is None:
            end = data.find(b"\n", 0, _HEADER_MAX + 1)
            if end < 0:
                if len(data) > _HEADER_MAX:
                    return "malformed"
                continue
            line, data = data[:end], data[end + 1 :]
            got, _, rest = line.partition(b" ")
            if got != nonce.encode():
                return "forged"
            match = _HEADER_RE.fullmatch(rest)
            if match is None:
                return "malformed"
            kind, code, length, cpu_ms = match.groups()
            want = int(length)
            if want > max_bytes + 16:
                return "malformed"
            frame = (kind.decode(), int(code), int(cpu_ms) / 1000)
    assert frame is not None
    return (*frame, data[:want])


# Literal text beyond this is not parsed in the trainer (``ast`` holds ~50x the text size
# while it parses): the result scores wrong. JSON-compatible text (lists of numbers...) is
# read by ``json`` at any size up to the output limit.
_MAX_LITERAL_CHARS = 1 << 20


def _decode_result(body: bytes) -> object:
    """The returned value of a report's body, or ``Unrepresentable``: also for a literal
    nested deeper than the harness ever writes (``literals.MAX_DEPTH``), so that nothing
    deeper reaches the comparison."""
    text = body.decode("utf-8", errors="replace")
    if not text.startswith("L"):
        return Unrepresentable(text[1:])
    literal = text[1:]
    value: object = Unrepresentable(literal[:1000])
    try:
        # Where a literal's text is also JSON it means the same value (the encoder writes
        # no JSON-only spellings), and json reads it far faster and leaner.
        value = json.loads(literal)
    except (ValueError, RecursionError):  # RecursionError: nested past the interpreter's limit
        if len(literal) <= _MAX_LITERAL_CHARS:
            try:
                value = literals.decode(literal)
            except ValueError:
                pass
    if not _depth_within(value, literals.MAX_DEPTH + 1):
        return Unrepresentable(literal[:1000])
    return value


_CONTAINERS = (list, tuple, dict, set, frozenset)


def _depth_within(value: object, limit: int) -> bool:
    """Whether ``value``'s containers nest at most ``limit`` deep (level by level: no
    recursion on hostile depth)."""
    level = [value] if isinstance(value, _CONTAINERS) else []
    for _ in range(limit):
        below: list = []
        for item in level:
            if isinstance(item, dict):
                below += [k for k in item if isinstance(k, _CONTAINERS)]
                item = item.values()
            below += [child for child in item if isinstance(child, _CONTAINERS)]
        if not below:
            return True
        level = below
    return False
