"""Weights & Biases tracking that survives requeues (main rank only).

``logging.wandb.mode: online | offline`` mirrors every record of ``RUN_DIR/metrics.jsonl`` into
one W&B run for the life of the run directory, whatever the number of jobs it takes:

- **One run.** The W&B run id is kept in ``RUN_DIR/wandb/megatron_rl_run.json``; a resumed or
  requeued job continues that run, never a new one (``--restart`` moves ``RUN_DIR/wandb``
  aside with the rest of the history, and the next start opens a new W&B run).
- **Every record once.** The W&B step (``_step``) of a record is its index in
  ``metrics.jsonl``. On resume the metrics file is cut back to the checkpoint's record count
  n (``MetricsLogger.truncate``); the run is then reopened with W&B's rewind,
  ``wandb.init(resume_from=f"{id}?_step={k}")``, which drops everything the lost job logged
  after step k from the run's history, and records k+1 .. n-1 are logged again from the file.
  k is n - 1, or less when the lost job may not have written them (-1: none; the whole
  history is dropped and logged again): W&B writes a record to its files (offline) or sends
  it (online) some seconds after it is logged, and a job killed hard (SIGKILL, a node
  failure) loses that tail. The last record known to be written
  (logged longer ago than that delay, or everything at a normal end) is kept in the same
  file. Offline, the rewind point is stored in the offline run's files (its RunRecord's
  ``branch_point``) and applied by ``wandb beta sync``, which uploads the parts of one run in
  the order they started; online, the server must support run rewind. Where it refuses
  (online only), the job continues the run with ``resume="allow"`` instead and skips the
  records W&B already holds (their values are then those of the lost job: a warning says so).
- **Axes.** ``step`` (the optimizer step) is every metric's x axis, ``gpu_hours`` (training
  compute) is defined as an axis too and is the default one of ``val_pass_rate`` and its
  per-domain series (the ScaleRL compute curve). Scalar fields are logged (list fields such
  as ``prompt_ids`` stay in ``metrics.jsonl``), the per-layer MoE series in the row of their
  step, the resolved recipe is the run's config, ``reward_curve.png`` is logged as an image
  after each validation (and again when the live forecast redraws it; a record logged again
  after a rewind carries its numbers only), and
  ``RUN_DIR/preflight.json`` (``megatron-rl preflight``) as a table when a job starts.
- **Failures.** ``online`` without a login, or whose server does not answer, is refused
  before the run builds anything (:func:`check_login`, on the main rank, whose refusal
  every rank raises), with an error naming ``logging.wandb.mode``; a run that cannot be
  opened later fails the same way before training; a failure while logging is a warning
  and never stops training.

This module imports neither torch nor wandb at import time (the config tree imports it).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

WANDB_DIR = "wandb"  # RUN_DIR/wandb: W&B's own files and ours (moved aside by --restart)
STATE_FILE = "megatron_rl_run.json"  # in WANDB_DIR: run id, project, last written record
# How often W&B's service writes an offline run's records to its .wandb file (its
# ``x_transaction_log_flush_interval``, 15 s by default): a hard kill loses at most this.
FLUSH_SECONDS = 2.0
# A record counts as written this long after it was committed: the flush interval plus the
# trip to W&B's service (offline), or W&B's upload interval and a margin (online).
WRITTEN_AFTER = {"offline": FLUSH_SECONDS + 3.0, "online": 60.0}
MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    """``logging.wandb``: Weights & Biases tracking of the run.

    Attributes:
        mode: ``disabled`` (default), ``offline`` (files in ``RUN_DIR/wandb``, uploaded
            later with ``wandb beta sync RUN_DIR/wandb``: no network needed) or ``online`` (needs
            ``wandb login`` or ``WANDB_API_KEY``, and the network).
        project: the W&B project.
        entity: the W&B team or user; empty: the login's default entity.
        name: the run's display name; empty: the recipe's ``name``.
        tags: tags of the run.
    """

    mode: Literal["online", "offline", "disabled"] = "disabled"
    project: str = "megatron-rl"
    entity: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)

    def validate(self) -> None:
        from megatron_rl.config.errors import ConfigError  # here: config imports this module

        if self.mode != "disabled" and not self.project.strip():
            raise ConfigError("project", f"must be a W&B project name when mode is {self.mode!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


class TrackingError(RuntimeError):
    """The W&B run could not be started (the message names ``logging.wandb.mode``)."""


def check_login(config: WandbConfig) -> None:
    """``online``: W&B has credentials and its server accepts them (wandb.login verifies them
    there: ~10 s without a network), checked before the run builds anything. Raises
    :class:`TrackingError` naming ``logging.wandb.mode``; nothing to check otherwise."""
    if config.mode != "online":
        return
    import wandb

    try:
        logged_in = wandb.login(prompt=False, verify=True)
    except Exception as err:
        message = f"logging.wandb.mode=online: {type(err).__name__}: {err}; {_HINT}"
        raise TrackingError(message) from err
    if not logged_in:
        raise TrackingError(f"logging.wandb.mode=online: no W&B API key configured; {_HINT}")


_HINT = (
    "log in (`wandb login`, or WANDB_API_KEY) and check that the W&B server can be reached, or "
    "set logging.wandb.mode=offline (upload later with `wandb beta sync RUN_DIR/wandb`) or "
    "logging.wandb.mode=disabled"
)


def new_run_id() -> str:
    """A W&B run id (8 characters of [a-z0-9], as W&B makes them)."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _scalar(value: Any) -> bool:
    """Numbers and flags go to W&B; lists (prompt ids, histograms) stay in the file."""
    return isinstance(value, (int, float))


class WandbTracker:
    """Mirrors metrics records into one W&B run (see the module docstring).

    Fed by :class:`megatron_rl.trainer.metrics.MetricsLogger`: :meth:`start` with the records
    kept on (re)start, :meth:`log` with each record and its index in ``metrics.jsonl``,
    :meth:`log_extra` with series that stay out of the file, :meth:`close` at the end.

    Args:
        config: ``logging.wandb``.
        run_dir: the run directory (``metrics.jsonl`` and ``RUN_DIR/wandb`` are there).
        recipe: the resolved recipe (the W&B run's config).
        run_name: the display name when ``config.name`` is empty.
    """

    def __init__(
        self, config: WandbConfig, run_dir: str | Path, recipe: Mapping[str, Any], run_name: str
    ) -> None:
        if not config.enabled:
            raise ValueError("logging.wandb.mode is 'disabled': no tracker to build")
        self.config = config
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / WANDB_DIR
        self.recipe = dict(recipe)
        self.name = config.name or run_name
        self.run: Any = None
        self.rewound_to: int | None = None  # the rewind point of this job, if any
        self._last = -1  # index of the last record logged (the row that is still open)
        self._committed: list[tuple[float, int]] = []  # (when, index) of rows not yet written
        self._written = -1  # the last record known to be in W&B's files / on its server
        self._skip_below = 0  # fallback without rewind: records W&B already holds
        self._axes: set[str] = set()
        self._png_mtime: float | None = None
        self._pending_extras: dict[str, Any] = {}  # logged with the next record
        self._failed = False

    # -- start ------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.run is not None

    def start(self, records: list[Mapping[str, Any]]) -> None:
        """Open the run: a new one, or the run of this directory rewound to what ``records``
        (``metrics.jsonl`` as kept on resume) and W&B both hold; then log the records W&B
        lacks. Raises :class:`TrackingError` when W&B cannot start."""
        if self.started:
            raise RuntimeError("the W&B run is already started")
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        state = self._read_state()
        n = len(records)
        written = int(state.get("written", -1)) if state else -1
        # -1: none known written (a job killed within seconds of its first record): the
        # rewind then drops the whole history, and every record kept is logged again
        keep = max(min(n - 1, written), -1)
        run_id = state.get("run_id") if state else None
        first = self._open(wandb, run_id, keep)  # the first record W&B lacks
        self._written = self._last = first - 1
        self._write_state()
        self._define_axes()
        todo = [i for i in range(first, n) if i >= self._skip_below]
        logger.info(
            "W&B run %s (%s, project %s)%s: %d records of metrics.jsonl to log again",
            self.run.id,
            self.config.mode,
            self.config.project,
            f" rewound to record {self.rewound_to}" if self.rewound_to is not None else "",
            len(todo),
        )
        extras = self._preflight_table()
        for index in todo:
            self._log_row(records[index], index, replay=True, extras=extras)
            extras = {}
        self._pending_extras = extras  # the preflight table goes with the next record

    def _open(self, wandb: Any, run_id: str | None, keep: int) -> int:
        """``wandb.init``: a new run (``run_id`` None), or ``run_id`` rewound to record
        ``keep``; online, where the server refuses the rewind, the run continued as it is.
        Returns the index of the first record to log."""
        if run_id is None:
            self.run = self._init(wandb, new_run_id(), {"resume": "allow"})
            return 0
        try:
            self.run = self._init(wandb, run_id, {"resume_from": f"{run_id}?_step={keep}"})
        except TrackingError as err:
            if self.config.mode != "online":
                raise
            logger.warning(
                "W&B did not rewind run %s to record %d (%s): continuing it without a rewind; "
                "the records it already holds keep the values the lost job logged",
                run_id,
                keep,
                err.__cause__,
            )
            self.run = self._init(wandb, run_id, {"resume": "allow"})
            # what the server holds is skipped; what it lacks (a hard kill's tail) is logged
            self._skip_below = int(self.run.starting_step)
            return min(keep + 1, self._skip_below)
        self.rewound_to = keep
        return keep + 1

    def _init(self, wandb: Any, run_id: str, kwargs: dict[str, Any]) -> Any:
        """``wandb.init`` of this run directory's run; raises :class:`TrackingError`."""
        settings: dict[str, Any] = {"console": "off"}
        if "x_transaction_log_flush_interval" in wandb.Settings.model_fields:
            settings["x_transaction_log_flush_interval"] = FLUSH_SECONDS
        try:
            return wandb.init(
                project=self.config.project,
                entity=self.config.entity or None,
                name=self.name,
                tags=list(self.config.tags) or None,
                mode=self.config.mode,
                dir=str(self.run_dir),
                id=run_id if "resume_from" not in kwargs else None,
                config=self.recipe,
                settings=wandb.Settings(**settings),
                **kwargs,
            )
        except Exception as err:
            raise self._error(err) from err

    def _error(self, err: Exception) -> TrackingError:
        mode = self.config.mode
        hint = _HINT if mode == "online" else "or set logging.wandb.mode=disabled"
        return TrackingError(
            f"logging.wandb.mode={mode}: could not start the W&B run in {self.dir}: "
            f"{type(err).__name__}: {err}; {hint}"
        )

    def _define_axes(self) -> None:
        run = self.run
        run.define_metric("step")
        run.define_metric("gpu_hours")
        run.define_metric("*", step_metric="step")
        self._define_compute_axis("val_pass_rate")

    def _define_compute_axis(self, key: str) -> None:
        """``val_pass_rate`` (and each domain's) against training compute by default."""
        if key not in self._axes:
            self._axes.add(key)
            self.run.define_metric(key, step_metric="gpu_hours")

    # -- logging ----------------------------------------------------------------------------

    def log(self, record: Mapping[str, Any], index: int) -> None:
        """Log record number ``index`` of ``metrics.jsonl`` (W&B step ``index``)."""
        if not self.started:
            raise RuntimeError("WandbTracker.log before start")
        extras, self._pending_extras = self._pending_extras, {}
        extras.update(self._images(record))
        self._guarded(self._log_row, record, index, False, extras)

    def log_extra(self, scalars: Mapping[str, Any]) -> None:
        """Series that stay out of ``metrics.jsonl`` (per-layer MoE loads), in the row of
        the last record."""
        if self.started and self._last >= self._skip_below and self._last >= 0:
            data = {k: v for k, v in scalars.items() if _scalar(v)}
            self._guarded(self.run.log, data, step=self._last)

    def _log_row(
        self, record: Mapping[str, Any], index: int, replay: bool, extras: dict[str, Any]
    ) -> None:
        if index < self._skip_below:
            return
        if index <= self._last:
            raise ValueError(f"record {index} logged after record {self._last}")
        data = {k: v for k, v in record.items() if _scalar(v)}
        for key in data:
            if key.startswith("val_pass_rate/"):
                self._define_compute_axis(key)
        now = time.monotonic()
        if self._last >= 0:
            self._committed.append((now, self._last))  # a new step closes the open row
        self.run.log({**data, **extras}, step=index)
        self._last = index
        self._update_written(now)

    def _update_written(self, now: float) -> None:
        delay = WRITTEN_AFTER[self.config.mode]
        written = self._written
        while self._committed and self._committed[0][0] <= now - delay:
            written = self._committed.pop(0)[1]
        if written != self._written:
            self._written = written
            self._write_state()

    def _images(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """``reward_curve``: drawn after a validation; the live forecast's redraw of
        ``RUN_DIR/reward_curve.png`` (with the fit) when it is new."""
        import wandb

        out: dict[str, Any] = {}
        png = self.run_dir / "reward_curve.png"
        try:
            mtime = png.stat().st_mtime if png.is_file() else None
            if mtime is not None and mtime != self._png_mtime:
                self._png_mtime = mtime
                out["reward_curve"] = wandb.Image(str(png))
            if record.get("val_pass_rate") is not None:
                from megatron_rl.scaling.records import METRICS_FILE, plot_reward_curve

                own = plot_reward_curve(
                    self.run_dir / METRICS_FILE, self.dir / "reward_curve.png", title=self.name
                )
                out["reward_curve"] = wandb.Image(str(own))
        except Exception as err:  # an image must never stop training
            logger.warning("W&B: no reward curve image for this record: %r", err)
        return out

    def _preflight_table(self) -> dict[str, Any]:
        """``RUN_DIR/preflight.json`` (this job's ``megatron-rl preflight``) as a table."""
        from megatron_rl.preflight.report import REPORT_FILE

        path = self.run_dir / REPORT_FILE
        if not path.is_file():
            return {}
        import wandb

        try:
            report = json.loads(path.read_text())
            columns = ["check", "status", "measured", "limit", "seconds", "message"]
            rows = [
                [c["name"], c["status"], c["value"], c["limit"], c["seconds"], c["message"]]
                for c in report["checks"]
            ]
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("W&B: %s is not a preflight report (%r): not logged", path, err)
            return {}
        self.run.summary["preflight_passed"] = bool(report.get("passed"))
        return {"preflight": wandb.Table(columns=columns, data=rows)}

    def _guarded(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """W&B failures while training are warnings (once), never errors."""
        try:
            fn(*args, **kwargs)
        except Exception as err:
            if not self._failed:
                logger.warning("W&B logging failed (training goes on): %r", err)
            self._failed = True

    # -- state ------------------------------------------------------------------------------

    def _read_state(self) -> dict[str, Any] | None:
        path = self.dir / STATE_FILE
        if not path.is_file():
            return None
        try:
            state = json.loads(path.read_text())
        except ValueError as err:
            raise TrackingError(
                f"{path}: unreadable ({err}); remove it to start a new W&B run"
            ) from err
        if state.get("project") != self.config.project:
            logger.warning(
                "logging.wandb.project %r differs from the project %r of W&B run %s",
                self.config.project,
                state.get("project"),
                state.get("run_id"),
            )
        return state

    def _write_state(self) -> None:
        state = {
            "run_id": self.run.id,
            "project": self.config.project,
            "entity": self.config.entity,
            "mode": self.config.mode,
            "written": self._written,
        }
        path = self.dir / STATE_FILE
        tmp = path.with_name(path.name + ".part")
        tmp.write_text(json.dumps(state) + "\n")
        os.replace(tmp, path)

    def close(self) -> None:
        """Finish the run: W&B writes (offline) or uploads (online) what it holds."""
        if not self.started:
            return
        try:
            self.run.finish()
        except Exception as err:
            logger.warning("W&B: finishing run %s failed: %r", self.run.id, err)
        else:
            self._written = self._last
            self._write_state()
        self.run = None
