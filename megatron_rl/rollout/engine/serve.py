"""A generator task's end of the connection to the trainer's pool (``placement: remote``).

The engine task (``python -m megatron_rl.launch.generator``) connects to the pool, says
:class:`~megatron_rl.rollout.messages.Hello`, receives its start-up data and runs the
pool's ordinary engine loop (:func:`megatron_rl.rollout.engine.runner.run_engine`) on local
queues that this module fills from the connection and drains into it. The wire and the job's
environment variables are in :mod:`megatron_rl.rollout.wire`, the pool's end in
:mod:`megatron_rl.rollout.pool.remote`.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

from megatron_rl.rollout.messages import (
    BucketBytes,
    BucketHeader,
    Command,
    Event,
    Failed,
    Heartbeat,
    Hello,
    Init,
    Pushed,
    Ready,
    Reject,
    Stop,
    WeightsEnd,
    unknown_message,
)
from megatron_rl.rollout.wire import (
    ADDR_ENV,
    CONNECT_TIMEOUT_ENV,
    DEFAULT_CONNECT_TIMEOUT,
    HEARTBEAT_SECONDS,
    KEY_ENV,
    Link,
    address_from_env,
    authkey_from_env,
    seconds_from_env,
)

__all__ = [
    "ADDR_ENV",
    "CONNECT_TIMEOUT_ENV",
    "DEFAULT_CONNECT_TIMEOUT",
    "KEY_ENV",
    "address_from_env",
    "authkey_from_env",
    "connect",
    "seconds_from_env",
    "serve_engine",
]

logger = logging.getLogger(__name__)


def connect(address: tuple[str, int], authkey: bytes, timeout: float) -> Link:
    """Connect to the trainer's pool, retrying while it is not listening yet (it starts
    listening once its model is built and warm-started)."""
    deadline = time.monotonic() + timeout
    next_note = time.monotonic()
    while True:
        try:
            return Link(Client(address, family="AF_INET", authkey=authkey))
        except AuthenticationError:
            raise ConnectionError(
                f"the trainer at {address[0]}:{address[1]} refused this task's key "
                f"(${KEY_ENV} must be the job's)"
            ) from None
        except OSError as err:  # not listening yet, name not resolvable yet, ...
            now = time.monotonic()
            if now > deadline:
                raise ConnectionError(
                    f"the trainer at {address[0]}:{address[1]} did not accept a connection "
                    f"within {timeout:.0f} s ({type(err).__name__}: {err})"
                ) from None
            if now >= next_note:
                logger.info("waiting for the trainer at %s:%d", *address)
                next_note = now + 60
            time.sleep(1.0)


class _EventSender:
    """The runner's ``events`` queue: every event goes to the trainer."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self.failed = False

    def put(self, event: Event) -> None:
        if isinstance(event, Failed):
            self.failed = True
            logger.error("engine %d failed:\n%s", event.engine, event.traceback)
        elif isinstance(event, Pushed):
            logger.info(
                "engine %d: loaded policy version %d (%d tensors, %d bytes) in %.2f s",
                event.engine,
                event.version,
                event.tensors,
                event.nbytes,
                event.seconds,
            )
        elif isinstance(event, Ready):
            logger.info("engine %d ready: max_model_len %d", event.engine, event.max_model_len)
        try:
            self._link.send(event)
        except OSError:  # the trainer went away: the pump thread stops the runner
            logger.debug("engine event %s dropped (no trainer)", type(event).__name__)


def serve_engine(
    link: Link,
    index: int,
    runner: Callable[..., None] | None = None,
) -> int:
    """Engine ``index`` behind ``link``: say hello, receive the start-up data, run the engine
    loop until the trainer's ``stop``. Returns an exit status: 0 after ``stop``, 1 when the
    engine failed (the trainer got the traceback), 3 when the trainer went away, 4 when it
    rejected this task."""
    if runner is None:
        import functools

        from megatron_rl.rollout.engine.runner import run_engine
        from megatron_rl.rollout.pool.launchers import engine_logs_dir

        # vLLM's rendezvous file (/tmp/vllm_dist_<uuid>) goes into a directory this task
        # owns while it lives: removed at exit, or, when the task is SIGKILLed, by the next
        # engine launcher on this node (issue 49; the local engine processes' launcher does
        # the same).
        store, owner = engine_logs_dir()
        try:
            runner = functools.partial(run_engine, store_dir=store)
            return serve_engine(link, index, runner)
        finally:
            os.close(owner)
            shutil.rmtree(store, ignore_errors=True)
    link.send(Hello(index, {"host": socket.gethostname(), "pid": os.getpid()}))
    init = link.recv()
    if isinstance(init, Reject):
        logger.error("the trainer rejected engine %d: %s", index, init.reason)
        return 4
    if not isinstance(init, Init):
        raise unknown_message(init, f"engine {index} waiting for its Init")
    commands: queue.Queue = queue.Queue()
    weights: queue.Queue = queue.Queue(maxsize=2)
    events = _EventSender(link)
    lost, stop_sent = threading.Event(), threading.Event()
    threading.Thread(
        target=_pump_from_trainer, args=(link, commands, weights, lost, stop_sent), daemon=True
    ).start()
    threading.Thread(target=_heartbeat, args=(link, lost), daemon=True).start()
    runner(index, init.hf_dir, init.config, init.settings, commands, weights.get, events)
    if not stop_sent.is_set() and not events.failed:
        logger.error("engine %d: the connection to the trainer was lost", index)
        return 3
    return 1 if events.failed else 0


def _pump_from_trainer(
    link: Link, commands, weights, lost: threading.Event, stop_sent: threading.Event
) -> None:
    """Move commands and weight buckets from the connection into the runner's queues; when
    the trainer goes away, stop the runner (a push in progress ends first)."""
    try:
        while True:
            message = link.recv()
            if isinstance(message, BucketBytes):
                weights.put(link.recv_update(message.header))
            elif isinstance(message, BucketHeader):
                weights.put(message.info)
            elif isinstance(message, WeightsEnd):
                weights.put(None)
            elif isinstance(message, Command):
                if isinstance(message, Stop):
                    stop_sent.set()
                commands.put(message)
            else:
                raise unknown_message(message, "a generator task's connection")
    except (EOFError, OSError):
        pass  # the trainer closed the connection or went away
    except Exception:  # a malformed message: as fatal as a lost connection
        logger.exception("bad message from the trainer")
        link.close()
    lost.set()
    weights.put(None)  # ends a push in progress (a full queue means the runner is reading it)
    commands.put(Stop())


def _heartbeat(link: Link, lost: threading.Event) -> None:
    while not lost.wait(HEARTBEAT_SECONDS):
        try:
            link.send(Heartbeat())
        except OSError:
            return
