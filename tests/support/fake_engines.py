"""Fake engines for the real GeneratorPool: engine i's "process" is the test, which reads the
commands it is sent and writes its events into a real pipe (shared by the rollout unit tests and
the stall tests)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import struct

from megatron_rl.rollout.messages import Event, Ready, Stop, Submit
from megatron_rl.rollout.wire import EventChannels, EventWriter


def channel(channels: EventChannels, index: int) -> EventWriter:
    reader, writer = multiprocessing.Pipe(duplex=False)
    channels.add(index, reader)
    return EventWriter(writer)


def die_writing(writer: EventWriter, event: Event | None) -> None:
    """The engine process is killed: what it put so far is written, then ``event`` (if any)
    only half, then its end of the pipe closes."""
    writer.flush()
    if event is not None:
        data = pickle.dumps(event)
        frame = struct.pack("!Q", len(data)) + data
        os.write(writer._conn.fileno(), frame[: len(frame) // 2])
    writer._conn.close()


class FakeHandle:
    """Engine i's "process" is this test, which reads its commands and writes its events
    into a real pipe; alive until killed, or until told to stop."""

    def __init__(self, index: int, channels: EventChannels, log_path: str | None = None):
        self.index, self.log_path, self.channels = index, log_path, channels
        self.commands, self.weights = queue.Queue(), queue.Queue(2)
        self.alive, self.exitcode, self.pid = True, None, -1

    def send(self, command):
        self.commands.put(command)

    def put_weights(self, item, timeout=None):
        self.weights.put(item, timeout=timeout)

    def is_alive(self):
        if any(isinstance(c, Stop) for c in list(self.commands.queue)):
            self.alive = False
        return self.alive

    def leftover_events(self):
        return self.channels.drain(self.index)

    def join(self, timeout=None):
        pass

    def terminate(self):
        self.alive = False

    def discard(self):
        pass


class FakeEngines:
    """Stands in for the subprocess launcher: engine i is a :class:`FakeHandle`."""

    restartable = True

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.events = EventChannels()
        self.writers: dict[int, EventWriter] = {}
        self.spawned: list[int] = []

    def start(self, count):
        return [self.restart(i) for i in range(count)]

    def restart(self, index):
        self.spawned.append(index)
        self.writers[index] = channel(self.events, index)
        log = self.tmp_path / f"engine-{index}.log"
        log.write_text(f"engine {index} incarnation {self.spawned.count(index)}\nboom\n")
        handle = FakeHandle(index, self.events, str(log))
        self._started(handle, self.writers[index])
        return handle

    def _started(self, handle, writer):
        """The new process is up: it says so."""
        writer.put(Ready(handle.index, 64))

    def close(self):
        self.events.close()

    def kill(self, pool, index, half: Event | None = None):
        """The process dies; ``half``: an event it was writing at that moment."""
        die_writing(self.writers.pop(index), half)
        pool.engine_handles()[index].alive = False


def submitted(handle) -> list:
    """The requests handed to an engine (its handle) since the last look."""
    specs = []
    while True:
        try:
            command = handle.commands.get_nowait()
        except queue.Empty:
            return specs
        if isinstance(command, Submit):
            specs.extend(command.specs)


class FakeM2NLayouts:
    """The layout constructors of a stand-in for the ``nccl.m2n`` runtime (not installed):
    meshes and placements as plain tuples that tests compare. A test's runtime subclasses
    it and adds its own ``reshard`` (and ``Handle``)."""

    Mesh = staticmethod(lambda dims, start_rank: ("mesh", tuple(dims), start_rank))
    Replicate = staticmethod(lambda: "R")
    Shard = staticmethod(lambda dim: ("S", dim))
