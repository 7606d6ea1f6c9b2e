"""GPU-hours accounting: the x axis of the compute-performance curve (docs/scaling.md).

Every second of the run is charged, times the run's devices (trainers + generators), to one
*category*:

- ``train``: the training loop itself: waiting for generation, updates, weight pushes and the
  per-step bookkeeping. ``gpu_hours`` is this category alone: the paper's x axis
  ("RL training compute"), which must not depend on how often the run validates or saves.
- ``validation``, ``checkpoint``, ``startup`` (building the model, the warm start, starting
  the engines, the first push) and ``shutdown`` (after the last step): accounted apart.

``total_gpu_hours`` is the sum of all categories: wall hours x devices, as a bill would show.

Validation blocks the trainer, but under PipelineRL the generators keep decoding the
training requests in flight while they answer the validation requests (generators never
idle). That work is training compute: the caller measures the tokens generated for each
during the window and hands the training share back (``Window.train_fraction``), so a run
that validates every step and one that validates every 10 steps reach equal ``gpu_hours`` at
equal steps. The token share is a cost model, exact when every token costs the same: true of
saturated generators (production); on a tiny CPU run a few training requests riding along
a large validation batch cost less than alone, and the share undercounts them slightly.

On a CPU run the seconds are CPU seconds, not wall seconds (:class:`WorkCPUClock`): the
CPU time of the run's work processes (the trainer with its in-process engines, engine and
reward-worker processes), with ``devices`` 1. A CPU is shared: on a loaded machine (other
jobs, the run's own background fits) wall time stretches with the load and charged the
training steps with the live forecast's and other jobs' work (validating every step gave
2.5x the ``gpu_hours`` of validating every 10 steps at step 10, measured here), while CPU
time counts the work done. Background helpers (the live forecast's fits, HF exports) run
at a lower priority and are not counted (:func:`background`), nor is what follows wall time
rather than work: gloo's polling threads and the clock's own readings (:class:`WorkCPUClock`).

The count is resumable: a checkpoint stores the hours so far, and time while the job was down
is not counted. Work redone after a resume (from the checkpoint to the crash) is counted
again: it was spent again.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Window:
    """A stretch of time charged to a non-training category; ``train_fraction`` of it
    (0..1, set by the caller before the window closes) is charged to ``train`` instead."""

    category: str
    train_fraction: float = 0.0


CATEGORIES = ("startup", "train", "validation", "checkpoint", "shutdown")


class ComputeClock:
    """Accumulates device-hours of the run per category, across restarts.

    The clock starts in ``startup``; :meth:`begin` switches the running category (the loop
    calls ``begin("train")`` before the first step) and :meth:`window` charges a block of
    code to another category, then returns to the running one.

    Args:
        devices: accelerator devices the run occupies now (1 with a CPU-time ``clock``).
        clock: monotonic source of the seconds charged: wall time on GPU, the work
            processes' CPU time on CPU (:class:`WorkCPUClock`); injectable for tests.
        wall: monotonic wall time (``wall_hours``).
    """

    def __init__(
        self,
        devices: int,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be an int >= 1, got {devices!r}")
        self.devices = devices
        self._clock = clock
        self._wall = wall
        self._mark = clock()
        self._wall_mark = wall()
        self._category = "startup"
        self._hours = dict.fromkeys(CATEGORIES, 0.0)  # device-hours of finished stretches
        self._wall_hours = 0.0

    def _settle(self) -> None:
        """Charge the time since the last mark to the running category."""
        now, wall = self._clock(), self._wall()
        hours = max(0.0, now - self._mark) / 3600.0
        self._mark = now
        self._hours[self._category] += hours * self.devices
        self._wall_hours += max(0.0, wall - self._wall_mark) / 3600.0
        self._wall_mark = wall

    def begin(self, category: str) -> None:
        """Charge time from now on to ``category``."""
        _check_category(category)
        self._settle()
        self._category = category

    @contextmanager
    def window(self, category: str) -> Iterator[Window]:
        """Charge the time spent in the block to ``category`` (but the ``train_fraction`` the
        caller sets, which goes to ``train``), then return to the running category."""
        _check_category(category)
        self._settle()
        before, self._category = self._category, category
        spent_before = self._hours[category]
        window = Window(category)
        try:
            yield window
        finally:
            self._settle()
            self._category = before
            share = min(max(float(window.train_fraction), 0.0), 1.0)
            moved = (self._hours[category] - spent_before) * share
            self._hours[category] -= moved
            self._hours["train"] += moved

    def hours(self, category: str) -> float:
        """Device-hours charged to ``category`` so far."""
        _check_category(category)
        self._settle()
        return self._hours[category]

    @property
    def gpu_hours(self) -> float:
        """Training device-hours: generation, updates and pushes of the loop (the x axis)."""
        return self.hours("train")

    @property
    def total_gpu_hours(self) -> float:
        """Device-hours of the whole run (every category: wall hours x devices)."""
        self._settle()
        return sum(self._hours.values())

    @property
    def wall_hours(self) -> float:
        """Wall-clock hours of the run (all segments)."""
        self._settle()
        return self._wall_hours

    def summary(self) -> dict[str, float]:
        """``gpu_hours``, ``total_gpu_hours`` and ``<category>_gpu_hours`` of the others."""
        self._settle()
        out = {"gpu_hours": self._hours["train"], "total_gpu_hours": sum(self._hours.values())}
        for category in CATEGORIES:
            if category != "train":
                out[f"{category}_gpu_hours"] = self._hours[category]
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain state for a checkpoint."""
        self._settle()
        return {
            "gpu_hours": self._hours["train"],
            "hours": dict(self._hours),
            "wall_hours": self._wall_hours,
            "devices": self.devices,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: its hours plus time from now on (downtime and the time
        since this clock started are not counted; the running category is kept). The device
        count stays this run's (a resumed job may have another allocation)."""
        if "gpu_hours" not in state:
            raise ValueError(f"compute clock state lacks 'gpu_hours': {sorted(state)}")
        hours = dict.fromkeys(CATEGORIES, 0.0)
        if "hours" in state:
            hours.update({k: float(v) for k, v in state["hours"].items() if k in hours})
        else:  # a checkpoint from before the split: its gpu_hours were wall x devices
            logger.warning("checkpoint clock has no per-category hours: all counted as training")
            hours["train"] = float(state["gpu_hours"])
        self._hours = hours
        self._wall_hours = float(state.get("wall_hours", 0.0))
        self._mark = self._clock()
        self._wall_mark = self._wall()


def generation_share(train_tokens: float, other_tokens: float) -> float:
    """Fraction of a generation window spent on training requests, by generated tokens."""
    total = train_tokens + other_tokens
    return 0.0 if total <= 0 else min(max(train_tokens / total, 0.0), 1.0)


def run_devices(trainer_ranks: int, engines: int, engine_devices: int, gpu: bool) -> int:
    """Devices the run occupies: on GPU, the trainer's GPUs plus ``engines x engine_devices``
    generator GPUs; on CPU, the trainer's processes plus one process per generator engine
    that runs in its own process (pass ``engines=0`` for engines inside the trainer)."""
    if trainer_ranks < 1 or engines < 0 or engine_devices < 1:
        raise ValueError(
            f"need trainer_ranks >= 1, engines >= 0, engine_devices >= 1; got "
            f"{trainer_ranks}, {engines}, {engine_devices}"
        )
    return trainer_ranks + engines * (engine_devices if gpu else 1)


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"unknown compute category {category!r}; one of {CATEGORIES}")


# Processes of the run that do background work (the live forecast's fits, HF exports): not
# training compute. Marked by their starter, in this process, before any clock reads again.
_BACKGROUND: set[int] = set()


def background(pid: int) -> None:
    """Mark process ``pid`` (and its descendants) as background work: :class:`WorkCPUClock`
    does not count it."""
    _BACKGROUND.add(int(pid))


# Threads that poll whatever the run does: gloo's TCP transport loop (one thread per process
# group, about 37 in a trainer) wakes every 10 ms (epoll_wait with a 10 ms timeout), idle or
# not: 36 ms of CPU a wall second in a trainer here. Counted, training compute would grow
# with the wall time (the machine's load), which the CPU-time axis is there to leave out.
POLLING_THREADS = frozenset({"gloo_tcp_loop"})


class WorkCPUClock:
    """CPU seconds (user + system, every thread) spent so far by the run's work processes:
    this process and its descendants, less :func:`background` ones and their descendants.
    Monotonic: each process adds what it spent since it was last seen (a process that ends
    keeps what it had; what it spent after its last look is lost). A descendant found
    after the first call counts from its start; the processes that exist at the first call
    count from then. Descendants are looked up at most every ``refresh`` wall seconds (a
    scan of the process table); CPU times are read at every call.

    Left out as well, being proportional to wall time rather than to work:

    - threads that poll (:data:`POLLING_THREADS`), from when a scan finds them (their
      name), read to the nanosecond (``/proc/<pid>/task/<tid>/schedstat``);
    - the clock's own reading (:attr:`own`): a scan walks the whole process table (3-7 ms
      of CPU here, more on a busier machine) once a wall second. This process, read last,
      is read to the nanosecond (``time.process_time``; /proc has 10 ms ticks), so that the
      reading's own CPU time (``time.thread_time``) is taken off exactly.

    Args:
        root: the process whose tree is counted (default: this one).
        others: more trees to count (the other trainer ranks on this host).
        refresh: wall seconds between two scans for new descendants and threads.
    """

    def __init__(
        self, root: int | None = None, others: Sequence[int] = (), refresh: float = 1.0
    ) -> None:
        import psutil

        self._psutil = psutil
        self._root = psutil.Process(root if root is not None else os.getpid())
        self._roots = [self._root, *(psutil.Process(pid) for pid in others)]
        self._refresh = refresh
        self._procs: list = []
        self._scanned = -float("inf")
        self._seen: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU seconds
        self._pollers: dict[tuple[int, int], list] = {}  # (pid, tid) -> [fd, CPU seconds]
        weakref.finalize(self, _close_pollers, self._pollers)  # their fds, with the clock
        self._polled: dict[int, float] = {}  # pid -> CPU seconds of its polling threads
        self._total = 0.0
        self._started = False
        self.own = 0.0  # CPU seconds of this clock's calls, left out of the count

    def _scan(self) -> None:
        """The work processes: a walk of the tree that skips background subtrees; their
        polling threads."""
        psutil = self._psutil
        procs, todo = list(self._roots), list(self._roots)
        while todo:
            try:
                children = todo.pop().children()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for child in children:
                if child.pid not in _BACKGROUND:
                    procs.append(child)
                    todo.append(child)
        self._procs = procs
        live = {proc.pid for proc in procs}
        self._polled = {pid: cpu for pid, cpu in self._polled.items() if pid in live}
        for proc in procs:
            try:
                tids = os.listdir(f"/proc/{proc.pid}/task")
            except OSError:
                continue
            for tid in tids:
                key = (proc.pid, int(tid))
                if key not in self._pollers and _thread_name(*key) in POLLING_THREADS:
                    try:
                        fd = os.open(f"/proc/{key[0]}/task/{key[1]}/schedstat", os.O_RDONLY)
                    except OSError:
                        continue
                    self._pollers[key] = [fd, _thread_cpu(fd)]

    def _read_pollers(self) -> None:
        """Add what each polling thread spent since the last call to its process's count."""
        for key, poller in list(self._pollers.items()):
            cpu = _thread_cpu(poller[0])
            if cpu is None:  # the thread has ended (its fd reads no more)
                os.close(poller[0])
                del self._pollers[key]
                continue
            if poller[1] is not None:
                self._polled[key[0]] = self._polled.get(key[0], 0.0) + max(0.0, cpu - poller[1])
            poller[1] = cpu

    def __call__(self) -> float:
        psutil = self._psutil
        started = time.thread_time()
        now = time.monotonic()
        if now - self._scanned >= self._refresh:
            self._scan()
            self._scanned = now
        self._read_pollers()  # before the processes: their readings hold what is taken off
        mine = os.getpid()
        me = None
        for proc in self._procs:
            if proc.pid in _BACKGROUND:
                continue
            if proc.pid == mine:
                me = proc
                continue
            try:
                times = proc.cpu_times()
                key = (proc.pid, proc.create_time())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            cpu = times.user + times.system
            if proc not in self._roots:  # ended children of a worker (e.g. a sandbox)
                cpu += times.children_user + times.children_system
            self._count(key, cpu - self._polled.get(proc.pid, 0.0))
        if me is not None:
            # Last, so that this call's CPU time so far is in the reading, and is taken off
            # it: what is left of the call (microseconds) counts in the next reading.
            cpu = time.process_time()
            self.own += time.thread_time() - started
            self._count((mine, me.create_time()), cpu - self.own - self._polled.get(mine, 0.0))
        self._started = True
        return self._total

    def _count(self, key: tuple[int, float], work: float) -> None:
        """Add what process ``key`` spent on work since it was last seen (``work``: its CPU
        time so far, less what is left out)."""
        before = self._seen.get(key, work if not self._started else 0.0)
        self._seen[key] = max(before, work)
        self._total += max(0.0, work - before)


def _close_pollers(pollers: dict[tuple[int, int], list]) -> None:
    for fd, _ in pollers.values():
        os.close(fd)
    pollers.clear()


def _thread_name(pid: int, tid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _thread_cpu(fd: int) -> float | None:
    """A thread's CPU seconds from its open schedstat (None once it has ended)."""
    try:
        return int(os.pread(fd, 64, 0).split()[0]) / 1e9
    except (OSError, IndexError, ValueError):
        return None
