"""The pool's two links to its engines, as bytes: event pipes and the remote connection.

- :class:`EventChannels` / :class:`EventWriter` (``placement: subprocess``): one event pipe per
  engine process. One ``multiprocessing.Queue`` shared by all engines cannot survive a
  SIGKILL: a process killed in the middle of a write leaves a half message in the shared
  pipe, and the queue's cross-process write lock held, so every other engine blocks on its
  next event. With a pipe of its own, what a dead engine sent is read up to its last complete
  message (a sample is either returned whole, once, or resubmitted) and the rest is dropped.
- :class:`Link` (``placement: remote``): one end of the TCP connection between the trainer's
  pool (:mod:`megatron_rl.rollout.pool.remote`) and a generator task
  (:mod:`megatron_rl.rollout.engine.serve`): the messages of
  :mod:`megatron_rl.rollout.messages`, pickled, and weight buckets as raw bytes; plus the
  job's environment variables that both ends read.

Imports no torch (a bucket's bytes are converted on first use).
"""

from __future__ import annotations

import collections
import os
import pickle
import queue
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from megatron_rl.rollout.messages import BucketBytes

if TYPE_CHECKING:
    from megatron_rl.rollout.messages import Event
    from megatron_rl.rollout.weights.buckets import FlatBucket

_HEADER = struct.Struct("!Q")  # frame: payload length, then the pickled event (messages.py)
_READ_BYTES = 1 << 20
_CLOSE = object()

ADDR_ENV = "MEGATRON_RL_GENERATOR_ADDR"  # host:port of the trainer's pool (set by the job)
KEY_ENV = "MEGATRON_RL_GENERATOR_KEY"  # the job's authentication key
TIMEOUT_ENV = "MEGATRON_RL_GENERATOR_TIMEOUT"  # seconds of silence before an engine is dead
CONNECT_TIMEOUT_ENV = "MEGATRON_RL_GENERATOR_CONNECT_TIMEOUT"  # seconds to wait for the other
# seconds a lost engine's task has to restart its engine process and reconnect
RECONNECT_TIMEOUT_ENV = "MEGATRON_RL_GENERATOR_RECONNECT_TIMEOUT"
HEARTBEAT_SECONDS = 5.0
DEFAULT_SILENCE_TIMEOUT = 300.0
DEFAULT_CONNECT_TIMEOUT = 3600.0
DEFAULT_RECONNECT_TIMEOUT = 60.0


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
        from megatron_rl.rollout.weights.buckets import FlatBucket, flat_update  # imports torch

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


# -- event pipes ---------------------------------------------------------------------------


class EventWriter:
    """The engine end of its event pipe: ``put`` never blocks the engine (a thread writes,
    as ``multiprocessing.Queue`` does); ``close`` flushes."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._items: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine-events", daemon=True)
        self._thread.start()

    def put(self, event: Event) -> None:
        self._items.put(event)

    def flush(self) -> None:
        """Wait until every event put so far is written."""
        self._items.join()

    def close(self) -> None:
        self._items.put(_CLOSE)
        self._thread.join()
        self._conn.close()

    def _run(self) -> None:
        fd = self._conn.fileno()
        while (event := self._items.get()) is not _CLOSE:
            data = pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
            view = memoryview(_HEADER.pack(len(data)) + data)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:  # the pool is gone (BrokenPipeError): nobody to tell
                return
            finally:
                self._items.task_done()


class EventChannels:
    """The pool end: the event pipes of all engines, read as one queue (``get``,
    ``get_nowait``, raising ``queue.Empty``), in each engine's order."""

    def __init__(self) -> None:
        self._conns: dict[int, Connection] = {}
        self._buffers: dict[int, bytearray] = {}
        self._ready: collections.deque[tuple[int, Event]] = collections.deque()

    def add(self, index: int, conn: Connection) -> None:
        """Read engine ``index``'s events from ``conn`` (replaces a previous channel)."""
        os.set_blocking(conn.fileno(), False)
        self._conns[index] = conn
        self._buffers[index] = bytearray()

    def get(self, timeout: float | None = None) -> Event:
        if not self._ready:
            open_conns = [c for c in self._conns.values() if not c.closed]
            for conn in wait(open_conns, timeout) if open_conns else []:
                index = next(i for i, c in self._conns.items() if c is conn)
                self._read(index)
        if not self._ready:
            if timeout and not open_conns:  # nothing to wait on: wait as asked all the same
                time.sleep(timeout)
            raise queue.Empty
        return self._ready.popleft()[1]

    def get_nowait(self) -> Event:
        return self.get(0)

    def drain(self, index: int) -> list[Event]:
        """The complete events engine ``index`` sent and nobody read yet, after its end (a
        dead process): whatever it had half written is dropped; the channel is closed."""
        if index in self._conns:
            self._read(index)
        mine = [event for i, event in self._ready if i == index]
        self._ready = collections.deque((i, e) for i, e in self._ready if i != index)
        conn = self._conns.pop(index, None)
        self._buffers.pop(index, None)
        if conn is not None:
            conn.close()
        return mine

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def _read(self, index: int) -> None:
        """Move what engine ``index``'s pipe holds now into its buffer, and its complete
        frames into the ready events; at end of file the pipe is closed (its buffer stays)."""
        conn, buffer = self._conns[index], self._buffers[index]
        while not conn.closed:
            try:
                data = os.read(conn.fileno(), _READ_BYTES)
            except BlockingIOError:
                break
            if not data:  # every writer is gone
                conn.close()
                break
            buffer += data
        while len(buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer)
            if len(buffer) < _HEADER.size + size:
                break
            payload = bytes(buffer[_HEADER.size : _HEADER.size + size])
            del buffer[: _HEADER.size + size]
            self._ready.append((index, pickle.loads(payload)))
