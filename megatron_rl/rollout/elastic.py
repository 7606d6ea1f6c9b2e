"""What makes an engine process replaceable (``placement: subprocess``; imports no torch).

A dead engine is restarted by the pool (:class:`~megatron_rl.rollout.pool.GeneratorPool`);
this module holds the parts that do not need the pool:

- :class:`EventChannels` / :class:`EventWriter`: one event pipe per engine process. One
  ``multiprocessing.Queue`` shared by all engines (as before) cannot survive a SIGKILL: a
  process killed in the middle of a write leaves a half message in the shared pipe, and the
  queue's cross-process write lock held, so every other engine blocks on its next event.
  With a pipe of its own, what a dead engine sent is read up to its last complete message
  (a sample is either returned whole, once, or resubmitted) and the rest is dropped.
- :func:`tee_output` / :func:`log_tail`: an engine process copies its stdout and stderr to a
  log file, whose last lines go into the error when restarts run out.
- :class:`RestartBudget`: at most ``engine_max_restarts`` restarts of one engine within
  ``engine_restart_window_minutes`` (recipe keys, :class:`~megatron_rl.rollout.config.RolloutConfig`).
- :class:`WeightsNeeded`: raised to the trainer loop when restarted engines wait for the
  current weights, which only the trainer can send (all its ranks stream them together).
"""

from __future__ import annotations

import collections
import os
import pickle
import queue
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.messages import Event

_HEADER = struct.Struct("!Q")  # frame: payload length, then the pickled event (messages.py)
_READ_BYTES = 1 << 20
_CLOSE = object()


class WeightsNeeded(Exception):
    """Restarted engines are ready and wait for the current weights
    (``GeneratorPool.reweigh``); raised where waiting for samples could otherwise last
    until the next regular push (forever, when no engine runs the current weights)."""


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


def tee_output(log_path: str) -> None:
    """Copy everything this process writes to stdout and stderr (file descriptors 1 and 2:
    Python, vLLM and C++ alike) into ``log_path`` too. Threads copy; the log gets whole
    lines (ended by a newline or a carriage return: progress bars), so that the two streams
    never splice inside a line; what a killed process wrote up to its last line end is in
    the file."""
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the process
    lock = threading.Lock()
    for fd in (1, 2):
        read_end, write_end = os.pipe()
        original = os.dup(fd)
        os.dup2(write_end, fd)
        os.close(write_end)

        def copy(read_end: int = read_end, original: int = original) -> None:
            partial = b""
            while data := os.read(read_end, 65536):
                os.write(original, data)
                partial += data
                end = max(partial.rfind(b"\n"), partial.rfind(b"\r")) + 1
                if not end and len(partial) > _READ_BYTES:  # no line end for that long
                    end = len(partial)
                if end:
                    with lock:
                        log.write(partial[:end])
                    partial = partial[end:]
            if partial:
                with lock:
                    log.write(partial)

        threading.Thread(target=copy, name=f"tee-{fd}", daemon=True).start()


def log_tail(log_path: str | None, lines: int = 20) -> str:
    """The last ``lines`` lines of an engine's log ("" when there is none)."""
    if not log_path or not Path(log_path).exists():
        return ""
    with open(log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


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
