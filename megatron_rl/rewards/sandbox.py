"""Run an untrusted Python program in a sandboxed subprocess.

Layers, from the outside in (what is enforced depends on the machine; ``capabilities()``
reports it and the docs below say exactly when each applies):

1. Process: a fresh session / process group (``start_new_session``); on timeout the parent
   SIGKILLs the whole group, and it kills the group again after every run so no child
   outlives it. The wall-clock limit is the parent's; RLIMIT_CPU backs it up.
2. Resources: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (output and file sizes),
   RLIMIT_NOFILE, RLIMIT_CORE=0, RLIMIT_NPROC=1 (no fork, no threads; effective only for a
   non-root user: the kernel exempts uid 0 from RLIMIT_NPROC).
3. Files: cwd is a fresh temporary directory, deleted afterwards; stdin, stdout and stderr
   are files the parent opened in a directory the program is not given; nothing of the
   tests (expected outputs) is ever on the program's side.
4. User: when the parent is root and the configured uid can run this interpreter, the
   program runs as that uid (default 65534, nobody), so file permissions protect the rest
   of the system and RLIMIT_NPROC applies. When the interpreter is not reachable by that
   uid (e.g. a Python under /root), the program stays root and layers 5-6 carry the load.
5. Network: a new network namespace (no interfaces but a downed loopback) via unshare(2):
   CLONE_NEWNET as root, else CLONE_NEWUSER|CLONE_NEWNET where unprivileged user
   namespaces are enabled. Where neither works, only the audit hook blocks sockets.
6. Audit hook (``megatron_rl.rewards.guard``): refuses process creation, signals, sockets,
   ctypes, and writes outside the cwd. It stops ordinary programs (every test of
   tests/test_rewards_code.py), but CPython audit hooks are not a security boundary
   against code written to defeat them; for adversarial settings run the trainer in a
   container, as with any local execution sandbox.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.rewards import guard
from megatron_rl.rewards.config import RewardConfig

logger = logging.getLogger(__name__)

# Exit code of the harness when network isolation is required but impossible.
_NO_NAMESPACE_EXIT = 125
_MAX_STDERR_BYTES = 4096
_RESULT_MARKER = "\x00mrl-result\x00"

_HARNESS_MAIN = r"""
import json


def _isolate_network(mode):
    if mode == "audit":
        return "audit"
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    newnet, newuser = 0x40000000, 0x10000000
    if libc.unshare(newnet) == 0:
        result = "namespace"
    elif libc.unshare(newuser | newnet) == 0:
        result = "user-namespace"
    else:
        result = "audit"
    del libc
    for name in ("ctypes", "ctypes._endian"):
        sys.modules.pop(name, None)
    if result == "audit" and mode == "namespace":
        sys.stderr.write("sandbox: no network namespace available\n")
        os._exit(125)  # _NO_NAMESPACE_EXIT
    return result


def _limit(spec):
    import resource

    mem = spec["memory_mb"] * 1024 * 1024
    cpu = spec["cpu_s"]
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], spec["fsize"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
    if spec["uid"] is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    os.umask(0o077)


def _result_json(value):
    def default(obj):
        return sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else repr(obj)

    return json.dumps(value, default=default)


def _sandbox_main():
    spec = json.loads(sys.argv[1])
    _isolate_network(spec["network"])
    _limit(spec)
    install_guard((os.getcwd(),))
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    if spec["fn_name"] is None:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        return
    args = json.loads(sys.stdin.read())
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(code, namespace)
    name = spec["fn_name"]
    owner = namespace.get("Solution")
    fn = getattr(owner(), name) if owner is not None and hasattr(owner, name) else namespace[name]
    result = fn(*args)
    sys.stdout.flush()
    sys.stdout.write(spec["marker"] + _result_json(result) + "\n")


_sandbox_main()
"""


@functools.cache
def _harness_source() -> str:
    return Path(guard.__file__).read_text() + _HARNESS_MAIN


@dataclass
class SandboxResult:
    """Outcome of one run. ``status``: ok | failed (non-zero exit) | timeout | error."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    result: object = None  # functional mode: the returned value (JSON-decoded)


@functools.cache
def _uid_can_run(python: str, uid: int) -> bool:
    """Whether ``uid`` can start ``python`` and import the stdlib (checked once)."""
    if os.geteuid() != 0:
        return False
    try:
        probe = subprocess.run(
            [python, "-I", "-c", "import json, collections, heapq, fractions"],
            user=uid,
            group=uid,
            extra_groups=[],
            capture_output=True,
            timeout=30,
            cwd="/",
        )
    except (OSError, subprocess.SubprocessError):
        return False
    if probe.returncode != 0:
        logger.warning(
            "sandbox: uid %d cannot run %s; sandboxed programs keep the caller's uid (fork "
            "and writes are then refused by the audit hook only)",
            uid,
            python,
        )
    return probe.returncode == 0


def _python(config: RewardConfig) -> str:
    return config.python_executable or sys.executable


def capabilities(config: RewardConfig) -> dict[str, object]:
    """What the sandbox enforces on this machine (runs one probe program).

    Returns ``run_as_uid`` (the uid programs run as), ``network`` ("namespace" when the
    program's network namespace differs from ours, else "audit": sockets refused by the
    audit hook only) and ``nproc_limit_effective`` (False when programs run as root).
    """
    probe = run_program(
        "import os\nprint(os.getuid())\nprint(os.readlink('/proc/self/ns/net'))\n",
        "",
        config,
        timeout_s=30,
    )
    if probe.status != "ok":
        raise RuntimeError(f"sandbox probe failed: {probe.status} {probe.stderr[-500:]}")
    uid_line, ns_line = probe.stdout.split()[:2]
    own_ns = os.readlink("/proc/self/ns/net")
    return {
        "run_as_uid": int(uid_line),
        "network": "namespace" if ns_line != own_ns else "audit",
        "nproc_limit_effective": int(uid_line) != 0,
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
    ``config.code_test_timeout_s``.
    """
    timeout = config.code_test_timeout_s if timeout_s is None else timeout_s
    python = _python(config)
    uid = config.code_sandbox_uid if _uid_can_run(python, config.code_sandbox_uid) else None
    spec = {
        "network": config.code_network_isolation,
        "memory_mb": config.code_memory_mb,
        "cpu_s": int(timeout) + 1,
        "fsize": config.code_max_output_bytes,
        "uid": uid,
        "fn_name": fn_name,
        "marker": _RESULT_MARKER,
    }
    work = tempfile.mkdtemp(prefix="mrl-sandbox-")
    try:
        return _run_in(work, source, stdin, spec, python, timeout, config)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_in(
    work: str,
    source: str,
    stdin: str,
    spec: dict,
    python: str,
    timeout: float,
    config: RewardConfig,
) -> SandboxResult:
    box = os.path.join(work, "box")
    os.mkdir(box, 0o700)
    Path(box, "main.py").write_text(source)
    if spec["uid"] is not None:
        for path in (box, os.path.join(box, "main.py")):
            os.chown(path, spec["uid"], spec["uid"])
    Path(work, "stdin").write_text(stdin)
    env = {"PATH": "/usr/bin:/bin", "HOME": box, "TMPDIR": box, "LANG": "C.UTF-8"}
    # Single-threaded numeric libraries: thread creation counts against RLIMIT_NPROC.
    env.update(
        {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    )
    command = [python, "-I", "-c", _harness_source(), json.dumps(spec)]
    started = time.monotonic()
    with (
        open(os.path.join(work, "stdin"), "rb") as fin,
        open(os.path.join(work, "stdout"), "w+b") as fout,
        open(os.path.join(work, "stderr"), "w+b") as ferr,
    ):
        proc = subprocess.Popen(
            command, stdin=fin, stdout=fout, stderr=ferr, cwd=box, env=env, start_new_session=True
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
    if returncode == _NO_NAMESPACE_EXIT and "no network namespace" in stderr:
        raise RuntimeError("code_network_isolation='namespace' but no namespace can be made")
    result = SandboxResult(status, returncode, stdout, stderr, elapsed)
    if spec["fn_name"] is not None and status == "ok":
        result.stdout, _, payload = stdout.rpartition(spec["marker"])
        try:
            result.result = json.loads(payload)
        except ValueError:
            result.status = "error"
    return result
