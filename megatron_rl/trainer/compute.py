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
at a lower priority and are not counted (:func:`background`).

The count is resumable: a checkpoint stores the hours so far, and time while the job was down
is not counted. Work redone after a resume (from the checkpoint to the crash) is counted
again: it was spent again.
"""

from __future__ import annotations

import logging
import os
import time
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


class WorkCPUClock:
    """CPU seconds (user + system, every thread) spent so far by the run's work processes:
    this process and its descendants, less :func:`background` ones and their descendants.
    Monotonic: each process adds what it spent since it was last seen (a process that ends
    keeps what it had; what it spent after its last look is lost). A descendant found
    after the first call counts from its start; the processes that exist at the first call
    count from then. Descendants are looked up at most every ``refresh`` wall seconds (a
    scan of the process table); CPU times are read at every call.

    Args:
        root: the process whose tree is counted (default: this one).
        others: more trees to count (the other trainer ranks on this host).
        refresh: wall seconds between two scans for new descendants.
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
        self._total = 0.0
        self._started = False

    def _scan(self) -> None:
        """The work processes: a walk of the tree that skips background subtrees."""
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

    def __call__(self) -> float:
        psutil = self._psutil
        now = time.monotonic()
        if now - self._scanned >= self._refresh:
            self._scan()
            self._scanned = now
        for proc in self._procs:
            if proc.pid in _BACKGROUND:
                continue
            try:
                times = proc.cpu_times()
                key = (proc.pid, proc.create_time())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            cpu = times.user + times.system
            if proc not in self._roots:  # ended children of a worker (e.g. a sandbox)
                cpu += times.children_user + times.children_system
            before = self._seen.get(key, cpu if not self._started else 0.0)
            self._seen[key] = cpu
            self._total += max(0.0, cpu - before)
        self._started = True
        return self._total
