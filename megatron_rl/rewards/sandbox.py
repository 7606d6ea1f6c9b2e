"""Run an untrusted Python program in a sandboxed subprocess.

Layers, from the outside in:

1. OS box (``megatron_rl.rewards.isolation``): bubblewrap, started as an unprivileged user,
   with read-only binds of only the interpreter, its own pid / network / ipc namespaces and a
   private size-limited tmpfs as cwd. The program never runs as root. Without a box (no
   bwrap, no user namespaces) code rewards refuse to run unless the recipe opts into the
   unsafe mode (``code_allow_unsafe_sandbox``), where layers 2-4 are all there is.
2. Process: a fresh session / process group; on timeout the parent SIGKILLs the group, and
   again after every run. Killing bwrap ends the box: its init has ``--die-with-parent``
   and a pid namespace ends with its init. The wall-clock limit is the parent's; RLIMIT_CPU
   backs it up.
3. Resources: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (output and file sizes; the box's
   tmpfs holds ``code_max_output_bytes`` in all), RLIMIT_NOFILE, RLIMIT_CORE=0 and
   RLIMIT_NPROC=1 (no fork, no threads; the kernel exempts only root from it).
4. Files: stdin, stdout and stderr are anonymous files the parent opened; nothing of the
   tests (expected outputs) is ever on the program's side.
5. Audit hook (``megatron_rl.rewards.guard``): refuses process creation, signals, sockets,
   ctypes, and writes outside the cwd. A second line only: CPython audit hooks are not a
   security boundary against code written to defeat them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.rewards import guard
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.isolation import BOX_DIR, Box, as_user, box_for, source_fd

logger = logging.getLogger(__name__)

_MAX_STDERR_BYTES = 4096
_RESULT_MARKER = "\x00mrl-result\x00"
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Whether the harness installs the audit hook. Always on; tests switch it off to show that
# the OS box alone contains hostile programs (audit hooks can be defeated).
_AUDIT_HOOK = True

# The harness: argv = memory_mb cpu_s fsize guard(0|1) fn_name(empty: script mode). It
# imports json only in functional mode: json pulls in re and enum, a third of a script's
# start-up time.
_HARNESS_MAIN = r"""


def _limit(memory_mb, cpu_s, fsize):
    import resource

    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    os.umask(0o077)


def _result_json(json, value):
    def default(obj):
        return sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else repr(obj)

    return json.dumps(value, default=default)


def _sandbox_main():
    memory_mb, cpu_s, fsize, hook, name = sys.argv[1:6]
    _limit(int(memory_mb), int(cpu_s), int(fsize))
    if hook == "1":
        install_guard((os.getcwd(),))
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    if not name:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        return
    import json

    args = json.loads(sys.stdin.read())
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(code, namespace)
    owner = namespace.get("Solution")
    fn = getattr(owner(), name) if owner is not None and hasattr(owner, name) else namespace[name]
    result = fn(*args)
    sys.stdout.flush()
    sys.stdout.write(MARKER + _result_json(json, result) + "\n")


_sandbox_main()
"""


@functools.cache
def _harness_source() -> str:
    # Without guard.py's __future__ import (it costs an import; annotations work on 3.10+).
    guard_source = (
        Path(guard.__file__).read_text().replace("from __future__ import annotations\n", "")
    )
    return guard_source + f"\nMARKER = {_RESULT_MARKER!r}\n" + _HARNESS_MAIN


@dataclass
class SandboxResult:
    """Outcome of one run. ``status``: ok | failed (non-zero exit) | timeout | error."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    result: object = None  # functional mode: the returned value (JSON-decoded)


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
    """Run ``source`` as a script (stdin -> stdout), or call ``fn_name`` with JSON args.

    In functional mode ``stdin`` is a JSON list of positional arguments and
    ``SandboxResult.result`` the returned value. ``timeout_s`` defaults to
    ``config.code_test_timeout_s``. Raises ``SandboxUnavailableError`` where no box can be
    set up and the config does not allow the unsafe mode.
    """
    timeout = config.code_test_timeout_s if timeout_s is None else timeout_s
    box = box_for(config)
    limits = [config.code_memory_mb, int(timeout) + 1, config.code_max_output_bytes]
    argv = [box.python, "-I", "-c", _harness_source(), *map(str, limits)]
    argv += ["1" if _AUDIT_HOOK else "0", fn_name or ""]
    # Single-threaded numeric libraries: thread creation counts against RLIMIT_NPROC.
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    env.update({name: "1" for name in _THREAD_VARS})
    if box.isolated:
        env.update(HOME=BOX_DIR, TMPDIR=BOX_DIR)
        main = source_fd(source)
        try:
            command = box.command(argv, env, main, config.code_max_output_bytes)
            return _run(command, stdin, "/", {}, (main,), box, timeout, config, fn_name)
        finally:
            os.close(main)
    work = tempfile.mkdtemp(prefix="mrl-sandbox-")
    try:
        cwd = os.path.join(work, "box")
        os.mkdir(cwd, 0o700)
        Path(cwd, "main.py").write_text(source)
        if box.run_as is not None:
            for path in (cwd, os.path.join(cwd, "main.py")):
                os.chown(path, box.run_as, box.run_as)
        env.update(HOME=cwd, TMPDIR=cwd)
        return _run(argv, stdin, cwd, env, (), box, timeout, config, fn_name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(
    command: list[str],
    stdin: str,
    cwd: str,
    env: dict[str, str],
    pass_fds: tuple[int, ...],
    box: Box,
    timeout: float,
    config: RewardConfig,
    fn_name: str | None,
) -> SandboxResult:
    started = time.monotonic()
    with (
        tempfile.TemporaryFile() as fin,
        tempfile.TemporaryFile() as fout,
        tempfile.TemporaryFile() as ferr,
    ):
        fin.write(stdin.encode())
        fin.seek(0)
        command, user = as_user(command, box.run_as)
        proc = subprocess.Popen(
            command,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
            **user,
        )
        status = "ok"
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            returncode, status = proc.wait(), "timeout"
        finally:
            _kill_group(proc.pid)
        elapsed = time.monotonic() - started
        fout.seek(0)
        stdout = fout.read(config.code_max_output_bytes).decode("utf-8", errors="replace")
        ferr.seek(0)
        stderr = ferr.read(_MAX_STDERR_BYTES).decode("utf-8", errors="replace")
    if status == "ok" and returncode != 0:
        status = "failed"
        if box.isolated and stderr.startswith("bwrap:"):
            # The box itself failed (the program never ran): not the program's fault.
            logger.warning("code sandbox: bwrap failed: %s", stderr.strip()[:500])
            status = "error"
    result = SandboxResult(status, returncode, stdout, stderr, elapsed)
    if fn_name is not None and status == "ok":
        result.stdout, _, payload = stdout.rpartition(_RESULT_MARKER)
        try:
            result.result = json.loads(payload)
        except ValueError:
            result.status = "error"
    return result
