"""An audit-hook guard for processes that handle hostile input (PEP 578 ``sys.addaudithook``).

Once installed (it cannot be removed) the guard makes these raise ``PermissionError``:
creating processes (fork, exec, spawn, ``subprocess``, ``os.system``), sending signals,
sockets, ctypes / foreign calls, ``gc`` introspection (the way back to the hook's state),
and any file-system write (open for writing, remove, rename, mkdir, chmod, links ...)
outside ``write_dirs``. Every blocked event is recorded, so a test can prove that nothing
was attempted, not merely that it failed.

It is a second line, and no security boundary (a program written to defeat it can: see
tests/unit/rewards/test_rewards_sandbox.py): math workers never evaluate model text, and sandboxed
programs run in an unprivileged bubblewrap box under resource limits
(``megatron_rl.rewards.isolation``, ``megatron_rl.rewards.sandbox``). This file is stdlib-only and self-contained: the
sandbox prepends its source to the harness that runs model programs.
"""

from __future__ import annotations

import os
import sys

_BLOCKED_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "subprocess.Popen",
        "pty.spawn",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys._current_frames",
        "sys.setprofile",
        "sys.settrace",
        "mmap.__new__",
    }
)
# Modules whose import is refused (the subprocess fork path without an audit event, FFI).
_BLOCKED_IMPORTS = frozenset({"_posixsubprocess", "ctypes", "_ctypes", "cffi", "_cffi_backend"})
_BLOCKED_PREFIXES = ("socket.", "ctypes.", "_ctypes.", "shutil.", "urllib.", "http.", "ftplib.")
# Events whose listed arguments are paths that get written.
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rename": (0, 1),
    "os.replace": (0, 1),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "os.chflags": (0,),
    "os.lchflags": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
}
# Creating links would let a later write escape the allowed directories.
_LINK_EVENTS = frozenset({"os.symlink", "os.link"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_ALWAYS_WRITABLE = ("/dev/null",)

_BLOCKED: list[str] = []


def blocked_events() -> list[str]:
    """Events the guard has refused in this process, oldest first."""
    return list(_BLOCKED)


def _make_refusal(roots: tuple[str, ...]):  # noqa: C901 - one closure keeps state private
    """The event check, with every name it uses bound in its closure.

    Binding here (not through module globals) means that code running after installation
    cannot switch the check off by rebinding this module's names.
    """
    blocked, prefixes, links = _BLOCKED_EVENTS, _BLOCKED_PREFIXES, _LINK_EVENTS
    path_events, write_flags, always = dict(_PATH_EVENTS), _WRITE_FLAGS, _ALWAYS_WRITABLE
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    renames = ("os.rename", "os.replace")
    blocked_imports = _BLOCKED_IMPORTS

    def inside(path: object) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor: its opening was checked
        try:
            real = realpath(fsdecode(path))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False
        return real in always or any(real == r or real.startswith(r + sep) for r in roots)

    def refusal(event: str, args: tuple) -> str | None:
        if event in blocked or event in links or event.startswith(prefixes):
            return event
        if event == "import":
            return f"import {args[0]}" if args[0] in blocked_imports else None
        if event == "open":
            mode, flags = args[1], args[2]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and bool(flags & write_flags)
            )
            return f"open for writing {args[0]!r}" if writes and not inside(args[0]) else None
        positions = path_events.get(event)
        if positions is None:
            return None
        dir_fds = args[2:4] if event in renames else (() if event == "os.truncate" else args[-1:])
        if any(fd not in (None, -1) for fd in dir_fds):
            return f"{event} with dir_fd"
        for position in positions:
            if not inside(args[position]):
                return f"{event} {args[position]!r}"
        return None

    return refusal


def install_guard(write_dirs: tuple[str, ...] = ()) -> None:
    """Install the guard in this process for good; writes are allowed under ``write_dirs``."""
    refusal = _make_refusal(tuple(os.path.realpath(d) for d in write_dirs))
    record = _BLOCKED.append

    def hook(event: str, args: tuple) -> None:
        reason = refusal(event, args)
        if reason is not None:
            record(reason)
            if event == "import":
                # ImportError, so that optional imports (numpy's of ctypes) degrade cleanly.
                raise ImportError(f"blocked by the reward sandbox: {reason}")
            raise PermissionError(f"blocked by the reward sandbox: {reason}")

    sys.addaudithook(hook)
