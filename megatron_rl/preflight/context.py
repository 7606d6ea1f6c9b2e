"""What the checks of one preflight share: the recipe, the directories, the trainer once it
is built, the generator pool once it runs, and the registry of named checks."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import RunConfig

# Free bytes the disk check believes instead of the filesystem's (a quota that statvfs does
# not report, or a test's fault).
FREE_BYTES_ENV = "MEGATRON_RL_PREFLIGHT_FREE_BYTES"


def free_bytes(path: Path) -> int:
    """Bytes free for this user at ``path`` (its nearest existing parent); ``$FREE_BYTES_ENV``
    overrides the filesystem's answer."""
    if os.environ.get(FREE_BYTES_ENV):
        return int(float(os.environ[FREE_BYTES_ENV]))
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


@dataclass(frozen=True)
class Outcome:
    """What a check returns: passed or not, the measured value and the limit as people read
    them, a message (why it failed, what to do), and the numbers behind them."""

    passed: bool
    value: str
    limit: str = ""
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class PreflightContext:
    """The state of one preflight on this rank. ``work_dir``: where the checks write (under
    the run directory, apart from the run's own files); ``main``: global rank 0 (it owns the
    generator pool, as in training)."""

    config: RunConfig
    run_dir: Path
    work_dir: Path
    main: bool = True
    free_bytes: Callable[[Path], int] = free_bytes
    run: Any = None  # megatron_rl.trainer.setup.Run, built by the "trainer" check
    optim: Any = None  # its megatron_rl.trainer.optim.Optimizer, built by the "trainer" check
    pool: Any = None  # the generator pool (main rank), started by the "engines" check
    measured: dict[str, Any] = field(default_factory=dict)  # shared between checks


@dataclass(frozen=True)
class Check:
    """One named check: ``run(context)`` on every trainer rank; ``needs``: checks that must
    have passed first (else this one is skipped)."""

    name: str
    run: Callable[[PreflightContext], Outcome]
    summary: str
    needs: tuple[str, ...] = ()
