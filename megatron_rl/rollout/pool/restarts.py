"""How often a dead engine may be restarted, and the errors when it may not."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_rl.rollout.engine.output import log_tail

if TYPE_CHECKING:
    from megatron_rl.rollout.config import RolloutConfig


class RestartBudget:
    """At most ``max_restarts`` restarts of one engine within ``window_seconds``."""

    def __init__(
        self,
        max_restarts: int,
        window_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts = max_restarts
        self.window_seconds = window_seconds
        self.clock = clock
        self.total = 0  # restarts of every engine so far
        self._times: dict[int, list[float]] = {}

    def recent(self, index: int) -> int:
        """Restarts of engine ``index`` within the window that ends now."""
        start = self.clock() - self.window_seconds
        times = [t for t in self._times.get(index, []) if t > start]
        self._times[index] = times
        return len(times)

    def take(self, index: int) -> bool:
        """Record a restart of engine ``index`` if the budget allows one (else False)."""
        if self.recent(index) >= self.max_restarts:
            return False
        self._times[index].append(self.clock())
        self.total += 1
        return True


def refusal_message(
    index: int,
    placement: str,
    devices: str,
    budget: RestartBudget,
    log_path: str | None,
    why: str = "exited unexpectedly",
) -> str:
    """The error when engine ``index`` dies and may not be restarted."""
    minutes = budget.window_seconds / 60
    text = (
        f"vLLM engine {index} {why} (placement {placement}, devices {devices}); it was "
        f"restarted {budget.recent(index)} time(s) in the last {minutes:g} min, and "
        f"rollout.engine_max_restarts is {budget.max_restarts} per "
        f"rollout.engine_restart_window_minutes {minutes:g}"
    )
    return text + _with_log(log_path)


def broken_group_message(
    index: int, config: RolloutConfig, devices: str, doing: str, log_path: str | None
) -> str:
    """The error when engine ``index``, a member of a group transport (``nccl``), dies while
    the group is ``doing`` something (forming, a push): its peers cannot be freed."""
    return (
        f"vLLM engine {index} (placement {config.placement}, devices {devices}) exited while "
        f"{doing} (rollout.weight_transport {config.weight_transport}) was under way: the "
        "other members' workers wait in a collective that vLLM 0.32's PyNccl cannot abort, "
        "so the run stops here; resume it from its last checkpoint" + _with_log(log_path)
    )


def _with_log(log_path: str | None) -> str:
    tail = log_tail(log_path)
    return f"\nlast lines of its log ({log_path}):\n{tail}" if tail else ""
