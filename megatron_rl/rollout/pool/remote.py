"""Remote engines (``rollout.placement: remote``): the pool's side of the TCP connection.

Under Slurm the generator engines are their own tasks (``python -m
megatron_rl.launch.generator``), on other nodes than the trainer. Each engine task connects
to the trainer's generator pool (``multiprocessing.connection`` over TCP, authenticated with a
key of the job) and runs the pool's ordinary engine loop
(:func:`megatron_rl.rollout.engine.runner.run_engine`) on local queues that
:mod:`megatron_rl.rollout.engine.serve` fills from the connection, and drains into it:

    trainer (pool)                                generator task (engine i)
    RemoteEngine.send(command)       --command-->  commands queue -> EngineRunner
    RemoteEngine.put_weights(bucket) --weights-->  weights queue (bucket as one flat buffer)
    pool events queue                <--event---   events.put(...)   (+ heartbeats)

This module is the trainer's end (:class:`RemoteEngine`, an
:class:`~megatron_rl.rollout.pool.launchers.EngineHandle`; :func:`accept_engines`); its
listening socket, which authenticates the engine tasks and sends each its ``Init``, is
:class:`~megatron_rl.rollout.pool.listener.Listener`; the wire
(:class:`~megatron_rl.rollout.wire.Link`: the messages of :mod:`megatron_rl.rollout.messages`,
pickled; the connection is authenticated: only tasks of the job that know its key can connect)
and the job's environment variables are in :mod:`megatron_rl.rollout.wire`. Weight buckets
travel as raw bytes, flattened once by the pool and streamed to every engine task at the same
time (:mod:`megatron_rl.rollout.pool.fanout`). A connection that closes, or stays silent for longer than the heartbeat timeout, counts as a dead engine.
The pool restarts it as it restarts an engine process (:class:`RemoteLauncher`): the engine
task, which supervises its engine process, starts a new one that reconnects; a task that does
not reconnect in time (it is gone) fails the run, the trainer exits with the message, and
Slurm ends the job.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_rl.rollout.messages import (
    BucketHeader,
    Command,
    Event,
    Failed,
    Heartbeat,
    Init,
    RunnerSettings,
    Stop,
    WeightsEnd,
)
from megatron_rl.rollout.pool.listener import Listener
from megatron_rl.rollout.wire import (
    DEFAULT_RECONNECT_TIMEOUT,
    DEFAULT_SILENCE_TIMEOUT,
    RECONNECT_TIMEOUT_ENV,
    TIMEOUT_ENV,
    Link,
    seconds_from_env,
)

if TYPE_CHECKING:
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.weights.buckets import FlatBucket

logger = logging.getLogger(__name__)

# -- trainer side ------------------------------------------------------------------------------


class RemoteEngine:
    """The pool's handle on one engine task (an :class:`~megatron_rl.rollout.pool.launchers.EngineHandle`):
    commands and buckets go over the connection; its events arrive in the pool's events
    queue (a reader thread forwards every message but heartbeats).

    A handle made by :meth:`RemoteLauncher.restart` starts without a connection: it keeps
    the commands it gets until the engine task reconnects (:meth:`attach`), and reports the
    engine failed when none does within ``$MEGATRON_RL_GENERATOR_RECONNECT_TIMEOUT`` s.
    Like the other handles, it never raises on a lost connection: the pool learns of a
    dead engine from :meth:`is_alive`."""

    log_path = None  # its log is the generator task's (Slurm's output file)

    def __init__(
        self,
        index: int,
        events: queue.Queue,
        link: Link | None = None,
        peer: dict[str, Any] | None = None,
    ) -> None:
        self.index = index
        self.peer: dict[str, Any] = peer or {}
        self._events = events
        self._silence = seconds_from_env(TIMEOUT_ENV, DEFAULT_SILENCE_TIMEOUT)
        self._reconnect = seconds_from_env(RECONNECT_TIMEOUT_ENV, DEFAULT_RECONNECT_TIMEOUT)
        self._since = time.monotonic()  # connected, or waiting for a reconnect, since
        self._last_seen = self._since
        self._closing = False  # stopped or terminated by the pool
        self._lost = False  # a send failed: the connection is gone
        self._gave_up = False  # no reconnect in time: reported as a failure
        self._lock = threading.Lock()
        self._held: list[Command] = []  # commands before the task reconnected
        self._link: Link | None = None
        self._reader: threading.Thread | None = None
        if link is not None:
            self.attach(link, self.peer)

    def attach(self, link: Link, peer: dict[str, Any]) -> None:
        """The engine task (re)connected on ``link``: read its events, send what was held."""
        with self._lock:
            self._link, self.peer = link, peer
            self._last_seen = time.monotonic()
            self._reader = threading.Thread(
                target=self._read, name=f"generator-link-{self.index}", daemon=True
            )
            self._reader.start()
            held, self._held = self._held, []
            for command in held:
                self._send(lambda c=command: link.send(c))

    def _read(self) -> None:
        while True:
            try:
                message = self._link.recv()
            except (EOFError, OSError) as err:
                if not self._closing:
                    logger.error(
                        "generator engine %d (%s pid %s): connection lost (%s)",
                        self.index,
                        self.peer.get("host"),
                        self.peer.get("pid"),
                        type(err).__name__,
                    )
                return
            self._last_seen = time.monotonic()
            if not isinstance(message, Heartbeat):  # an event (the pool rejects unknown ones)
                self._events.put(message)

    def send(self, command: Command) -> None:
        if isinstance(command, Stop):
            self._closing = True
        with self._lock:
            if self._link is None:
                self._held.append(command)
                return
        self._send(lambda: self._link.send(command))

    def put_weights(
        self, update: FlatBucket | dict[str, Any] | None, timeout: float | None = None
    ) -> None:
        """Send a bucket (None: the push's end). TCP flow control bounds what is in flight;
        ``timeout`` is accepted for the handle interface and not needed."""
        link = self._link
        if link is None:  # not reconnected: the pool pushes only to engines that are ready
            return
        if update is None:
            self._send(lambda: link.send(WeightsEnd()))
        elif not isinstance(update, dict) or "tensors" in update or "buffer" in update:
            self._send(lambda: link.send_update(update))
        else:  # a bucket's header: its tensors come by NCCL broadcast (rollout.nccl)
            self._send(lambda: link.send(BucketHeader(update)))

    def is_alive(self) -> bool:
        """Connected and heard from within the heartbeat timeout, or waiting for the task to
        reconnect (when it does not in time, a ``Failed`` event says so)."""
        if self._closing or self._lost:
            return False
        if self._reader is None:
            if time.monotonic() - self._since > self._reconnect and not self._gave_up:
                self._gave_up = True
                self._events.put(Failed(self.index, self._no_reconnect()))
            return True
        silent = time.monotonic() - self._last_seen
        if self._reader.is_alive() and silent > self._silence:
            logger.error(
                "generator engine %d: silent for %.0f s (%s=%.0f): counted as dead",
                self.index,
                silent,
                TIMEOUT_ENV,
                self._silence,
            )
            self.terminate()
        return self._reader.is_alive() and not self._closing

    def _no_reconnect(self) -> str:
        return (
            f"generator engine {self.index} lost its connection and its task did not "
            f"reconnect within {self._reconnect:.0f} s (${RECONNECT_TIMEOUT_ENV}): the generator "
            "task is gone; see the generator log"
        )

    @property
    def pid(self) -> int | None:
        return self.peer.get("pid")

    @property
    def exitcode(self) -> None:
        return None  # on another node: Slurm knows it

    def leftover_events(self) -> list[Event]:
        return []  # its events went to the pool's queue, in order

    def join(self, timeout: float | None = None) -> None:
        """Wait until the engine task closes the connection (after a ``Stop`` command)."""
        if self._reader is not None:
            self._reader.join(timeout)

    def terminate(self) -> None:
        """Close the connection (the engine task exits when it notices)."""
        self._closing = True
        if self._link is not None:
            self._link.close()

    def discard(self) -> None:
        self.terminate()

    def _send(self, send: Callable[[], None]) -> None:
        try:
            send()
        except (OSError, EOFError, ValueError) as err:  # the pool notices by is_alive
            if not self._lost:
                logger.error(
                    "generator engine %d (%s): connection lost while sending (%s: %s)",
                    self.index,
                    self.peer.get("host"),
                    type(err).__name__,
                    err,
                )
            self._lost = True
            if self._link is not None:
                self._link.close()


def accept_engines(
    count: int, hf_dir: str, config: Any, settings: Any, events: queue.Queue
) -> list[RemoteEngine]:
    """Listen on ``$MEGATRON_RL_GENERATOR_ADDR``'s port until engine tasks 0..count-1 have
    connected, send each its start-up data (:class:`Init`) and return their handles, by
    index. Raises RuntimeError naming the missing engines when they do not all connect
    within ``$MEGATRON_RL_GENERATOR_CONNECT_TIMEOUT`` seconds."""
    listener = Listener(count)
    try:
        return listener.accept_all(Init(hf_dir, config, settings), _handles(events))
    finally:
        listener.close()


class RemoteLauncher:
    """``placement: remote``: the engine tasks connect to the pool (see the module
    docstring); their events share one queue. After the start it goes on listening: an
    engine task whose engine process died restarts it and reconnects
    (:mod:`megatron_rl.launch.generator`), and :meth:`restart` hands the pool a handle
    that takes that connection (made before or after the pool noticed the death)."""

    restartable = True

    def __init__(self, hf_dir: str, config: RolloutConfig, settings: RunnerSettings) -> None:
        self.hf_dir, self.config, self.settings = hf_dir, config, settings
        self.events: queue.Queue = queue.Queue()
        self._listener: Listener | None = None
        self._lock = threading.Lock()
        self._waiting: dict[int, RemoteEngine] = {}  # restarted, waiting for their task
        self._arrived: dict[int, tuple[Link, dict[str, Any]]] = {}  # before the pool asked
        self._closed = threading.Event()

    def start(self, count: int) -> list[RemoteEngine]:
        self._listener = Listener(count)
        try:
            init = Init(self.hf_dir, self.config, self.settings)
            engines = self._listener.accept_all(init, _handles(self.events))
        except BaseException:
            self._listener.close()
            raise
        threading.Thread(target=self._reconnects, name="generator-listener", daemon=True).start()
        return engines

    def restart(self, index: int) -> RemoteEngine:
        """A handle for engine ``index``'s next connection (its task restarts the engine)."""
        handle = RemoteEngine(index, self.events)
        with self._lock:
            arrived = self._arrived.pop(index, None)
            if arrived is None:
                self._waiting[index] = handle
        if arrived is not None:
            handle.attach(*arrived)
        logger.warning("generator engine %d: waiting for its task to reconnect", index)
        return handle

    def _reconnects(self) -> None:
        while not self._closed.is_set():
            try:
                got = self._listener.hello(time.monotonic() + 1.0)
            except TimeoutError:
                continue
            except OSError:  # the listener was closed
                return
            if got is None:
                continue
            index, link, peer = got
            try:
                link.send(Init(self.hf_dir, self.config, self.settings))
            except OSError:
                link.close()
                continue
            logger.warning("generator engine %d reconnected from %s", index, peer.get("host"))
            with self._lock:
                handle = self._waiting.pop(index, None)
                if handle is None:
                    old = self._arrived.pop(index, None)
                    if old is not None:
                        old[0].close()
                    self._arrived[index] = (link, peer)
            if handle is not None:
                handle.attach(link, peer)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for link, _ in self._arrived.values():
                link.close()
            self._arrived.clear()


def _handles(events: queue.Queue) -> Callable[[int, Link, dict[str, Any]], RemoteEngine]:
    """A connected engine task's handle, its events into ``events``."""
    return lambda index, link, peer: RemoteEngine(index, events, link, peer)
