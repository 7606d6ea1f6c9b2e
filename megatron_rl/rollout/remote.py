"""Remote engines (``rollout.placement: remote``): the pool's side of the TCP connection.

Under Slurm the generator engines are their own tasks (``python -m
megatron_rl.launch.generator``), on other nodes than the trainer. Each engine task connects
to the trainer's generator pool (``multiprocessing.connection`` over TCP, authenticated with a
key of the job) and runs the pool's ordinary engine loop
(:func:`megatron_rl.rollout.runner.run_engine`) on local queues that
:mod:`megatron_rl.launch.bridge` fills from the connection, and drains into it:

    trainer (pool)                                generator task (engine i)
    RemoteEngine.send(command)       --command-->  commands queue -> EngineRunner
    RemoteEngine.put_weights(bucket) --weights-->  weights queue (bucket as one flat buffer)
    pool events queue                <--event---   events.put(...)   (+ heartbeats)

This module owns the wire (:class:`Link`: the messages of :mod:`megatron_rl.rollout.messages`,
pickled; the connection is authenticated: only tasks of the job that know its key can
connect), the trainer's end (:class:`RemoteEngine`, an
:class:`~megatron_rl.rollout.handles.EngineHandle`; :func:`accept_engines`) and the job's
environment variables. Weight buckets travel as raw bytes, flattened once by the pool and
streamed to every engine task at the same time (``megatron_rl.rollout.fanout``). A connection
that closes, or stays silent for longer than the heartbeat timeout, counts as a dead engine:
the pool then raises, the trainer exits with the message, and Slurm ends the job.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING, Any

from megatron_rl.rollout.messages import (
    BucketBytes,
    BucketHeader,
    Command,
    Event,
    Heartbeat,
    Hello,
    Init,
    Reject,
    RunnerSettings,
    Stop,
    WeightsEnd,
)

if TYPE_CHECKING:
    from megatron_rl.rollout.buckets import FlatBucket
    from megatron_rl.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)

ADDR_ENV = "MEGATRON_RL_GENERATOR_ADDR"  # host:port of the trainer's pool (set by the job)
KEY_ENV = "MEGATRON_RL_GENERATOR_KEY"  # the job's authentication key
TIMEOUT_ENV = "MEGATRON_RL_GENERATOR_TIMEOUT"  # seconds of silence before an engine is dead
CONNECT_TIMEOUT_ENV = "MEGATRON_RL_GENERATOR_CONNECT_TIMEOUT"  # seconds to wait for the other
HEARTBEAT_SECONDS = 5.0
DEFAULT_SILENCE_TIMEOUT = 300.0
DEFAULT_CONNECT_TIMEOUT = 3600.0


def address_from_env() -> tuple[str, int]:
    """(host, port) of the trainer's pool from ``$MEGATRON_RL_GENERATOR_ADDR``."""
    value = os.environ.get(ADDR_ENV, "")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"rollout.placement 'remote' needs ${ADDR_ENV}=host:port (the sbatch script of "
            f"`megatron-rl launch` sets it), got {value!r}"
        )
    return host, int(port)


def authkey_from_env() -> bytes:
    """The job's key from ``$MEGATRON_RL_GENERATOR_KEY``."""
    key = os.environ.get(KEY_ENV, "")
    if len(key) < 16:
        raise ValueError(f"${KEY_ENV} must hold a key of at least 16 characters (set by the job)")
    return key.encode()


def seconds_from_env(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"${name} must be > 0, got {value!r}")
    return seconds


# -- wire format ---------------------------------------------------------------------------------


class Link:
    """One end of a connection: pickled messages and weight buckets, sends serialised."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()

    def send(self, message: object) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def recv(self) -> object:
        return pickle.loads(self.conn.recv_bytes())

    def send_update(self, update: FlatBucket | dict[str, Any]) -> None:
        """Send one bucket (flattened once for every engine by the pool, or an update info of
        the ``megatron_rl_cpu`` transport, with ``tensors`` or a flat ``buffer``): a header,
        then the raw bytes of every tensor."""
        from megatron_rl.rollout.buckets import FlatBucket, flat_update  # imports torch

        flat = update if isinstance(update, FlatBucket) else flat_update(update)
        with self._send_lock:
            self.conn.send_bytes(pickle.dumps(BucketBytes(flat.header), pickle.HIGHEST_PROTOCOL))
            for chunk in flat.chunks:
                self.conn.send_bytes(chunk)

    def recv_update(self, header: dict[str, Any]) -> dict[str, Any]:
        """The bucket announced by ``header``, as a flat-buffer update info."""
        import torch

        buffer = torch.empty(max(header["total"], 1), dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        for offset, nbytes in zip(header["offsets"], header["nbytes"]):
            got = self.conn.recv_bytes_into(view[: offset + nbytes], offset) if nbytes else 0
            if nbytes and got != nbytes:
                raise ConnectionError(f"weight bucket: expected {nbytes} bytes, got {got}")
        return {
            "names": header["names"],
            "buffer": buffer,
            "dtype_names": header["dtype_names"],
            "shapes": header["shapes"],
            "offsets": header["offsets"],
        }

    def close(self) -> None:
        """Shut the socket down (which wakes a thread blocked reading it; a plain close
        would not), then close it. Idempotent."""
        try:
            with socket.fromfd(self.conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
                dup.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed or never connected
            pass
        try:
            self.conn.close()
        except OSError:
            pass


# -- trainer side ------------------------------------------------------------------------------


class RemoteEngine:
    """The pool's handle on one engine task (an :class:`~megatron_rl.rollout.handles.EngineHandle`):
    commands and buckets go over the connection; its events arrive in the pool's events
    queue (a reader thread forwards every message but heartbeats)."""

    log_path = None  # its log is the generator task's (Slurm's output file)

    def __init__(self, index: int, link: Link, events: queue.Queue, peer: dict[str, Any]) -> None:
        self.index = index
        self.peer = peer
        self._link = link
        self._events = events
        self._silence = seconds_from_env(TIMEOUT_ENV, DEFAULT_SILENCE_TIMEOUT)
        self._last_seen = time.monotonic()
        self._closing = False
        self._reader = threading.Thread(
            target=self._read, name=f"generator-link-{index}", daemon=True
        )
        self._reader.start()

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
        self._send(lambda: self._link.send(command))

    def put_weights(
        self, update: FlatBucket | dict[str, Any] | None, timeout: float | None = None
    ) -> None:
        """Send a bucket (None: the push's end). TCP flow control bounds what is in flight;
        ``timeout`` is accepted for the handle interface and not needed."""
        link = self._link
        if update is None:
            self._send(lambda: link.send(WeightsEnd()))
        elif not isinstance(update, dict) or "tensors" in update or "buffer" in update:
            self._send(lambda: link.send_update(update))
        else:  # a bucket's header: its tensors come by NCCL broadcast (rollout.nccl)
            self._send(lambda: link.send(BucketHeader(update)))

    def is_alive(self) -> bool:
        """Connected, and heard from within the heartbeat timeout."""
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
        self._reader.join(timeout)

    def terminate(self) -> None:
        """Close the connection (the engine task exits when it notices)."""
        self._closing = True
        self._link.close()

    def discard(self) -> None:
        self.terminate()

    def _send(self, send: Callable[[], None]) -> None:
        try:
            send()
        except (OSError, EOFError, ValueError) as err:
            raise ConnectionError(
                f"generator engine {self.index} ({self.peer.get('host')}): connection lost "
                f"({type(err).__name__}: {err})"
            ) from err


class RemoteLauncher:
    """``placement: remote``: the engine tasks connect to the pool (see the module
    docstring); their events share one queue. Not restartable yet (issue 13)."""

    restartable = False

    def __init__(self, hf_dir: str, config: RolloutConfig, settings: RunnerSettings) -> None:
        self.hf_dir, self.config, self.settings = hf_dir, config, settings
        self.events: queue.Queue = queue.Queue()

    def start(self, count: int) -> list[RemoteEngine]:
        return accept_engines(count, self.hf_dir, self.config, self.settings, self.events)

    def restart(self, index: int) -> RemoteEngine:
        raise NotImplementedError("remote engines are not restarted yet")

    def close(self) -> None:
        pass


def accept_engines(
    count: int, hf_dir: str, config: Any, settings: Any, events: queue.Queue
) -> list[RemoteEngine]:
    """Listen on ``$MEGATRON_RL_GENERATOR_ADDR``'s port until engine tasks 0..count-1 have
    connected, send each its start-up data (:class:`Init`) and
    return their handles, by index. Raises RuntimeError naming the missing engines when they
    do not all connect within ``$MEGATRON_RL_GENERATOR_CONNECT_TIMEOUT`` seconds."""
    _, port = address_from_env()
    authkey = authkey_from_env()
    timeout = seconds_from_env(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT)
    deadline = time.monotonic() + timeout
    server = socket.create_server(("", port), backlog=count + 8)
    engines: dict[int, RemoteEngine] = {}
    logger.info("waiting for %d generator engine(s) on port %d", count, port)
    try:
        while len(engines) < count:
            try:
                conn = _accept(server, authkey, deadline)
            except TimeoutError:
                missing = sorted(set(range(count)) - set(engines))
                raise RuntimeError(
                    f"generator engine(s) {missing} did not connect within {timeout:.0f} s "
                    f"(${CONNECT_TIMEOUT_ENV}); see the generator log"
                ) from None
            except (AuthenticationError, EOFError, OSError) as err:  # not a task of this job
                logger.warning("generator connection refused: %s: %s", type(err).__name__, err)
                continue
            link = Link(conn)
            try:
                hello = link.recv()
            except (EOFError, OSError, pickle.UnpicklingError) as err:
                logger.warning("generator connection closed before its hello: %s", err)
                link.close()
                continue
            index = hello.engine if isinstance(hello, Hello) else -1
            if not 0 <= index < count or index in engines:
                reason = f"engine index {index} is not one of 0..{count - 1} or is taken"
                link.send(Reject(reason))
                link.close()
                logger.error("generator connection rejected: %s", reason)
                continue
            link.send(Init(hf_dir, config, settings))
            engines[index] = RemoteEngine(index, link, events, hello.peer)
            logger.info("generator engine %d connected from %s", index, hello.peer.get("host"))
    finally:
        server.close()
    return [engines[i] for i in range(count)]


def _accept(server: socket.socket, authkey: bytes, deadline: float) -> Connection:
    """The next authenticated connection (what ``Listener.accept`` does, with a deadline)."""
    server.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock, _ = server.accept()  # TimeoutError at the deadline
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn
