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
- everything is written into ``step_N.tmp`` and renamed when complete; leftovers of a killed
  export (``.tmp``, ``.src``) are removed when the next run starts.

The converter runs without GPUs (``CUDA_VISIBLE_DEVICES`` empty: the trainer's GPU memory is
not touched), outside the trainer's process group (the ``torchrun`` variables are removed), at a
lower CPU priority (``nice``), and it dies with the trainer (a SIGKILLed trainer's export must
not go on writing into the run directory the requeued job cleans). The export is started from
the trainer's main thread: the death signal follows the thread that started it.
"""

from __future__ import annotations

import ctypes
import functools
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


@dataclass
class _Export:
    step: int
    checkpoint: Path  # the checkpoint directory (its model/ is converted)
    notes: dict[str, float | None]


class HFExporter:
    """Background HF exports of ``RUN_DIR/checkpoints`` steps into ``RUN_DIR/hf`` (main rank).

    Call :meth:`submit` after a complete checkpoint, :meth:`poll` once a step (cheap), and
    :meth:`close` at the end of the run (waits for the running export, up to a limit)."""

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
        self.val_pass_rate: float | None = None  # the last validation's, for the README
        self.exported: list[int] = []  # steps exported by this process, in order
        self.failed: list[int] = []
        self._clean_leftovers()

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
        """Finish an export whose process ended; start the waiting one."""
        if self._proc is not None and self._proc.poll() is not None:
            self._finish(self._proc.returncode)
        if self._running is None and self._waiting is not None:
            request, self._waiting = self._waiting, None
            self._start(request)

    @property
    def busy(self) -> bool:
        return self._running is not None or self._waiting is not None

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
            if time.monotonic() > deadline and self._waiting is not None:
                self._unpin(self._waiting.step)
                self._waiting = None

    # -- internals ---------------------------------------------------------------------------
    def _paths(self, step: int) -> tuple[Path, Path, Path, Path]:
        name = _STEP_FORMAT.format(step)
        return (
            self.root / name,
            self.root / f"{name}.tmp",
            self.root / f"{name}.src",
            self.root / f"{name}.log",
        )

    def _clean_leftovers(self) -> None:
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.suffix in (".tmp", ".src") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def _pin(self, request: _Export) -> None:
        """Hard-link the checkpoint's model files into ``step_N.src`` (no data is copied), so
        that pruning the checkpoint does not pull them from under the export."""
        _, _, src, _ = self._paths(request.step)
        shutil.rmtree(src, ignore_errors=True)
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

    def _unpin(self, step: int) -> None:
        shutil.rmtree(self._paths(step)[2], ignore_errors=True)

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
    """In the export process before it runs the converter: SIGKILL when the trainer dies
    (Linux ``PR_SET_PDEATHSIG``, kept across exec), as the async checkpoint writer is. A
    killed trainer's export went on writing ``hf/step_N.tmp`` under PID 1, where the requeued
    job's clean-up of leftovers then deleted it under the writer."""
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
