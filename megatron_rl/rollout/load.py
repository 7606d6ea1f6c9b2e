"""Time integrals of a step function: sequences in flight, observed when they change."""

from __future__ import annotations

import time
from collections.abc import Callable


class InFlightClock:
    """Time integral of the sequences in flight, a step function: ``observe`` the new amount
    whenever it changes (the amount since the last observation held until now)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.reset(0)

    def reset(self, in_flight: int) -> None:
        self.start = self.last = self.clock()
        self.value = in_flight
        self.area = self.idle = 0.0

    def observe(self, in_flight: int) -> None:
        now = self.clock()
        dt = max(now - self.last, 0.0)
        self.area += self.value * dt
        self.idle += dt if self.value == 0 else 0.0
        self.last, self.value = now, in_flight

    def averages(self) -> tuple[float, float]:
        """(mean sequences in flight, idle fraction) since the last ``reset``."""
        span = self.last - self.start
        if span <= 0:
            return float(self.value), float(self.value == 0)
        return self.area / span, self.idle / span
