"""The pool's engines as processes: started, watched, restarted (engines are cattle).

:class:`EngineSupervisor` owns the launcher of ``rollout.placement`` and the one event source
of all its engines. It reads the events, keeps what says that an engine lives (``Ready``,
``Alive``: ``rollout.engine_stall_timeout``) and hands every other event, in order, to the
handler the pool gave it (:class:`EngineEvents`). An engine that died, or stalled (killed
here), is restarted on its devices within ``rollout.engine_max_restarts``: the handler first
gets the complete events it sent, then is asked whether the death can be survived now
(``on_death`` raises when not), then gets the new engine (``on_restart``: its requests are
resubmitted there). What cannot go on raises; the pool closes itself.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine.runner import engine_devices
from megatron_rl.rollout.messages import EVENTS, Alive, Event, Failed, Ready, Stop
from megatron_rl.rollout.pool.launchers import EngineHandle, EngineLauncher
from megatron_rl.rollout.pool.restarts import RestartBudget, refusal_message

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0


@dataclass(eq=False)
class EngineRecord:
    """What the pool knows of one engine, around its handle (a new record on a restart)."""

    index: int
    handle: EngineHandle
    oldest: int | None = None  # oldest version in flight, as last reported
    max_model_len: int = 0
    ready: bool = False  # built, answering commands
    current: bool = True  # runs the pool's policy version: may take requests
    # its beats (``Alive``): the last event's time, the length of its step under way then
    beating: bool = False
    last_seen: float = 0.0
    step_seconds: float = 0.0


@dataclass(frozen=True)
class EngineEvents:
    """What the supervisor hands on, to callables of the pool."""

    # an engine's event other than ``Ready``, ``Alive`` and ``Failed`` (which raises)
    on_event: Callable[[Event], None]
    # (engine, where it ran in words): it died, its complete events handled; raises if that
    # cannot be survived now
    on_death: Callable[[EngineRecord, str], None]
    # (old, new, why): ``old`` was replaced by ``new`` (starting; ``Ready`` when it is up)
    on_restart: Callable[[EngineRecord, EngineRecord, str], None]


class EngineSupervisor:
    """The engines of one pool (see the module docstring); driven from the pool's thread."""

    def __init__(
        self, config: RolloutConfig, launcher: EngineLauncher, handler: EngineEvents
    ) -> None:
        self.config = config
        self._launcher = launcher
        self._events = launcher.events
        self._handler = handler
        window = config.engine_restart_window_minutes * 60
        self._restarts = RestartBudget(config.engine_max_restarts, window)
        self.engines: list[EngineRecord] = []

    def start(self) -> None:
        """Start ``rollout.engines`` engines (returns at once; ``Ready`` comes later)."""
        from megatron_rl.platform import get_platform
        from megatron_rl.rollout.engine.vllm_engine import cpu_worker_binding

        config = self.config
        if not get_platform().is_gpu and config.gpu_ids:
            raise ValueError("rollout.gpu_ids need GPUs; this machine has none")
        if not get_platform().is_gpu and config.placement != "remote":
            cpu_worker_binding(config.tensor_parallel)  # a CPU core per engine worker
        self.engines = [EngineRecord(h.index, h) for h in self._launcher.start(self.config.engines)]

    @property
    def restarts(self) -> int:
        """Engine restarts so far (all engines)."""
        return self._restarts.total

    def recent_restarts(self, index: int) -> int:
        return self._restarts.recent(index)

    def is_current(self, engine: EngineRecord) -> bool:
        """Whether ``engine`` is still the record of its index (its process not replaced)."""
        return self.engines[engine.index] is engine

    def wait_ready(self) -> None:
        """Handle events until every engine is up; raises if one failed or died for good."""
        while not all(e.ready for e in self.engines):
            self._take(self._next_event())

    def pump(self, timeout: float) -> None:
        """Handle the queued events, first waiting up to ``timeout`` s for one; then look
        after the engines (a dead or stalled one is restarted, or raises)."""
        block = timeout > 0
        while True:
            try:
                event = self._events.get(timeout=timeout) if block else self._events.get_nowait()
            except queue.Empty:
                self._check_alive()
                return
            self._take(event)
            block = False

    def _next_event(self) -> Event:
        while True:
            try:
                return self._events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._check_alive()

    def _take(self, event: Event) -> None:
        if isinstance(event, Failed):
            raise RuntimeError(f"vLLM engine {event.engine} failed:\n{event.traceback}")
        if isinstance(event, EVENTS):  # any event says that its engine runs
            self.engines[event.engine].last_seen = time.monotonic()
        if isinstance(event, Alive):
            engine = self.engines[event.engine]
            engine.beating, engine.step_seconds = True, event.step_seconds
        elif isinstance(event, Ready):
            engine = self.engines[event.engine]
            engine.max_model_len, engine.ready = event.max_model_len, True
        else:
            self._handler.on_event(event)

    def _check_alive(self) -> None:
        for engine in list(self.engines):
            if not engine.handle.is_alive():
                self._replace(engine)
            elif (stall := self._stalled(engine)) is not None:
                logger.error(
                    "vLLM engine %d (pid %s) %s: killed", engine.index, engine.handle.pid, stall
                )
                engine.handle.discard()  # SIGKILL reaches a stopped process too
                self._replace(engine, why=stall)

    def _stalled(self, engine: EngineRecord) -> str | None:
        """Why ``engine`` counts as stalled (``rollout.engine_stall_timeout``), or None.
        Only engines that beat are judged (processes; from their first beat on)."""
        limit = self.config.engine_stall_timeout
        if not (engine.beating and limit > 0):
            return None
        key = f"rollout.engine_stall_timeout {limit:g} s"
        silent = time.monotonic() - engine.last_seen
        if silent > limit:
            return f"sent nothing for {silent:.0f} s ({key}): stalled"
        if engine.step_seconds > limit:
            return f"has been in one engine step for {engine.step_seconds:.0f} s ({key}): stalled"
        return None

    def _replace(self, engine: EngineRecord, why: str = "exited unexpectedly") -> None:
        """``engine`` died (or stalled, ``why``: killed already): hand on what it sent,
        restart it, or raise when its restarts are spent or its placement cannot restart."""
        config, index = self.config, engine.index
        elastic = self._launcher.restartable
        for event in engine.handle.leftover_events():  # its complete messages, in order
            self._take(event)
        devices = engine_devices(config, index)
        devices = "cpu" if devices is None else f"GPUs {devices}"
        self._handler.on_death(engine, devices)
        if not (elastic and self._restarts.take(index)):
            if elastic:
                raise RuntimeError(
                    refusal_message(
                        index,
                        config.placement,
                        devices,
                        self._restarts,
                        engine.handle.log_path,
                        why,
                    )
                )
            # in-process engines share the trainer's process
            raise RuntimeError(
                f"vLLM engine {index} exited unexpectedly (placement {config.placement}, "
                f"devices {devices}; restarts need placement subprocess or remote)"
            )
        engine.handle.discard()
        new = EngineRecord(index, self._launcher.restart(index), max_model_len=engine.max_model_len)
        self.engines[index] = new
        if why == "exited unexpectedly":
            why += f" (exit code {engine.handle.exitcode})"
        self._handler.on_restart(engine, new, why)

    def close(
        self, stop_seconds: float, before_stop: Callable[[EngineHandle], None] | None = None
    ) -> None:
        """Stop every engine (``before_stop(handle)`` first, if given): ``send(Stop())``,
        then wait up to ``stop_seconds`` for all, reading their last events away; then end
        those still alive, and the launcher (event pipes, logs). Idempotent."""
        engines, self.engines = self.engines, []
        for engine in engines:
            if before_stop is not None:
                before_stop(engine.handle)
            try:
                engine.handle.send(Stop())
            except (ValueError, OSError):  # queue or connection already closed
                pass
        deadline = time.monotonic() + stop_seconds
        for engine in engines:
            while engine.handle.is_alive() and time.monotonic() < deadline:
                engine.handle.join(timeout=POLL_SECONDS / 4)
                self._discard_events()  # an engine process flushes its events as it stops
            if engine.handle.is_alive():
                engine.handle.terminate()

    def close_launcher(self) -> None:
        self._launcher.close()  # event pipes, engine logs

    def _discard_events(self) -> None:
        try:
            while True:
                self._events.get_nowait()
        except (queue.Empty, OSError, ValueError):  # none left, or the queue is closed
            pass
