"""Run an untrusted Python program in a sandboxed subprocess, on one test or many.

One box per program (``ProgramSession``): the box and the interpreter start once, and the
harness inside runs the program once per test, each run in a fresh namespace with fresh
stdin / stdout / stderr, its own CPU-time limit, and the parent's wall-clock backstop. A test
that times out or kills the interpreter ends that box; the next test gets a new one. The
program's later tests therefore share an interpreter with its earlier ones (imported
modules, ``sys`` settings): they are runs of the same program, and nothing of the expected
outputs is ever on its side. Starting the box once instead of per test is what brought the
sandbox's cost per test from 3x a plain ``python3`` start to about that of one
(``tools/bench_code_reward.py``).

Layers, from the outside in:

1. OS box (``megatron_rl.rewards.isolation``): bubblewrap, started as an unprivileged user,
   with read-only binds of only the interpreter, its own pid / network / ipc namespaces and a
   private size-limited tmpfs as cwd. The program never runs as root. Without a box (no
   bwrap, no user namespaces) code rewards refuse to run unless the recipe opts into the
   unsafe mode (``code_allow_unsafe_sandbox``), where layers 2-6 are all there is.
2. Process: a fresh session / process group; on a timeout the parent SIGKILLs the group,
   and again when the session ends. Killing bwrap ends the box: its init has
   ``--die-with-parent`` and a pid namespace ends with its init.
3. Time. A test's limit is CPU time (``code_test_timeout_s``), so that its verdict does not
   depend on the load on the machine: a CPU-time interval timer of the harness
   (``ITIMER_PROF``, whose SIGPROF ends the interpreter) set per test, RLIMIT_CPU a second
   past it (SIGXCPU, then SIGKILL at a hard limit for the whole box) in case the program
   disarms the timer. Either is ``timeout_cpu``. A wall-clock backstop of the parent
   (``code_wall_timeout_s``) ends a program that waits without spending CPU time:
   ``timeout_wall``, which is no verdict on the program and is counted apart. Neither limit
   counts starting the box: the harness reports when it is ready, and the clocks start with
   the test.
4. Resources: RLIMIT_AS (memory), RLIMIT_FSIZE (output and file sizes; the box's
   tmpfs holds ``code_max_output_bytes`` in all), RLIMIT_NOFILE, RLIMIT_CORE=0 and
   RLIMIT_NPROC=1 (no fork, no threads; the kernel exempts only root from it).
5. Files: stdin, stdout and stderr are anonymous files the parent opened and refills per
   test; the harness reports each test on a pipe, tagged with a nonce the parent drew for
   that test. Nothing of the tests (expected outputs) is ever on the program's side, and the
   comparison happens in the parent.
6. Audit hook (``megatron_rl.rewards.guard``): refuses process creation, signals, sockets,
   ctypes, and writes outside the cwd. A second line only: CPython audit hooks are not a
   security boundary against code written to defeat them.

Functional tests pass their arguments and results as Python literals
(``megatron_rl.rewards.literals``): tuples, sets and non-string keys survive both ways.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
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
# Whether the harness installs the audit hook. Always on; tests switch it off to show that
# the OS box alone contains hostile programs (audit hooks can be defeated).
_AUDIT_HOOK = True

# The harness: argv = memory_mb cpu_s fsize guard(0|1) control_in control_out max_tests
# (cpu_s: whole seconds, bounds the box's total CPU time). Once set up it writes "ready\n" on
# control_out. Per test it reads "nonce cpu_ms fn_name\n" from control_in (fn_name empty:
# script mode; else the arguments, a Python literal, are the test's stdin), runs the program
# under a CPU-time limit of cpu_ms and answers "nonce exit_code length cpu_ms\n" + result
# ("L" literal | "R" repr of a value with no literal) on control_out. An exception or a non-zero SystemExit is exit code 1 (or the exit code),
# with the traceback on the test's stderr, as a fresh ``python3 main.py`` would do.
_HARNESS_MAIN = r"""


def _limit(memory_mb, fsize, cpu_hard):
    import resource

    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_hard, cpu_hard))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    os.umask(0o077)
    return resource


def _cpu_used(resource):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_limit(resource, limit_s, cpu_hard):
    # The exact limit is the CPU-time timer (SIGPROF, default action: end the process);
    # RLIMIT_CPU (whole seconds) a second past it, in case the program disarms the timer.
    import signal

    used = _cpu_used(resource)
    soft = min(int(used + limit_s) + 2, cpu_hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_hard))
    signal.signal(signal.SIGPROF, signal.SIG_DFL)
    signal.signal(signal.SIGXCPU, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_PROF, limit_s)
    return used


def _streams(saved):
    # The parent refilled the files behind fds 0-2; fresh streams without stale buffers.
    for fd, copy in enumerate(saved):
        os.dup2(copy, fd)
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", closefd=False, errors="backslashreplace")
    sys.argv = ["main.py"]
    return sys.stdout, sys.stderr


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
    exec(code, namespace)
    owner = namespace.get("Solution")
    fn = getattr(owner(), name) if owner is not None and hasattr(owner, name) else namespace[name]
    return fn(*args)


def _encode_result(value):
    try:
        return "L" + encode(value)
    except (ValueError, RecursionError):
        pass
    try:
        return "R" + repr(value)[:1000]
    except Exception:
        return "R<unprintable>"


def _sandbox_main():
    memory_mb, cpu_s, fsize, hook, control_in, control_out, max_tests = map(int, sys.argv[1:8])
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    cpu_hard = (cpu_s + 3) * max_tests + 1
    resource = _limit(memory_mb, fsize, cpu_hard)
    if hook == 1:
        install_guard((os.getcwd(),))
    with open("main.py") as f:
        source = f.read()
    control = open(control_in, "rb", buffering=0, closefd=False)
    import gc
    import signal

    os.write(control_out, b"ready\n")  # the parent's clocks start with the first test
    while True:
        request = control.readline()
        if not request:
            return
        nonce, _, rest = request.decode().rstrip("\n").partition(" ")
        limit_ms, _, name = rest.partition(" ")
        started = _cpu_limit(resource, max(int(limit_ms), 1) / 1000, cpu_hard)
        out, err = _streams(saved)
        code, value = 0, None
        try:
            value = _run_one(source, name)
        except SystemExit as exc:
            code = _exit_code(exc.code, err)
        except BaseException:
            import traceback

            traceback.print_exc(file=err)
            code = 1
        for stream in {id(s): s for s in (sys.stdout, sys.stderr, out, err)}.values():
            try:
                stream.flush()
            except BaseException:
                code = code or 120  # as CPython when flushing stdout at exit fails
        signal.setitimer(signal.ITIMER_PROF, 0)
        spent_ms = int((_cpu_used(resource) - started) * 1000)
        body = _encode_result(value).encode() if name and code == 0 else b""
        value = None
        gc.collect()
        frame = ("%s %d %d %d\n" % (nonce, code, len(body), spent_ms)).encode() + body
        while frame:
            frame = frame[os.write(control_out, frame) :]


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
        max_tests: how many tests it will run at most (bounds the box's total CPU time).

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
            self._start(timeout)
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
        except OSError:  # the harness is gone (a signal the program's last test set up)
            frame: tuple[list[str], bytes] | str | None = None
        else:
            frame = _read_frame(from_box, started + wall, self.config.code_max_output_bytes)
        elapsed = time.monotonic() - started
        if frame == "timeout":
            self._stop()
            return SandboxResult("timeout_wall", None, *self._outputs(), elapsed)
        if frame == "too large":
            self._stop()
            stdout = self._outputs()[0]
            return SandboxResult("failed", None, stdout, "result too large\n", elapsed)
        if frame is None:  # the interpreter or the box ended: no report
            returncode = self._stop(grace_s=max(0.0, started + wall - time.monotonic()))
            stdout, stderr = self._outputs()
            status = "ok" if returncode == 0 else "failed"
            if _killed_by(returncode, self.box.isolated) in _CPU_SIGNALS:
                status = "timeout_cpu"
            elif self.box.isolated and stderr.startswith("bwrap:"):
                # The box itself failed (the program never ran): not the program's fault.
                logger.warning("code sandbox: bwrap failed: %s", stderr.strip()[:500])
                status = "error"
            if fn_name and status == "ok":
                status = "failed"  # exited (os._exit) before returning a value
            return SandboxResult(status, returncode, stdout, stderr, elapsed)
        header, body = frame
        got_nonce, code = header[0], int(header[1])
        stdout, stderr = self._outputs()
        if got_nonce != nonce:
            # Only the program can have written it (into the harness's pipe).
            self._stop()
            return SandboxResult("failed", None, stdout, "forged test report\n", elapsed)
        cpu_s = int(header[3]) / 1000
        status = "ok" if code == 0 else "failed"
        result = SandboxResult(status, code, stdout, stderr, elapsed, cpu_s=cpu_s)
        if fn_name and code == 0:
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
        return True

    def _outputs(self) -> tuple[str, str]:
        fout, ferr = self._files[1].fileno(), self._files[2].fileno()
        stdout = os.pread(fout, self.config.code_max_output_bytes, 0)
        stderr = os.pread(ferr, _MAX_STDERR_BYTES, 0)
        return (
            stdout.decode("utf-8", errors="replace"),
            stderr.decode("utf-8", errors="replace"),
        )

    def _start(self, timeout: float) -> None:
        config, box = self.config, self.box
        if not self._files:
            self._files = [tempfile.TemporaryFile(buffering=0) for _ in range(3)]
        to_box_read, to_box = os.pipe()
        from_box, from_box_write = os.pipe()
        cpu_s = math.ceil(max(timeout, config.code_test_timeout_s))
        limits = [config.code_memory_mb, cpu_s, config.code_max_output_bytes]
        limits += [1 if _AUDIT_HOOK else 0, to_box_read, from_box_write, self.max_tests]
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
        self.boxes_started += 1

    def _unsafe_dir(self) -> str:
        # A fresh cwd per box: a program's files never reach its next box.
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
        self._work = tempfile.mkdtemp(prefix="mrl-sandbox-")
        cwd = os.path.join(self._work, "box")
        os.mkdir(cwd, 0o700)
        Path(cwd, "main.py").write_text(self.source)
        if self.box.run_as is not None:
            for path in (cwd, os.path.join(cwd, "main.py")):
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
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None


def _read_frame(fd: int, deadline: float, max_bytes: int) -> tuple[list[str], bytes] | str | None:
    """One report of the harness: (header fields, body); "timeout" at ``deadline``; "too
    large" for a result over ``max_bytes``; None when the harness ended first."""
    data = b""
    want: int | None = None
    header: list[str] = []
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
        if want is None and b"\n" in data:
            line, _, data = data.partition(b"\n")
            header = line.decode("ascii", errors="replace").split()
            if (
                len(header) != 4
                or not header[1].lstrip("-").isdigit()
                or not header[2].isdigit()
                or not header[3].isdigit()
            ):
                header = ["", "1", "0", "0"]  # malformed (written by the program): no nonce
                return header, b""
            want = int(header[2])
            if want > max_bytes + 16:
                return "too large"
    return header, data[:want]


def _killed_by(returncode: int | None, isolated: bool) -> int | None:
    """The signal that ended the program: bwrap exits with 128 + the signal of its child;
    a program run without a box has Popen's negative return code."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if isolated and 128 < returncode < 128 + 65:
        return returncode - 128
    return None


# Literal text beyond this is not parsed in the trainer (``ast`` holds ~50x the text size
# while it parses): the result scores wrong. JSON-compatible text (lists of numbers...) is
# read by ``json`` at any size up to the output limit.
_MAX_LITERAL_CHARS = 1 << 20


def _decode_result(body: bytes) -> object:
    text = body.decode("utf-8", errors="replace")
    if text.startswith("L"):
        literal = text[1:]
        try:
            # Where a literal's text is also JSON it means the same value (the encoder writes
            # no JSON-only spellings), and json reads it far faster and leaner.
            return json.loads(literal)
        except ValueError:
            pass
        if len(literal) <= _MAX_LITERAL_CHARS:
            try:
                return literals.decode(literal)
            except ValueError:
                pass
        return Unrepresentable(literal[:1000])
    return Unrepresentable(text[1:])
