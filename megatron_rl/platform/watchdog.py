"""Hang detection of a trainer rank (``training.hang_timeout_minutes``): a hang becomes a
restart, not a lost day.

A rank stuck outside a collective (a deadlock, a stuck filesystem) is seen by nobody: the
other ranks wait in their next collective until its timeout (``parallel.timeout_minutes``,
30 min by default) and then fail without saying where, or the stuck rank waits forever. Each
rank therefore runs a :class:`HangWatchdog`: the training loop calls :func:`beat` at each
phase (a batch, the update, the push, validation, a checkpoint; the main rank also while it
waits on the generator pool); a thread checks that a beat came within the timeout. When none
did, it writes every thread's Python stack (``faulthandler``) to
``RUN_DIR/hang/rank_N.txt`` and exits the process with :data:`HANG_EXIT_CODE`.

Who reports what: a rank stuck outside a collective reports itself. A rank stopped by the
kernel (SIGSTOP) cannot (its threads stop too); the ranks that wait for it in their next
collective report, since those waits are judged: every rank's stack that can be written is
in the directory. The one wait that is not judged (:func:`paused`) is the other ranks' wait
for the main rank's long work (a batch, validation), bounded by the collective's timeout: a
stopped *main* rank is thus found by that timeout, or by the external rank monitor below.
The sbatch script (megatron_rl/launch/template.py) requeues a job whose trainer left such
dumps; the requeued job resumes from the last checkpoint.

On GPU clusters, NVIDIA's resiliency library (``nvidia-resiliency-ext``) adds a rank monitor
outside the rank process (it also sees a rank that the kernel stopped, which no thread of
its own can): a rank started by its ``ft_launcher`` (``FT_RANK_MONITOR_IPC_SOCKET`` set)
sends each beat to that monitor too (:func:`_nvrx_client`), which then terminates the ranks
and restarts them in the job when heartbeats stop, as its configuration says. Tried on CPU
with nvidia-resiliency-ext 0.4.1 (installed apart, not a dependency): two gloo ranks beating
through this module under ``ft_launcher --max-restarts 1 --ft-rank-heartbeat-timeout 15``;
rank 0 SIGSTOPped: both monitors reported "Did not get subsequent heartbeat. Waited 15.00
seconds" 15 s later, the launcher killed the group and restarted it in the job, and the
restarted ranks finished (exit 0). Its GPU and NIC health checks need NVML (disabled on CPU).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The exit status of a rank that made no progress within training.hang_timeout_minutes.
# 75 is EX_TEMPFAIL of sysexits.h ("temporary failure; the user is invited to retry"), used by
# no other part of megatron_rl (the generator bridge exits 1, 3 or 4).
HANG_EXIT_CODE = 75
HANG_DIR = "hang"  # under the run directory: rank_N.txt, one per rank that fired
NVRX_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by nvidia-resiliency-ext's ft_launcher
NVRX_BEAT_SECONDS = 5.0  # at most one heartbeat to its rank monitor this often


class HangWatchdog:
    """Fires when no :meth:`beat` came for ``timeout_s`` (see the module docstring).
    ``exit``: what ends the process (``os._exit``: nothing may block it, not even a thread
    holding a lock that a clean exit would wait for)."""

    def __init__(
        self,
        timeout_s: float,
        dump_path: str | Path,
        rank: int,
        exit: Callable[[int], Any] = os._exit,
        nvrx: Any = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"hang timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.dump_path = Path(dump_path)
        self.rank = rank
        self._exit = exit
        self._nvrx = nvrx  # its client is not thread-safe: beats of this thread only
        self._owner = threading.get_ident()
        self._nvrx_sent = 0.0
        self._last = time.monotonic()
        self._phase = "start"
        self._paused = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def beat(self, phase: str) -> None:
        """Progress: ``phase`` begins (or goes on)."""
        with self._lock:
            self._last, self._phase = time.monotonic(), phase
        now = time.monotonic()
        owner = threading.get_ident() == self._owner
        if self._nvrx is not None and owner and now - self._nvrx_sent > NVRX_BEAT_SECONDS:
            self._nvrx_sent = now  # an IPC round trip: not at every pool poll
            self._nvrx.send_heartbeat()

    @contextlib.contextmanager
    def paused(self, phase: str) -> Iterator[None]:
        """Not judged inside (a wait that another timeout bounds); a beat on each side."""
        self.beat(phase)
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
            self.beat(f"after {phase}")

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(self.timeout_s / 10, 5.0)
        while not self._done.wait(poll):
            with self._lock:
                silent = time.monotonic() - self._last
                if self._paused:
                    self._last = time.monotonic()  # judged again from the pause's end
                    continue
                phase = self._phase
            if silent > self.timeout_s:
                self._fire(phase, silent)
                return

    def _fire(self, phase: str, silent: float) -> None:
        message = (
            f"trainer rank {self.rank} (pid {os.getpid()}) made no progress for {silent:.0f} s "
            f"(training.hang_timeout_minutes {self.timeout_s / 60:g}) in phase '{phase}'"
        )
        try:
            self.dump_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.dump_path, "w") as f:
                f.write(f"{message}\nPython stacks of every thread:\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"every thread's stack in {self.dump_path}"
        except OSError as err:  # a stuck or full filesystem may be the very cause
            where = f"could not write the stacks to {self.dump_path} ({err}); stderr has them"
            faulthandler.dump_traceback(all_threads=True)
        logger.critical("%s: %s; exiting with status %d", message, where, HANG_EXIT_CODE)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        self._exit(HANG_EXIT_CODE)


_current: HangWatchdog | None = None


def arm(timeout_minutes: float, run_dir: str | Path, rank: int) -> HangWatchdog | None:
    """Start this process's watchdog (None when ``timeout_minutes`` is 0: off); replaces one
    armed before. The beat also goes to nvidia-resiliency-ext's rank monitor when this rank
    runs under its launcher."""
    global _current
    disarm()
    if timeout_minutes <= 0:
        return None
    path = Path(run_dir) / HANG_DIR / f"rank_{rank}.txt"
    _current = HangWatchdog(timeout_minutes * 60, path, rank, nvrx=_nvrx_client()).start()
    return _current


def disarm() -> None:
    global _current
    if _current is not None:
        _current.stop()
        if _current._nvrx is not None:
            with contextlib.suppress(Exception):
                _current._nvrx.shutdown_workload_monitoring()
        _current = None


def beat(phase: str) -> None:
    """Progress of this rank (a no-op when no watchdog is armed)."""
    if _current is not None:
        _current.beat(phase)


@contextlib.contextmanager
def paused(phase: str) -> Iterator[None]:
    """A wait that another timeout bounds (a no-op when no watchdog is armed)."""
    if _current is None:
        yield
        return
    with _current.paused(phase):
        yield


def _nvrx_client() -> Any:
    """nvidia-resiliency-ext's rank monitor client when this rank was started by its
    ``ft_launcher`` (which sets the monitor's socket), else None. An optional GPU-cluster
    dependency: without it, or outside its launcher, our own watchdog acts alone."""
    if not os.environ.get(NVRX_SOCKET_ENV):
        return None
    try:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    except ImportError:
        logger.warning(
            "%s is set (ft_launcher) but nvidia-resiliency-ext is not installed: hang "
            "detection uses training.hang_timeout_minutes only",
            NVRX_SOCKET_ENV,
        )
        return None
    client = RankMonitorClient()
    client.init_workload_monitoring()
    return client
