"""The generator pool's queues, bridged over TCP (``rollout.placement: remote``).

Under Slurm the generator engines are their own tasks (``python -m
megatron_rl.launch.generator``), on other nodes than the trainer. Each engine task connects
to the trainer's generator pool (``multiprocessing.connection`` over TCP, authenticated with a
key of the job) and runs the pool's ordinary engine loop
(:func:`megatron_rl.rollout.runner.run_engine`) on local queues that this module fills from
the connection, and drains into it:

    trainer (pool)                                generator task (engine i)
    RemoteEngine.commands.put(cmd)   --command-->  commands queue -> EngineRunner
    RemoteEngine.weights.put(bucket) --weights-->  weights queue (bucket as one flat buffer)
    pool events queue                <--event---   events.put(...)   (+ heartbeats)

Messages are pickled tuples (the connection is authenticated: only tasks of the job that know
its key can connect); weight buckets travel as raw bytes, flattened once by the pool and
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
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl.rollout.buckets import FlatBucket

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

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple:
        return pickle.loads(self.conn.recv_bytes())

    def send_update(self, update: FlatBucket | dict[str, Any]) -> None:
        """Send one bucket (flattened once for every engine by the pool, or an update info of
        the ``megatron_rl_cpu`` transport, with ``tensors`` or a flat ``buffer``): a header,
        then the raw bytes of every tensor."""
        from megatron_rl.rollout.buckets import FlatBucket, flat_update  # imports torch

        flat = update if isinstance(update, FlatBucket) else flat_update(update)
        with self._send_lock:
            self.conn.send_bytes(pickle.dumps(("weights", flat.header), pickle.HIGHEST_PROTOCOL))
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
    """The pool's handle on one engine task: ``commands`` / ``weights`` queues (``put``) and
    the ``worker`` liveness interface (``is_alive`` / ``join`` / ``terminate``); its events
    arrive in the pool's events queue."""

    def __init__(self, index: int, link: Link, events: queue.Queue, peer: dict[str, Any]) -> None:
        self.index = index
        self.peer = peer
        self._link = link
        self._events = events
        self._silence = seconds_from_env(TIMEOUT_ENV, DEFAULT_SILENCE_TIMEOUT)
        self._last_seen = time.monotonic()
        self._closing = False
        self.commands = _CommandSender(self)
        self.weights = _BucketSender(self)
        self._reader = threading.Thread(
            target=self._read, name=f"generator-link-{index}", daemon=True
        )
        self._reader.start()

    @property
    def worker(self) -> RemoteEngine:
        return self

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
            if message[0] == "event":
                self._events.put(message[1])

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

    def join(self, timeout: float | None = None) -> None:
        """Wait until the engine task closes the connection (after a ``stop`` command)."""
        self._reader.join(timeout)

    def terminate(self) -> None:
        """Close the connection (the engine task exits when it notices)."""
        self._closing = True
        self._link.close()

    def _send(self, send: Callable[[], None]) -> None:
        try:
            send()
        except (OSError, EOFError, ValueError) as err:
            raise ConnectionError(
                f"generator engine {self.index} ({self.peer.get('host')}): connection lost "
                f"({type(err).__name__}: {err})"
            ) from err


class _CommandSender:
    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def put(self, command: tuple) -> None:
        if command[0] == "stop":
            self._engine._closing = True
        self._engine._send(lambda: self._engine._link.send(("command", command)))


class _BucketSender:
    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def put(self, update: FlatBucket | dict[str, Any] | None, timeout: float | None = None) -> None:
        """Send a bucket (None: the push's end). TCP flow control bounds what is in flight;
        ``timeout`` is accepted for the queue interface and not needed."""
        link = self._engine._link
        if update is None:
            self._engine._send(lambda: link.send(("weights_end",)))
        elif not isinstance(update, dict) or "tensors" in update or "buffer" in update:
            self._engine._send(lambda: link.send_update(update))
        else:  # a bucket's header: its tensors come by NCCL broadcast (rollout.nccl)
            self._engine._send(lambda: link.send(("weights_header", update)))


def accept_engines(
    count: int, hf_dir: str, config: Any, settings: Any, events: queue.Queue
) -> list[RemoteEngine]:
    """Listen on ``$MEGATRON_RL_GENERATOR_ADDR``'s port until engine tasks 0..count-1 have
    connected, send each its start-up data (``hf_dir``, RolloutConfig, RunnerSettings) and
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
            index = hello[1] if hello[0] == "hello" else -1
            if not 0 <= index < count or index in engines:
                reason = f"engine index {index} is not one of 0..{count - 1} or is taken"
                link.send(("reject", reason))
                link.close()
                logger.error("generator connection rejected: %s", reason)
                continue
            link.send(("init", hf_dir, config, settings))
            engines[index] = RemoteEngine(index, link, events, hello[2])
            logger.info("generator engine %d connected from %s", index, hello[2].get("host"))
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


# -- generator side ------------------------------------------------------------------------------


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

    def put(self, event: tuple) -> None:
        if event[0] == "error":
            self.failed = True
            logger.error("engine %d failed:\n%s", event[1], event[2])
        elif event[0] == "pushed":
            logger.info(
                "engine %d: loaded policy version %d (%d tensors, %d bytes) in %.2f s",
                event[1],
                event[2],
                event[4],
                event[5],
                event[3],
            )
        elif event[0] == "ready":
            logger.info("engine %d ready: %s", event[1], event[2])
        try:
            self._link.send(("event", event))
        except OSError:  # the trainer went away: the pump thread stops the runner
            logger.debug("engine %d: event %s dropped (no trainer)", event[1], event[0])


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
        from megatron_rl.rollout.runner import run_engine as runner
    link.send(("hello", index, {"host": socket.gethostname(), "pid": os.getpid()}))
    init = link.recv()
    if init[0] == "reject":
        logger.error("the trainer rejected engine %d: %s", index, init[1])
        return 4
    _, hf_dir, config, settings = init
    commands: queue.Queue = queue.Queue()
    weights: queue.Queue = queue.Queue(maxsize=2)
    events = _EventSender(link)
    lost, stop_sent = threading.Event(), threading.Event()
    threading.Thread(
        target=_pump_from_trainer, args=(link, commands, weights, lost, stop_sent), daemon=True
    ).start()
    threading.Thread(target=_heartbeat, args=(link, lost), daemon=True).start()
    runner(index, hf_dir, config, settings, commands, weights.get, events)
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
            if message[0] == "command":
                if message[1][0] == "stop":
                    stop_sent.set()
                commands.put(message[1])
            elif message[0] == "weights":
                weights.put(link.recv_update(message[1]))
            elif message[0] == "weights_header":
                weights.put(message[1])
            elif message[0] == "weights_end":
                weights.put(None)
    except (EOFError, OSError):
        pass  # the trainer closed the connection or went away
    except Exception:  # a malformed message: as fatal as a lost connection
        logger.exception("bad message from the trainer")
        link.close()
    lost.set()
    weights.put(None)  # ends a push in progress (a full queue means the runner is reading it)
    commands.put(("stop",))


def _heartbeat(link: Link, lost: threading.Event) -> None:
    while not lost.wait(HEARTBEAT_SECONDS):
        try:
            link.send(("heartbeat",))
        except OSError:
            return
