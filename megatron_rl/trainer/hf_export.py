"""HF checkpoints during training, off the critical path (``checkpoint.export_hf_every``).

After the checkpoint of an export step is complete, a background process converts it with the
streaming ``megatron-rl convert mcore-to-hf`` (``conversion.hf.mcore_to_hf``: one layer at a
time, on the host) into ``RUN_DIR/hf/step_NNNNNNNN/`` (safetensors, config, tokenizer files
and a README.md line with the step, GPU-hours and the last validation pass rate), while
training goes on. The main rank runs it; nothing else waits for it:

- at most one export at a time; a request that comes while one runs waits (the newest only);
- the export reads hard links of the checkpoint's files (``step_N.src``), so the checkpoint
  may be pruned (``checkpoint.keep_last``) meanwhile; on a filesystem without hard links it
  reads the checkpoint in place (then a pruned checkpoint fails that export);
- an export that fails is logged (its output in ``hf/step_N.log``) and never stops the run:
  the next export step tries again; ``checkpoint.keep_last`` applies to exports too;
- everything is written into ``step_N.tmp`` and renamed when complete;
- a stop (a signal, an error) does not wait for an export: the running and waiting ones are
  stopped, and the next run of the run directory exports them (:meth:`HFExporter.resume`): each
  request is kept with its pinned checkpoint files (``step_N.src`` and ``step_N.request.json``:
  the step and its README notes), and a checkpoint of an export step newer than every export is exported
  too; a killed export's ``.tmp`` and log are removed.

The converter runs without GPUs (``CUDA_VISIBLE_DEVICES`` empty: the trainer's GPU memory is
not touched), outside the trainer's process group (the ``torchrun`` variables are removed), at a
lower CPU priority (``nice``), ignores the job's signals (a SIGTERM or Ctrl-C to the job's
process group is the trainer's to answer: it killed the converter mid-export, leaving an empty
log), and it dies with the trainer (a SIGKILLed trainer's export must not go on writing into
the run directory the requeued job cleans). The export is started from the trainer's main
thread: the death signal follows the thread that started it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.platform import LAUNCHER_VARS
from megatron_rl.trainer import compute

logger = logging.getLogger(__name__)

EXPORT_DIR = "hf"
FINAL_WAIT_SECONDS = 1800.0  # at the end of a run, the running export is waited for this long
_STEP_FORMAT = "step_{:08d}"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
REQUEST_SUFFIX = ".request.json"  # step_N.request.json: a pinned export's step and notes
# Signals a job sends to all of its processes (preemption, scancel, Ctrl-C): the trainer's
JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class _Export:
    step: int
    checkpoint: Path  # the checkpoint directory (its model/ is converted)
    notes: dict[str, float | None]


class HFExporter:
    """Background HF exports of ``RUN_DIR/checkpoints`` steps into ``RUN_DIR/hf`` (main rank).

    Call :meth:`resume` at the start (the exports a stop left undone), :meth:`submit` after a
    complete checkpoint, :meth:`poll` once a step (cheap), and :meth:`close` at the end of the
    run (waits for the running export, up to a limit) or :meth:`interrupt` on a stop."""

    def __init__(self, run_dir: str | Path, every: int, keep_last: int, dtype: str | None = None):
        self.root = Path(run_dir) / EXPORT_DIR
        self.every = every
        self.keep_last = keep_last
        self.dtype = dtype
        self._running: _Export | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._started = 0.0
        self._waiting: _Export | None = None
        self._backlog: list[_Export] = []  # resume(): every missed export, oldest first
        self.val_pass_rate: float | None = None  # the last validation's, for the README
        self.exported: list[int] = []  # steps exported by this process, in order
        self.failed: list[int] = []
        self._pending = self._clean_leftovers()  # what a stop left undone: for resume()

    def wants(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is exported."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def submit(self, step: int, checkpoint: str | Path, notes: dict[str, float | None]) -> None:
        """Export the complete checkpoint ``checkpoint`` (of ``step``) in the background;
        ``notes`` (``gpu_hours``; ``val_pass_rate``, else the last one set) go into its
        README line."""
        self.poll()
        request = _Export(step, Path(checkpoint), {"val_pass_rate": self.val_pass_rate, **notes})
        self._pin(request)
        if self._running is None:
            self._start(request)
            return
        if self._waiting is not None:  # superseded by a newer checkpoint
            logger.info("HF export of step %d skipped: step %d is newer", self._waiting.step, step)
            self._unpin(self._waiting.step)
        self._waiting = request

    def poll(self) -> None:
        """Finish an export whose process ended; start the next one (the missed ones that
        :meth:`resume` found first, then the waiting one)."""
        if self._proc is not None and self._proc.poll() is not None:
            self._finish(self._proc.returncode)
        if self._running is None and self._backlog:
            self._start(self._backlog.pop(0))
        elif self._running is None and self._waiting is not None:
            request, self._waiting = self._waiting, None
            self._start(request)

    def resume(self, checkpoints: list[Path]) -> list[int]:
        """Export what was due and is missing (at the start of a run): the requests a stop or
        a kill left undone (their ``step_N.src``), and the complete ``checkpoints`` of export
        steps newer than every export. Returns the steps submitted, oldest first."""
        exported = self._exported_steps()
        newest = max(exported, default=0)
        due = dict(self._pending)
        for path in checkpoints:
            step = int(path.name.split("_")[1])
            if self.wants(step) and step > newest and step not in due:
                due[step] = (path, {})
        self._pending = {}
        steps = sorted(s for s in due if s not in exported)
        for step in steps:  # every one, in order (not the newest only, as during training)
            path, notes = due[step]
            logger.info("HF export of step %d was due and is missing: exporting it", step)
            request = _Export(step, Path(path), {"val_pass_rate": None, **notes})
            self._pin(request)
            self._backlog.append(request)
        self.poll()
        return steps

    def interrupt(self) -> None:
        """A stop: stop the running export (its ``.tmp`` and log removed) without waiting;
        it and the waiting one stay pinned (``step_N.src``, ``step_N.request.json``) for the
        next run's :meth:`resume`."""
        for request in (self._running, *self._backlog, self._waiting):
            if request is not None:
                logger.info(
                    "HF export of step %d stopped with the run: the next run exports it",
                    request.step,
                )
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._log.close()
            _, tmp, _, log_path = self._paths(self._running.step)
            shutil.rmtree(tmp, ignore_errors=True)
            log_path.unlink(missing_ok=True)
        self._proc = self._log = self._running = self._waiting = None
        self._backlog = []

    @property
    def busy(self) -> bool:
        return self._running is not None or self._waiting is not None or bool(self._backlog)

    def close(self, timeout_s: float = 3600.0) -> None:
        """Wait for the running and waiting exports (end of the run), at most ``timeout_s``
        in all; one still running then is stopped (its ``.tmp`` removed)."""
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "HF export of step %d still runs after %.0f s at the end of the run: "
                        "stopped (convert the checkpoint offline: megatron-rl convert "
                        "mcore-to-hf %s OUT_DIR)",
                        self._running.step,
                        timeout_s,
                        self._running.checkpoint / "model",
                    )
                    self._proc.kill()
                    self._proc.wait()
            self.poll()
            if time.monotonic() > deadline:
                for request in [*self._backlog, self._waiting]:
                    if request is not None:
                        self._unpin(request.step)
                self._backlog, self._waiting = [], None

    # -- internals ---------------------------------------------------------------------------
    def _paths(self, step: int) -> tuple[Path, Path, Path, Path]:
        name = _STEP_FORMAT.format(step)
        return (
            self.root / name,
            self.root / f"{name}.tmp",
            self.root / f"{name}.src",
            self.root / f"{name}.log",
        )

    def _clean_leftovers(self) -> dict[int, tuple[Path, dict]]:
        """Remove what killed or stopped exports left (``.tmp``; a ``.src`` without its
        request, its pinning cut short, or of a step exported since; the log of a request
        that is exported again) and return the requests to export again:
        {step: (checkpoint directory, notes)}."""
        pending: dict[int, tuple[Path, dict]] = {}
        if not self.root.is_dir():
            return pending
        exported = self._exported_steps()
        for path in sorted(self.root.iterdir()):
            if path.suffix == ".tmp" and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.suffix == ".src" and path.is_dir():
                step = int(path.name[5:13])
                notes = self._request(step)
                if notes is None or step in exported:
                    self._unpin(step)
                else:
                    pending[step] = (self.root.parent / "checkpoints" / path.stem, notes)
        for path in self.root.glob("*" + REQUEST_SUFFIX):
            if int(path.name[5:13]) not in pending:
                path.unlink(missing_ok=True)
        for step in pending:
            self._paths(step)[3].unlink(missing_ok=True)  # a killed export's (often empty) log
        return pending

    def _request(self, step: int) -> dict | None:
        """The notes of the pinned request of ``step``, or None (none, or unreadable)."""
        path = self.root / (_STEP_FORMAT.format(step) + REQUEST_SUFFIX)
        try:
            request = json.loads(path.read_text())
            return dict(request["notes"]) if request["step"] == step else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _exported_steps(self) -> set[int]:
        if not self.root.is_dir():
            return set()
        return {
            int(p.name[5:])
            for p in self.root.iterdir()
            if p.is_dir() and p.suffix == "" and p.name.startswith("step_")
        }

    def _pin(self, request: _Export) -> None:
        """Hard-link the checkpoint's model files into ``step_N.src`` (no data is copied), so
        that pruning the checkpoint does not pull them from under the export, then write the
        request beside them (``export.json``: a stopped run's next run exports it)."""
        _, _, src, _ = self._paths(request.step)
        if src.is_dir() and self._request(request.step) is not None:
            return  # pinned by the run that was stopped (resume)
        self._unpin(request.step)
        model = request.checkpoint / "model"
        try:
            for path in sorted(model.rglob("*")):
                target = src / path.relative_to(model)
                if path.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, target)
        except OSError as err:  # no hard links here (another filesystem): read it in place
            logger.info("HF export reads %s in place (no hard links: %s)", model, err)
            shutil.rmtree(src, ignore_errors=True)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / (src.stem + REQUEST_SUFFIX)  # written last: the pin is complete
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps({"step": request.step, "notes": request.notes}) + "\n")
        os.replace(part, path)

    def _unpin(self, step: int) -> None:
        shutil.rmtree(self._paths(step)[2], ignore_errors=True)
        (self.root / (_STEP_FORMAT.format(step) + REQUEST_SUFFIX)).unlink(missing_ok=True)

    def _start(self, request: _Export) -> None:
        out, tmp, src, log_path = self._paths(request.step)
        shutil.rmtree(tmp, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        model = src if src.is_dir() else request.checkpoint / "model"
        command = [sys.executable, "-m", "megatron_rl.cli", "convert", "mcore-to-hf"]
        command += [str(model), str(tmp)]
        if self.dtype:
            command += ["--dtype", self.dtype]
        if shutil.which("nice"):
            command = ["nice", "-n", "10", *command]
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env["CUDA_VISIBLE_DEVICES"] = ""  # on the host: the trainer's GPUs stay its own
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in _finish)
        self._proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=functools.partial(_die_with, os.getpid()),
        )
        compute.background(self._proc.pid)  # not training compute (a CPU run's clock)
        self._running = request
        self._started = time.monotonic()
        logger.info(
            "HF export of step %d started (pid %d) into %s", request.step, self._proc.pid, out
        )

    def _finish(self, returncode: int) -> None:
        request = self._running
        assert request is not None
        out, tmp, _, log_path = self._paths(request.step)
        self._log.close()
        self._proc = self._log = self._running = None
        seconds = time.monotonic() - self._started
        self._unpin(request.step)
        if returncode != 0 or not (tmp / "config.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            self.failed.append(request.step)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            logger.warning(
                "HF export of step %d failed (status %s after %.0f s; the run goes on, the next "
                "export step tries again); its log: %s%s",
                request.step,
                returncode,
                seconds,
                log_path,
                "".join(f"\n    {line}" for line in tail),
            )
            return
        (tmp / "README.md").write_text(readme_line(request.step, request.notes) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        log_path.unlink(missing_ok=True)
        self.exported.append(request.step)
        logger.info("HF export of step %d done in %.0f s: %s", request.step, seconds, out)
        self._prune()

    def _prune(self) -> None:
        done = sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir() and p.name.startswith("step_") and p.suffix == ""
        )
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)


def _die_with(trainer: int) -> None:
    """In the export process before it runs the converter: ignore the job's signals (kept
    across exec: the trainer answers them, and stops the export itself), and SIGKILL when the
    trainer dies (Linux ``PR_SET_PDEATHSIG``, kept across exec), as the async checkpoint
    writer is. A killed trainer's export went on writing ``hf/step_N.tmp`` under PID 1, where
    the requeued job's clean-up of leftovers then deleted it under the writer."""
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the export may outlive a killed trainer
        return
    if os.getppid() != trainer:  # the trainer died before prctl
        os._exit(1)


def readme_line(step: int, notes: dict[str, float | None]) -> str:
    """The exported model's README line: what it is and how good it was."""
    hours = notes.get("gpu_hours")
    rate = notes.get("val_pass_rate")
    parts = [f"megatron_rl checkpoint, step {step}"]
    parts.append(f"{hours:.4g} GPU-hours" if hours is not None else "GPU-hours unknown")
    parts.append(f"val pass rate {rate:.4g}" if rate is not None else "not validated yet")
    return ", ".join(parts)
