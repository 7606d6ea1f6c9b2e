"""OS isolation of model-written programs: a bubblewrap box in which they never run as root.

The box is ``bwrap`` (Debian package ``bubblewrap``) started as an unprivileged user:

- User. A root trainer starts bwrap as ``code_sandbox_uid`` (65534, nobody, with no
  supplementary groups); bwrap then makes a user namespace that maps only that uid (the same
  number inside) and keeps no capability. A non-root trainer starts bwrap as itself. Starting
  bwrap as root with ``--unshare-user --uid 65534`` would not do: the namespace would map
  65534 to root outside, so the kernel would still see uid 0 (owner rights on root's files,
  no process-count limit). ``--disable-userns`` (bwrap >= 0.8): no nested user namespaces.
- Files. A new root holding read-only binds of only what the interpreter needs (its install
  prefixes, the shared-library directories, ``/etc/ld.so.cache``), a ``/proc`` of its own pid
  namespace, bwrap's minimal ``/dev`` (null, zero, urandom ...) read-only, and a private
  size-limited tmpfs ``/box`` (cwd, HOME and TMPDIR; it holds ``main.py``). Nothing of
  ``/root``, ``/home``, the rest of ``/etc``, ``/tmp`` or the run directory is there.
- Namespaces. pid (it sees and can signal only its own processes), network (no interface but
  a downed loopback), ipc, uts and cgroup.
- Process. ``--new-session`` (no terminal to inject into), ``--die-with-parent`` (the box
  ends with the process that started it), and an environment of a few fixed variables.

The harness inside (``megatron_rl.rewards.sandbox``) adds resource limits, a seccomp filter
(threads, no processes) and the audit hook. Where no box can be made (no bwrap, user
namespaces disabled), ``box_for`` refuses with ``SandboxUnavailableError``, unless the recipe
sets ``code_allow_unsafe_sandbox``: then programs run with the harness's layers only, which is
logged as a warning (and they end with the trainer: a parent-death signal).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

from megatron_rl.rewards.config import RewardConfig

logger = logging.getLogger(__name__)

# Mount point of the program's private tmpfs (its cwd, HOME and TMPDIR).
BOX_DIR = "/box"
# Shared libraries the interpreter links, where the system keeps them (symlinks on merged /usr).
_LIBRARY_DIRS = ("/lib", "/lib64", "/lib32", "/usr/lib", "/usr/lib64", "/usr/lib32")
_LINKER_FILES = ("/etc/ld.so.cache",)
_PROBE = "import collections, fractions, heapq, json, os\nprint(os.getuid())\n"
_INSTALL_HINT = (
    "install bubblewrap (`apt-get install bubblewrap`; tools/setup_venv.sh does it as root) and "
    "allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, and "
    "kernel.unprivileged_userns_clone=1 or kernel.apparmor_restrict_unprivileged_userns=0 where "
    "those exist)"
)
_UNSAFE_HINT = (
    "or set reward.code_allow_unsafe_sandbox=true to run model code with resource limits and a "
    "Python audit hook only (no security boundary)"
)


class SandboxUnavailableError(RuntimeError):
    """No OS isolation can be set up here and the recipe did not opt into the unsafe mode."""


@dataclass(frozen=True)
class Box:
    """How sandboxed programs are started.

    Attributes:
        python: interpreter of the programs (same path inside the box as outside).
        bwrap: the bubblewrap executable; None in the unsafe mode (no OS isolation).
        run_as: uid (and gid) the program or bwrap is started as (``as_user``); None keeps
            the caller's (a non-root trainer).
        uid: uid (and gid) of the program inside the box.
        binds: host paths bound read-only at the same place in the box.
        links: ``(target, path)`` symlinks made in the box (merged-/usr layouts).
        disable_userns: bwrap supports ``--disable-userns`` (>= 0.8).
        unsafe_reason: why there is no box (unsafe mode only).
    """

    python: str
    bwrap: str | None
    run_as: int | None
    uid: int = 65534
    binds: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    disable_userns: bool = False
    unsafe_reason: str = ""

    @property
    def isolated(self) -> bool:
        return self.bwrap is not None

    def command(
        self, argv: list[str], env: dict[str, str], main_fd: int, box_bytes: int
    ) -> list[str]:
        """The bwrap command line running ``argv`` in a fresh box whose ``/box/main.py``
        is copied from ``main_fd`` and whose ``/box`` holds at most ``box_bytes``."""
        assert self.bwrap is not None, "no box in the unsafe mode"
        command = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net"]
        command += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if self.disable_userns:
            command.append("--disable-userns")
        uid = str(self.uid)
        command += ["--uid", uid, "--gid", uid, "--die-with-parent", "--new-session"]
        command.append("--clearenv")
        for name, value in env.items():
            command += ["--setenv", name, value]
        for path in self.binds:
            command += ["--ro-bind", path, path]
        for target, path in self.links:
            command += ["--symlink", target, path]
        command += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        command += ["--size", str(box_bytes), "--tmpfs", BOX_DIR, "--chdir", BOX_DIR]
        command += ["--file", str(main_fd), f"{BOX_DIR}/main.py", "--remount-ro", "/"]
        return [*command, "--", *argv]


def box_for(config: RewardConfig, announce: bool = False) -> Box:
    """The box of ``config`` (probed once per process and setting).

    Raises ``SandboxUnavailableError`` when no isolation can be set up and
    ``config.code_allow_unsafe_sandbox`` is off. In the unsafe mode a warning is logged the
    first time and whenever ``announce`` is set (each reward pool start).
    """
    key = _key(config)
    box = _resolve(*key)
    if not box.isolated and (announce or key not in _announced):
        _announced.add(key)
        logger.warning(
            "UNSAFE CODE SANDBOX (reward.code_allow_unsafe_sandbox=true): model-written "
            "programs run %s with resource limits and a Python audit hook only, which is no "
            "security boundary; %s. To isolate them: %s.",
            f"as uid {box.uid}" + (" (ROOT)" if box.uid == 0 else ""),
            box.unsafe_reason,
            _INSTALL_HINT,
        )
    return box


_announced: set[tuple] = set()


def _key(config: RewardConfig) -> tuple[str, str, int, bool]:
    return (
        config.code_bwrap,
        config.python_executable,
        config.code_sandbox_uid,
        config.code_allow_unsafe_sandbox,
    )


@functools.cache
def _resolve(bwrap_name: str, python: str, uid: int, allow_unsafe: bool) -> Box:
    run_as = uid if os.geteuid() == 0 else None
    reasons: list[str] = []
    bwrap = shutil.which(bwrap_name) if bwrap_name else None
    if bwrap is None:
        reasons.append(f"bubblewrap ({bwrap_name!r}) is not installed")
    else:
        version = _bwrap_version(bwrap)
        for candidate in _interpreters(python):
            box = _try_box(bwrap, version, candidate, run_as, uid, reasons)
            if box is not None:
                if candidate != (python or sys.executable):
                    logger.info(
                        "code sandbox: programs run with %s (%s)", candidate, "; ".join(reasons)
                    )
                return box
    reason = "; ".join(reasons)
    if not allow_unsafe:
        raise SandboxUnavailableError(
            f"code rewards need an OS sandbox for model-written programs and none can be set "
            f"up here: {reason}. To fix: {_INSTALL_HINT}, {_UNSAFE_HINT}."
        )
    # Unsafe mode: still not root where the sandbox uid can run one of the interpreters.
    candidates = _interpreters(python)
    if run_as is not None:
        for candidate in candidates:
            if _uid_can_run(candidate, run_as):
                return Box(candidate, None, run_as, uid, unsafe_reason=reason)
    return Box(candidates[0], None, None, os.geteuid(), unsafe_reason=reason)


def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return (0,)
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout)
    return tuple(int(part or 0) for part in match.groups()) if match else (0,)


def _interpreters(python: str) -> list[str]:
    """``python`` when configured; else this interpreter, its base interpreter (outside a
    venv), then the system's interpreter of the same version (one the sandbox user can
    reach when ours lives under /root)."""
    if python:
        return [python]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, getattr(sys, "_base_executable", "")]
    candidates.append(shutil.which(version, path="/usr/bin:/usr/local/bin:/bin") or "")
    return list(dict.fromkeys(c for c in candidates if c))


def _try_box(
    bwrap: str,
    version: tuple[int, ...],
    python: str,
    run_as: int | None,
    uid: int,
    reasons: list[str],
) -> Box | None:
    """A box for ``python`` if a probe program runs in it, not as root; else None (and why)."""
    try:
        binds, links = _mounts(python)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        reasons.append(f"{python}: {exc}")
        return None
    box = Box(python, bwrap, run_as, uid, binds, links, disable_userns=version >= (0, 8))
    main = source_fd(_PROBE)
    env = {"PATH": "/usr/bin:/bin", "HOME": BOX_DIR, "LANG": "C.UTF-8"}
    command, user = as_user(box.command([python, "-I", "main.py"], env, main, 1 << 20), run_as)
    try:
        probe = subprocess.run(
            command, capture_output=True, text=True, timeout=60, cwd="/", pass_fds=(main,), **user
        )
    except (OSError, subprocess.SubprocessError) as exc:
        reasons.append(f"{python}: the box does not start ({exc})")
        return None
    finally:
        os.close(main)
    if probe.returncode != 0:
        detail = probe.stderr.strip().splitlines()[-1:] or [f"exit {probe.returncode}"]
        reasons.append(f"{python}: the box does not start ({detail[0][:300]})")
        return None
    if probe.stdout.strip() == "0":
        reasons.append(f"{python}: the program would run as root in the box")
        return None
    return box


@functools.cache
def _mounts(python: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Read-only binds and symlinks the interpreter needs: its prefixes (a venv and the
    Python it was made from) and the system's shared-library directories."""
    layout = subprocess.run(
        [
            python,
            "-I",
            "-c",
            "import sys\nfor p in (sys.prefix, sys.base_prefix, "
            "sys.exec_prefix, sys.base_exec_prefix): print(p)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    if layout.returncode != 0:
        raise ValueError(f"cannot run it: {layout.stderr.strip()[-300:]}")
    paths = [os.path.realpath(p) for p in layout.stdout.split()]
    paths.append(os.path.dirname(os.path.realpath(python)))
    if os.path.realpath(python) != os.path.abspath(python):
        paths.append(os.path.dirname(os.path.abspath(python)))
    if "/" in paths:
        raise ValueError("its prefix is / (binding it would expose the whole file system)")
    links: list[tuple[str, str]] = []
    for path in _LIBRARY_DIRS:
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path):
            paths.append(path)
    paths += [p for p in _LINKER_FILES if os.path.exists(p)]
    return _outermost(paths), tuple(links)


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """``paths`` without duplicates and without those inside another one."""
    unique = sorted(set(paths))
    return tuple(
        p for p in unique if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in unique)
    )


def source_fd(source: str) -> int:
    """An anonymous in-memory file holding ``source``, positioned at its start (for
    ``Box.command``'s ``main_fd``; the caller closes it)."""
    fd = os.memfd_create("main.py")
    with open(fd, "wb", closefd=False) as f:
        f.write(source.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def as_user(command: list[str], run_as: int | None) -> tuple[list[str], dict[str, object]]:
    """``(command, Popen keyword arguments)`` that run ``command`` as ``run_as`` (uid and
    gid, no supplementary groups, no capabilities, no new privileges); unchanged for None.

    Why ``setpriv`` (util-linux) rather than Popen's ``user=``: CPython starts a child with
    ``vfork`` unless it must change the uid, gid or groups itself; then it makes a full
    ``fork`` of the caller, whose page tables are copied and torn down again at ``exec``.
    Measured in the math+code CPU run (a 2.3 GB trainer starting one program per test):
    ~60% of the trainer's CPU went to ``copy_page_range`` / ``exit_mmap``. ``setpriv``
    switches after the (v)fork, in a process of its own. Without it, ``user=`` is used.
    """
    if run_as is None:
        return command, {}
    setpriv = _setpriv()
    if setpriv is None:
        return command, {"user": run_as, "group": run_as, "extra_groups": []}
    ids = [f"--reuid={run_as}", f"--regid={run_as}", "--clear-groups", "--no-new-privs"]
    return [setpriv, *ids, "--", *command], {}


@functools.cache
def _setpriv() -> str | None:
    return shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")


@functools.cache
def _uid_can_run(python: str, uid: int) -> bool:
    """Whether ``uid`` can start ``python`` and import the stdlib (unsafe mode, checked once)."""
    command, user = as_user([python, "-I", "-c", _PROBE], uid)
    try:
        probe = subprocess.run(command, capture_output=True, timeout=30, cwd="/", **user)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0
