"""Run metrics: ``RUN_DIR/metrics.jsonl`` (one JSON object per record) and TensorBoard
scalars (reading the file and the reward-curve plot: :mod:`megatron_rl.scaling.records`).

Every record carries ``step`` and ``gpu_hours`` (the compute axis of ``megatron-rl fit``);
training records carry ``reward_mean`` and the other per-step numbers, validation records
``val_pass_rate``. Each line is flushed when written, so a crash loses at most the line in
progress; on resume the file is cut back to the record count stored in the checkpoint
(``position()`` / ``truncate(n)``) so that no record is duplicated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.scaling.records import METRICS_FILE, read_records
from megatron_rl.trainer.metric_keys import is_known

if TYPE_CHECKING:
    from megatron_rl.trainer.tracking import WandbTracker

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"


def _plain(value: Any) -> Any:
    """JSON-ready value: tensor / numpy scalars to Python numbers, non-finite floats to None."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends records to ``RUN_DIR/metrics.jsonl`` and mirrors numbers to TensorBoard.

    Args:
        run_dir: the run directory (created if needed).
        tensorboard: also write scalars to ``RUN_DIR/tensorboard``.
        tracker: also mirror every record to an experiment tracker
            (:class:`megatron_rl.trainer.tracking.WandbTracker`), started by the first
            ``truncate`` (the run's start or resume) or record.
    """

    def __init__(
        self, run_dir: str | Path, tensorboard: bool = True, tracker: WandbTracker | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.tensorboard = tensorboard
        self.tracker = tracker
        self._writer: Any = None
        self._purge_step: int | None = None
        self._count = len(read_records(self.path)) if self.path.exists() else 0
        self._file = self._open()
        self._unregistered: set[str] = set()  # keys warned about (not in the registry)
        self._failed = False  # a write failed: the file's buffer holds what it could not write

    def _open(self):
        # A torn last line (crash mid-write) is dropped so the next record starts a line.
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:
                self._rewrite(self._count)
        return open(self.path, "a")

    def _rewrite(self, n: int) -> None:
        lines = []
        with open(self.path) as f:
            for line in f:
                if len(lines) == n or not line.endswith("\n"):
                    break
                lines.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(lines))
        os.replace(tmp, self.path)
        self._count = len(lines)

    def position(self) -> int:
        """Records written so far (store it in checkpoints)."""
        return self._count

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` records (on resume from a checkpoint taken at ``n``).

        TensorBoard events of later steps are purged by the next writer; the tracker, if
        any, starts here (rewound to the records kept). A file with fewer records (lost, or
        cut short by hand) is kept as it is, with a warning: the checkpoint, not the log,
        decides where a run resumes.
        """
        if n < 0:
            raise ValueError(f"cannot truncate {self.path} to {n} records")
        if n > self._count:
            logger.warning(
                "%s has %d records, the checkpoint expected %d: resuming anyway (the metrics "
                "of the missing records are lost)",
                self.path,
                self._count,
                n,
            )
            n = self._count
        self._file.close()
        self._rewrite(n)
        self._file = open(self.path, "a")
        records = read_records(self.path)
        self._purge_step = int(records[-1]["step"]) + 1 if records else 0
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.tracker is not None:
            if self.tracker.started:
                raise RuntimeError(f"{self.path}: truncated after the tracker started")
            self.tracker.start(records)

    def log(self, record: Mapping[str, Any]) -> None:
        """Append one record (must contain ``step``); numbers also go to TensorBoard."""
        if "step" not in record:
            raise ValueError(f"a metrics record needs 'step', got keys {sorted(record)}")
        plain = _plain(dict(record))
        self._check_keys(plain)
        line = json.dumps(plain, allow_nan=False) + "\n"
        with self._disk_full_said(f"{self.path.name} (the record of step {plain['step']})"):
            self._file.write(line)
            self._file.flush()
        self._count += 1
        if self.tensorboard:
            self._log_tensorboard(plain)
        if self.tracker is not None:
            if not self.tracker.started:
                self.tracker.start(read_records(self.path)[: self._count - 1])
            self.tracker.log(plain, self._count - 1)

    def _check_keys(self, record: Mapping[str, Any]) -> None:
        # docs/metrics.md is generated from the registry: a key without a description is
        # said once (never fatal: the record is kept) and fails the tests.
        for key in record:
            if key not in self._unregistered and not is_known(key):
                self._unregistered.add(key)
                logger.warning(
                    "metrics key %r is not in megatron_rl/trainer/metric_keys.py "
                    "(docs/metrics.md has no description of it)",
                    key,
                )

    def log_tensorboard(self, step: int, scalars: Mapping[str, float]) -> None:
        """Scalars for TensorBoard (and the tracker, in the row of the last record) only:
        series too many for ``metrics.jsonl`` (per layer)."""
        if self.tensorboard:
            self._log_tensorboard({**_plain(dict(scalars)), "step": step})
        if self.tracker is not None:
            self.tracker.log_extra(_plain(dict(scalars)))

    def _log_tensorboard(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(
                log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=self._purge_step
            )
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)

    def flush(self) -> None:
        """Flush the file and TensorBoard (before a checkpoint)."""
        with self._disk_full_said(self.path.name):
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._writer is not None:
            self._writer.flush()

    @contextlib.contextmanager
    def _disk_full_said(self, what: str):
        """A full disk while writing ``what`` raises an OSError that says so, naming the disk
        (it was a bare ``[Errno 28]``, or came first from the forked checkpoint writer's
        space running out, the checkpoint then dying unnamed)."""
        from megatron_rl.trainer.disk import FULL_DISK, full_disk_error

        try:
            yield
        except OSError as err:
            self._failed = True
            if err.errno not in FULL_DISK:
                raise
            raise full_disk_error(self.path, what, err, err.errno) from err

    def close(self) -> None:
        if self._failed:  # flushing the unwritten buffer fails again: closed all the same
            with contextlib.suppress(OSError):
                self._file.close()
        self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.tracker is not None:
            self.tracker.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
