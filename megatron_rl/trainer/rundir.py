"""The run directory has one owner, and its history is never rewritten without being told.

Before a run builds anything, its main rank claims the run directory (:func:`claim_run_dir`):

- **Lock.** An exclusive ``flock`` on ``RUN_DIR/run.lock``, held for the life of the process,
  the file naming the holder's host and pid. A second run in the same directory (a requeued
  job starting while the old one still lives) is refused with that name. (The lock needs a
  file system with working ``flock``: local disks, NFSv4, Lustre mounted with ``flock``.)
- **No silent restart.** A directory with history (metrics records, checkpoint directories,
  leftovers of interrupted saves) but no intact checkpoint to resume from is refused, naming
  what it holds; ``--restart`` starts over, moving that history into
  ``RUN_DIR/previous_<UTC time>/``. What a run wrote before its first checkpoint was complete
  (the warm start's record, steps, the first save's ``.tmp``) is not history: a job preempted
  or killed that early starts over when requeued, and writes those records again (once).
  A finished run's history with no checkpoint (``checkpoint.every_steps: 0`` without
  ``save_at_end``) is moved aside as ``--restart`` does, and the run starts over.
- **Config changes.** A resume compares the recipe with the config its checkpoint was
  trained with (``step_N/config.yaml``, written with every checkpoint; for a checkpoint
  written before they kept one, ``RUN_DIR/config.yaml``, which the resume command loads and
  a hand edit changes): every changed key is logged; keys outside :data:`SAFE_CHANGES` need
  ``--allow-changes``, and are then applied (the optimizer's learning rate, weight decay,
  warmup, betas and epsilon too, though its scheduler state comes from the checkpoint);
  keys a resumed run cannot apply (:data:`FIXED_ON_RESUME`) are refused even so. The new
  config is written only once the run is built (``save_config``): a rerun that fails leaves
  the run's config as it was.
- **Finished.** A run whose ``metrics.jsonl`` ends in its ``run_finished`` record (at the
  step of its newest checkpoint, or later without ``checkpoint.save_at_end``) is done: run
  again with the same budget (``training.max_steps``, ``training.max_gpu_hours``), it says
  "already finished (N steps)" and exits 0 (:class:`AlreadyFinished`) before anything is
  built; a larger budget resumes it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.schema import RunConfig, diff_keys, to_yaml

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
CONFIG_FILE = "config.yaml"
# Keys a resumed run may change without --allow-changes: when to stop, what to log, how often
# to checkpoint or validate, the live forecast, time-outs and the Slurm allocation. They do
# not change what an update computes. A prefix ending in "." covers its whole section.
SAFE_CHANGES = (
    "name",
    "training.max_steps",
    "training.max_gpu_hours",
    "logging.",
    "checkpoint.every_steps",
    "checkpoint.keep_last",
    "checkpoint.save_at_end",
    "checkpoint.on_signals",
    "checkpoint.async_save",
    "validation.every_steps",
    "validation.at_start",
    "forecast.",
    "cluster.",
    "rollout.startup_timeout_minutes",
    "parallel.timeout_minutes",
    "reward.max_error_fraction",  # when a failing reward stops the run; no verdict changes
)
# Keys a resumed run cannot apply, even with --allow-changes: what they set was done before
# its first checkpoint. A prefix ending in "." covers its whole section.
FIXED_ON_RESUME = ("warm_start.",)


class RunDirError(ValueError):
    """The run directory cannot be used as asked (the message says why and what to do)."""


class AlreadyFinished(Exception):
    """The run in the run directory finished and the recipe asks for no more: nothing to do
    (the message says so, and how to train on)."""


class RunLock:
    """An exclusive lock on ``RUN_DIR/run.lock``; released when the process ends."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # read-only file system, no write permission, a directory ...
            raise RunDirError(
                f"{run_dir} cannot be written ({err.strerror}: {self.path}): a run writes its "
                "checkpoints and metrics there; make it writable or pass another --run-dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(
                f"{run_dir} is in use by another run ({holder}; lock {self.path}). Two runs "
                "in one run directory corrupt each other's checkpoints and metrics: stop that "
                "run first (a requeued job: wait for the old one to end), or pass another "
                "--run-dir"
            ) from None
        except OSError as err:  # a file system without flock: warn, do not refuse to run
            logger.warning("%s: cannot lock the run directory (%s): not protected", run_dir, err)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Claim:
    """What the main rank holds after claiming the run directory."""

    lock: RunLock
    config_text: str  # the config to write once the run is built (``save_config``)


def claim_run_dir(
    config: RunConfig, run_dir: Path, restart: bool = False, allow_changes: bool = False
) -> Claim:
    """Lock ``run_dir`` and check that this run may use it (main rank only; see the module
    docstring). Raises :class:`RunDirError` with what was found and what to do."""
    from megatron_rl.trainer.state import CheckpointManager

    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} is a file, not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"--run-dir {run_dir} cannot be created ({err.strerror})") from None
    lock = RunLock(run_dir)
    try:
        text = to_yaml(config)  # before the run fills in derived fields (hf_path, dtype ...)
        resumable = CheckpointManager(run_dir).latest()
        history = find_history(run_dir)
        if restart and history:
            move_history_aside(run_dir, history)
        elif resumable is None and history and not checkpointed_before(run_dir):
            if finished_record(run_dir) is not None:  # a run that never checkpointed, done
                move_history_aside(run_dir, history, "a finished run without checkpoints")
                return Claim(lock, text)
            logger.warning(
                "%s holds what a run stopped before its first checkpoint wrote (%s): starting "
                "over (the records are written again)",
                run_dir,
                "; ".join(history.values()),
            )
        elif resumable is None and history:
            raise RunDirError(
                f"{run_dir} has the history of a run but no intact checkpoint to resume "
                f"from: {'; '.join(history.values())}. Starting over would rewrite it. Pass "
                "--restart to start over (the history is moved into "
                f"{run_dir}/previous_<time>/), or pass another --run-dir"
            )
        elif resumable is not None:
            trained_with = checkpoint_config(run_dir, resumable)
            check_finished(run_dir, resumable, trained_with, text)
            check_changes(trained_with, text, allow_changes)
    except BaseException:
        lock.release()
        raise
    return Claim(lock, text)


def save_config(claim: Claim, run_dir: Path) -> None:
    """Write the claimed config to ``RUN_DIR/config.yaml`` (atomically)."""
    path = run_dir / CONFIG_FILE
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(claim.config_text)
    os.replace(tmp, path)


def find_history(run_dir: Path) -> dict[str, str]:
    """What of a past run ``run_dir`` holds: {path: description} (empty: nothing)."""
    from megatron_rl.trainer.metrics import METRICS_FILE

    found = {}
    metrics = run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size:
        with open(metrics, "rb") as f:
            lines = sum(1 for _ in f)
        found[METRICS_FILE] = f"{METRICS_FILE} ({lines} records)"
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir():
        dirs = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))
        if dirs:
            shown = ", ".join(dirs[-4:])
            more = f" and {len(dirs) - 4} more" if len(dirs) > 4 else ""
            found["checkpoints"] = f"checkpoints/ ({shown}{more}: none intact)"
    return found


def checkpointed_before(run_dir: Path) -> bool:
    """Whether a checkpoint of ``run_dir`` was ever complete: its ``latest`` pointer (written
    by every complete save, never removed) or a published ``step_N`` directory (intact or
    damaged since) exists. Without one, no run there got past its first checkpoint."""
    from megatron_rl.trainer.state import CHECKPOINT_DIR, LATEST_FILE, is_step_dir

    checkpoints = run_dir / CHECKPOINT_DIR
    if not checkpoints.is_dir():
        return False
    return (checkpoints / LATEST_FILE).exists() or any(
        is_step_dir(p) for p in checkpoints.iterdir()
    )


def checkpoint_config(run_dir: Path, checkpoint: Path) -> Path:
    """The config ``checkpoint`` was trained with: its own copy, or for a checkpoint written
    before checkpoints kept one, ``RUN_DIR/config.yaml`` (with a warning: a hand edit of it
    passes unseen)."""
    own = checkpoint / CONFIG_FILE
    if own.is_file():
        return own
    logger.warning(
        "%s keeps no copy of its config (written by an older version): the recipe is compared "
        "with %s instead, which may have been edited since",
        checkpoint,
        run_dir / CONFIG_FILE,
    )
    return run_dir / CONFIG_FILE


def finished_record(run_dir: Path) -> dict | None:
    """The ``run_finished`` record ``RUN_DIR/metrics.jsonl`` ends with, or None."""
    from megatron_rl.trainer.metrics import METRICS_FILE

    path, last = run_dir / METRICS_FILE, b""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        for line in f:
            last = line if line.strip() else last
    try:
        record = json.loads(last)
    except ValueError:  # empty, or a record cut short by a crash: not a finished run
        return None
    return record if isinstance(record, dict) and record.get("run_finished") else None


def check_finished(run_dir: Path, checkpoint: Path, trained_with: Path, text: str) -> None:
    """Raise :class:`AlreadyFinished` if the run ended normally (``metrics.jsonl`` ends in
    its ``run_finished`` record, at the step of ``checkpoint``, its newest, or after it when
    ``checkpoint.save_at_end`` is off) and the recipe ``text`` gives it no more budget than
    the config it was trained with (``trained_with``; if that is unreadable, the step budget
    alone). A run killed after its last checkpoint but before its end record is not finished:
    its resume ends it."""
    from megatron_rl.trainer.state import step_of

    record = finished_record(run_dir)
    if record is None or not isinstance(record.get("step"), int):
        return
    step = record["step"]
    if step < step_of(checkpoint):  # an end record older than the checkpoint: not this run's
        return
    new = yaml.safe_load(text)["training"]
    try:
        old = yaml.safe_load(trained_with.read_text())["training"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        old = {"max_steps": step, "max_gpu_hours": new["max_gpu_hours"]}
    more_steps = new["max_steps"] > max(old["max_steps"], step)
    old_hours, new_hours = old["max_gpu_hours"], new["max_gpu_hours"]
    more_hours = old_hours is not None and (new_hours is None or new_hours > old_hours)
    if not (more_steps or more_hours):
        raise AlreadyFinished(
            f"{run_dir}: already finished ({step} steps; its metrics end in the run_finished "
            f"record, {checkpoint.name} is its newest checkpoint): nothing to do. To train on, "
            f"raise training.max_steps (e.g. training.max_steps={2 * step}) or "
            "training.max_gpu_hours"
        )


def move_history_aside(run_dir: Path, history: dict[str, str], why: str = "--restart") -> Path:
    """``--restart`` (or ``why``): move the past run's files into
    ``RUN_DIR/previous_<UTC time>/``; the run starts over."""
    from megatron_rl.trainer.console import LOGS_DIR, RANK_LOGS
    from megatron_rl.trainer.metrics import TENSORBOARD_DIR
    from megatron_rl.trainer.tracking import WANDB_DIR  # the W&B run id: a new run after this

    aside = run_dir / time.strftime("previous_%Y%m%dT%H%M%SZ", time.gmtime())
    aside.mkdir()
    for name in [*history, TENSORBOARD_DIR, WANDB_DIR, CONFIG_FILE, "hf_init", "tokenizer"]:
        if (run_dir / name).exists():
            (run_dir / name).rename(aside / name)
    # The trainer ranks' logs (megatron_rl.trainer.console); a Slurm job's own logs, written
    # there while it runs, stay.
    for log in sorted((run_dir / LOGS_DIR).glob(RANK_LOGS)):
        (aside / LOGS_DIR).mkdir(exist_ok=True)
        log.rename(aside / LOGS_DIR / log.name)
    logger.warning(
        "%s: the previous run's %s moved to %s; starting over", why, ", ".join(history), aside
    )
    return aside


def check_changes(config_path: Path, text: str, allow_changes: bool) -> dict[str, tuple]:
    """Keys whose values differ between ``config_path`` (the config the checkpoint was
    trained with) and ``text`` (the new config), each logged as applied; those outside
    :data:`SAFE_CHANGES` raise :class:`RunDirError` unless ``allow_changes``, those in
    :data:`FIXED_ON_RESUME` always. Returns {key: (old, new)}."""
    if not config_path.is_file():
        logger.warning("%s is missing: the resumed run's changes cannot be checked", config_path)
        return {}
    try:
        old = yaml.safe_load(config_path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise RunDirError(f"{config_path}: unreadable ({err}); restore it or remove it") from err
    new = yaml.safe_load(text)
    changes = {key: (_get(old, key), _get(new, key)) for key in sorted(diff_keys(old, new))}
    unsafe = [key for key in changes if not _safe(key)]
    fixed = [key for key in changes if _matches(key, FIXED_ON_RESUME)]
    if fixed:
        listed = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in fixed)
        raise RunDirError(
            f"the recipe differs from {config_path} in {listed}, which a resumed run cannot "
            "apply (done before its first checkpoint): set it back, or pass --restart to start "
            "over with it"
        )
    if unsafe and not allow_changes:
        listed = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in unsafe)
        raise RunDirError(
            f"the recipe differs from the run's {config_path} in {listed}. A resumed run "
            "continues the same experiment: pass --allow-changes to resume with these "
            f"settings anyway (safe without it: {', '.join(SAFE_CHANGES)})"
        )
    for key, (before, after) in changes.items():
        logger.warning("resume: %s changed from %r to %r (applied)", key, before, after)
    return changes


def _safe(key: str) -> bool:
    return _matches(key, SAFE_CHANGES)


def _matches(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in keys)


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return "<absent>"
        tree = tree[part]
    return tree
