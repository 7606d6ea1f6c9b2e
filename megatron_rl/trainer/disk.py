"""Which disk a path is on, and the error of a full one (checkpoints, metrics)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (for this user)."""
    return shutil.disk_usage(path).free


def describe(path: Path) -> str:
    """The file system ``path`` is on, in words: ``the ext4 file system /dev/sdb1 mounted at
    /scratch`` (its mount point and, where ``/proc/self/mounts`` says, device and type)."""
    mount = Path(os.path.abspath(path))
    while not mount.exists() and mount != mount.parent:
        mount = mount.parent
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    device = kind = None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and fields[1] == str(mount):
                    device, kind = fields[0], fields[2]  # the last mount there wins
    except OSError:  # not Linux
        pass
    if device is None:
        return f"the file system mounted at {mount}"
    return f"the {kind} file system {device} mounted at {mount}"


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


def full_disk_error(
    path: Path, what: str, err: BaseException | None = None, code: int = errno.ENOSPC
) -> OSError:
    """An OSError (``code``: ENOSPC, or EDQUOT for a quota) that says in words that writing
    ``what`` under ``path`` found the disk full, naming the disk and its free bytes."""
    directory = path if path.is_dir() else path.parent
    try:
        free = f"{free_bytes(directory)} bytes free"
    except OSError:
        free = "free space unknown"
    cause = f" ({type(err).__name__}: {err})" if err is not None else ""
    return OSError(
        code,
        f"{os.strerror(code)} while writing {what} under {directory} on "
        f"{describe(directory)} ({free}){cause}. Free space there, then resume",
    )
