"""A persistent pool of worker processes with a hard per-task time limit.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one stuck task (a sympy
evaluation inside a C big-integer routine ignores signals) and a worker that dies breaks
the whole executor. Here every task has limits measured by the parent: CPU time of the
worker (from ``/proc``; load on the machine does not make it run out, so a task gets the
same outcome under load) and a wall-clock backstop. On either, the worker is SIGKILLed and
replaced, and the task reports ``timeout``. A worker that dies while it runs a task (killed
from outside, out of memory, a crash in C) is replaced and the task runs once more on
another worker, with a warning; a task whose worker dies twice reports ``crashed``, as the
count of deaths in ``TaskResult.crashes`` does for every task. Workers are fresh
interpreters (``sys.executable -c``), so they inherit neither the trainer's threads nor its
CUDA state nor its ``__main__``, and each one installs a guard (``guard.install_guard``) that blocks process creation, network
and file writes before it accepts any task.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

# A worker that does not report ready within this time is considered failed at start.
_START_TIMEOUT_S = 120.0
# Consecutive start failures after which the pool gives up (a broken environment).
_MAX_START_FAILURES = 3
# Times a task runs again after the worker running it died (a second death: ``crashed``).
_RETRIES_AFTER_DEATH = 1
# How often the parent reads the CPU time of busy workers.
_POLL_S = 0.05
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return None


class WorkersUnavailable(RuntimeError):
    """Worker processes fail to start (again and again): a broken environment, not a task."""


@dataclass
class TaskResult:
    """Outcome of one task: ``status`` is ok | timeout | error (the task raised, or its
    result could not be read) | crashed (its worker died twice)."""

    status: str
    value: Any = None
    error: str = ""
    blocked: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0  # wall-clock time from sending the task to its result
    crashes: int = 0  # workers that died while running the task (it ran again after one)


def _exit_reason(returncode: int | None) -> str:
    """How a worker process ended, in words (``killed by SIGKILL``, ``exit status 3``)."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _vm_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _worker_main(conn: Connection) -> None:
    """Worker loop: (init, memory_mb) first, then (task_id, fn, args) -> result messages
    ``(status, task_id, payload, blocked)`` that carry the task's id back."""
    # The trainer ends its workers (SIGKILL, or EOF on the socket when it dies). A SIGTERM /
    # SIGUSR1 to the job's whole process group (preemption) is the trainer's to handle: a
    # worker killed by it would score its task "crashed" (reward 0) in the step in progress.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    from megatron_rl.rewards import guard

    try:
        init, memory_mb = conn.recv()
        if init is not None:
            init()
        if memory_mb > 0:
            limit = _vm_bytes() + memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        guard.install_guard(write_dirs=())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        conn.send(("failed", None, f"{type(exc).__name__}: {exc}", []))
        return
    conn.send(("ready", None, os.getpid(), []))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        task_id, fn, args = message
        before = len(guard.blocked_events())
        try:
            value = fn(*args)
            status, payload = "ok", value
        except BaseException as exc:  # noqa: BLE001 - a task's failure is data
            status, payload = "error", describe_exception(exc)
        blocked = guard.blocked_events()[before:]
        try:
            conn.send((status, task_id, payload, blocked))
        except Exception as exc:  # noqa: BLE001 - a result that cannot be sent is an error
            conn.send(("error", task_id, f"unsendable result: {describe_exception(exc)}", blocked))


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` of an exception, cut to 300 characters (its ``str`` may
    itself raise: an int past the digit limit, a hostile ``__str__``)."""
    try:
        message = str(exc)[:300]
    except Exception:  # noqa: BLE001
        message = "(no message)"
    return f"{type(exc).__name__}: {message}"


def _child_entry(fd: int) -> None:
    """Entry point of a worker process started by ``_Worker``."""
    _worker_main(Connection(fd))


class _Worker:
    """One worker: a fresh interpreter (not a multiprocessing child, so the caller's
    ``__main__`` is never re-imported) talking over a socketpair."""

    def __init__(self, init: Callable[[], None] | None, memory_mb: int) -> None:
        parent, child = socket.socketpair()
        command = (
            "import sys; from megatron_rl.rewards.workers import _child_entry; "
            f"_child_entry({child.fileno()})"
        )
        env = dict(os.environ)
        # The caller's import path, so that task functions it names can be imported.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.process = subprocess.Popen(
            [sys.executable, "-c", command], pass_fds=(child.fileno(),), env=env
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send((init, memory_mb))
        self.started = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0  # wall clock
        self.sent = 0.0  # wall clock when its task was sent
        self.cpu_start: float | None = None  # CPU seconds of the worker when its task began

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("reward worker %d did not exit after SIGKILL", self.process.pid)
        self.conn.close()


class WorkerPool:
    """``num_workers`` persistent processes running picklable module-level functions.

    Args:
        num_workers: processes kept alive (killed ones are replaced).
        timeout_s: CPU-time limit of one task, measured by the parent (a wall-clock limit
            where the worker's CPU time cannot be read).
        wall_timeout_s: wall-clock backstop of one task (None: ``4 * timeout_s + 10``).
        memory_mb: address-space limit of a worker beyond its size after ``init`` (0: none).
        init: picklable function each worker calls once before its guard is installed
            (imports, warm-up); not counted in any task's time.
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        memory_mb: int = 0,
        init: Callable[[], None] | None = None,
        wall_timeout_s: float | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.wall_timeout_s = 4 * self.timeout_s + 10 if wall_timeout_s is None else wall_timeout_s
        if self.wall_timeout_s < self.timeout_s:
            raise ValueError(f"wall_timeout_s must be >= timeout_s ({self.timeout_s})")
        self._memory_mb = memory_mb
        self._init = init
        self._workers = [self._spawn() for _ in range(num_workers)]
        self._start_failures = 0
        self.num_killed = 0  # workers killed at a task's time limit
        self.num_crashed = 0  # workers that died while running a task
        # The running map's tasks to send and its count of deaths per task.
        self._pending: deque[int] = deque()
        self._deaths: list[int] = []
        self._batch = 0  # maps run so far: a task's id is (its map, its index)

    def _spawn(self) -> _Worker:
        return _Worker(self._init, self._memory_mb)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._spawn()

    def map(self, fn: Callable[..., Any], args_list: Sequence[tuple]) -> list[TaskResult]:
        """Run ``fn(*args)`` for every ``args`` in parallel; results in input order. A task
        whose worker dies runs once more (``TaskResult.crashes``). Raises
        ``WorkersUnavailable`` when workers fail to start again and again."""
        if self._workers is None:
            raise RuntimeError("WorkerPool is closed")
        results: list[TaskResult | None] = [None] * len(args_list)
        pending = deque(range(len(args_list)))
        deaths = [0] * len(args_list)
        self._pending, self._deaths = pending, deaths
        self._batch += 1
        try:
            while pending or any(w.task is not None for w in self._workers):
                for worker in self._workers:
                    if worker.ready and worker.task is None and pending:
                        self._send(worker, pending.popleft(), fn, args_list, results)
                self._wait_and_collect(results)
                self._enforce_deadlines(results)
        except BaseException:
            # A map left half-done (a task that does not pickle, an interrupt): its tasks
            # still running would answer the next map, whose items have the same indices.
            self._abandon_tasks()
            raise
        done = [r if r is not None else TaskResult("crashed") for r in results]
        for result, crashes in zip(done, deaths):
            result.crashes = crashes
        return done

    def _send(
        self,
        worker: _Worker,
        index: int,
        fn: Callable[..., Any],
        args_list: Sequence[tuple],
        results: list[TaskResult | None],
    ) -> None:
        """Give task ``index`` of the running map to the idle ``worker``. Its id is
        (map, index): the reply must carry it (``_wait_and_collect``)."""
        worker.task = index
        worker.cpu_start = _cpu_seconds(worker.process.pid)
        limit = self.timeout_s if worker.cpu_start is None else self.wall_timeout_s
        worker.sent = time.monotonic()
        worker.deadline = worker.sent + limit
        try:
            worker.conn.send(((self._batch, index), fn, args_list[index]))
        except (OSError, ValueError):
            self._on_death(worker, results)

    def _abandon_tasks(self) -> None:
        """Kill and replace the workers that run a task of a map that ended early: what
        they send back is never read, by this map or by the next."""
        for worker in list(self._workers or []):
            if worker.task is not None:
                worker.task = None
                self._replace(worker)

    def _wait_and_collect(self, results: list[TaskResult | None]) -> None:
        now = time.monotonic()
        busy = [w for w in self._workers if w.task is not None]
        starting = [w for w in self._workers if not w.ready]
        deadlines = [w.deadline for w in busy] + [w.started + _START_TIMEOUT_S for w in starting]
        deadlines += [now + _POLL_S for w in busy if w.cpu_start is not None]
        timeout = max(0.0, min(deadlines) - now) if deadlines else 0.0
        by_conn = {w.conn: w for w in busy + starting}
        for conn in wait(list(by_conn), timeout=timeout):
            worker = by_conn[conn]
            try:
                status, task_id, payload, blocked = conn.recv()
            except (EOFError, OSError):
                self._on_death(worker, results)
                continue
            except Exception as exc:  # noqa: BLE001 - a message read whole that won't unpickle
                if worker.task is None:
                    self._on_start_failure(worker, f"unreadable message: {describe_exception(exc)}")
                    continue
                results[worker.task] = TaskResult(
                    "error", error=f"unreadable result: {describe_exception(exc)}"
                )
                worker.task = None
                continue
            if status == "ready":
                worker.ready, self._start_failures = True, 0
            elif status == "failed":
                self._on_start_failure(worker, payload)
            elif worker.task is not None and task_id == (self._batch, worker.task):
                value, error = (payload, "") if status == "ok" else (None, payload)
                elapsed = time.monotonic() - worker.sent
                results[worker.task] = TaskResult(status, value, error, list(blocked), elapsed)
                if blocked:
                    logger.warning("reward worker blocked %s", blocked)
                worker.task = None

    def _on_death(self, worker: _Worker, results: list[TaskResult | None]) -> None:
        task = worker.task
        if task is None and not worker.ready:
            self._on_start_failure(worker, "worker exited before it was ready")
            return
        if task is not None:
            worker.kill()  # reaped: its exit status says how it ended
            how = _exit_reason(worker.process.returncode)
            self.num_crashed += 1
            self._deaths[task] += 1
            if self._deaths[task] <= _RETRIES_AFTER_DEATH:
                logger.warning(
                    "reward worker %d died (%s) while running task %d of a batch; the task "
                    "runs again on a new worker",
                    worker.process.pid,
                    how,
                    task,
                )
                self._pending.appendleft(task)
            else:
                logger.warning(
                    "reward worker %d died (%s) while running task %d again: the task is "
                    "reported crashed (no verdict)",
                    worker.process.pid,
                    how,
                    task,
                )
                results[task] = TaskResult("crashed", error=f"its worker died twice ({how})")
        self._replace(worker)

    def _on_start_failure(self, worker: _Worker, reason: str) -> None:
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            self.close()
            raise WorkersUnavailable(
                f"reward workers fail to start ({_MAX_START_FAILURES} times in a row): {reason}"
            )
        logger.warning("reward worker failed to start (%s); retrying", reason)
        self._replace(worker)

    def _enforce_deadlines(self, results: list[TaskResult | None]) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and (now >= worker.deadline or self._out_of_cpu(worker)):
                results[worker.task] = TaskResult(
                    "timeout",
                    error=f"over {self.timeout_s}s of CPU or {self.wall_timeout_s}s",
                    elapsed_s=now - worker.sent,
                )
                self.num_killed += 1
                self._replace(worker)
            elif not worker.ready and now >= worker.started + _START_TIMEOUT_S:
                self._on_start_failure(worker, f"not ready after {_START_TIMEOUT_S}s")

    def _out_of_cpu(self, worker: _Worker) -> bool:
        if worker.cpu_start is None:
            return False
        used = _cpu_seconds(worker.process.pid)
        return used is not None and used - worker.cpu_start >= self.timeout_s

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and diagnostics)."""
        return [w.process.pid for w in self._workers or [] if w.process.pid is not None]

    def close(self) -> None:
        """Stop all workers (they hold no state: a short grace period, then SIGKILL)."""
        workers, self._workers = self._workers, None
        for worker in workers or []:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 0.5
        for worker in workers or []:
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            worker.kill()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
