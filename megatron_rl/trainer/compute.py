"""GPU-hours accounting: the x axis of the compute-performance curve.

``gpu_hours`` = wall hours x the accelerator devices of the run (trainers + generators; on a
CPU run: the trainer and generator processes). The count is resumable: a checkpoint stores
the hours so far, and time while the job was down is not counted. Work redone after a
resume (from the checkpoint to the crash) is counted again: it was spent again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class ComputeClock:
    """Accumulates device-hours of the run across restarts.

    Args:
        devices: accelerator devices (or CPU processes) the run occupies now.
        clock: monotonic time source in seconds (injectable for tests).
    """

    def __init__(self, devices: int, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be an int >= 1, got {devices!r}")
        self.devices = devices
        self._clock = clock
        self._start = clock()
        self._gpu_hours_before = 0.0
        self._wall_hours_before = 0.0

    def _segment_hours(self) -> float:
        return max(0.0, self._clock() - self._start) / 3600.0

    @property
    def wall_hours(self) -> float:
        """Wall-clock hours of the run (all segments)."""
        return self._wall_hours_before + self._segment_hours()

    @property
    def gpu_hours(self) -> float:
        """Device-hours of the run (all segments, each at its own device count)."""
        return self._gpu_hours_before + self._segment_hours() * self.devices

    def state_dict(self) -> dict[str, Any]:
        """Plain state for a checkpoint."""
        return {
            "gpu_hours": self.gpu_hours,
            "wall_hours": self.wall_hours,
            "devices": self.devices,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: its hours plus time from now on (downtime not counted).
        The device count stays this run's (a resumed job may have another allocation)."""
        if "gpu_hours" not in state:
            raise ValueError(f"compute clock state lacks 'gpu_hours': {sorted(state)}")
        self._gpu_hours_before = float(state["gpu_hours"])
        self._wall_hours_before = float(state.get("wall_hours", 0.0))
        self._start = self._clock()


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
