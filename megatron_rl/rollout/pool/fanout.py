"""The fan-out of a weight push: each packed bucket goes to every engine at the same time.

The pool packs a bucket once (:class:`~megatron_rl.rollout.weights.buckets.WeightSender`) and hands
that one object to a lane per engine: a thread that moves the lane's items, in order, into
the engine's weights queue (``EngineHandle.put_weights``: a bounded queue for in-process and
subprocess engines; for a remote engine a TCP connection, which returns once the bytes are
sent). Engines thus
receive in parallel, and a slow engine holds up the push only once its lane is full. Memory:
a lane holds at most one item besides the one it is delivering (the engine's queue has its
own bound), and all lanes share each bucket.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

_POLL_SECONDS = 1.0
_DONE = object()  # a lane's last item


class Fanout:
    """Lanes to the weights queues of ``engines`` (objects with ``index`` and
    ``put_weights(item, timeout=...)``, which raises ``queue.Full`` on timeout or blocks until
    sent: :class:`~megatron_rl.rollout.pool.launchers.EngineHandle`).

    ``wait(index)`` runs on the caller's thread whenever it waits for engine ``index``'s lane;
    it is where the caller notices a failed engine or a deadline (by raising). Use as a
    context manager: leaving it stops the lanes (a failed push leaves no thread behind)."""

    def __init__(self, engines: Sequence[Any], wait: Callable[[int], None]) -> None:
        self._wait = wait
        self._stopped = threading.Event()
        self._lanes = [_Lane(e.index, e.put_weights, self._stopped) for e in engines]

    def put(self, item: Any) -> None:
        """Hand ``item`` to every engine's lane, in order after the previous items."""
        for lane in self._lanes:
            while not lane.dropped.is_set():
                lane.raise_error()
                try:
                    lane.items.put(item, timeout=_POLL_SECONDS)
                    break
                except queue.Full:
                    self._wait(lane.index)

    def finish(self) -> None:
        """Wait until every lane has delivered all its items; raises a lane's error."""
        self.put(_DONE)
        for lane in self._lanes:
            while lane.thread.is_alive():
                lane.thread.join(_POLL_SECONDS)
                if lane.thread.is_alive():
                    self._wait(lane.index)
            if not lane.dropped.is_set():
                lane.raise_error()

    def drop(self, index: int) -> None:
        """Stop engine ``index``'s lane (the engine died): the push goes on without it."""
        for lane in self._lanes:
            if lane.index == index:
                lane.dropped.set()

    def stop(self) -> None:
        """Stop every lane (what is not delivered yet is dropped)."""
        self._stopped.set()

    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _Lane:
    """One engine's sending thread (see :class:`Fanout`)."""

    def __init__(self, index: int, target: Callable[..., None], stopped: threading.Event) -> None:
        self.index = index
        self.items: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.dropped = threading.Event()
        self._target = target
        self._stopped = stopped
        self.thread = threading.Thread(target=self._run, name=f"weights-to-{index}", daemon=True)
        self.thread.start()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while not (self._stopped.is_set() or self.dropped.is_set()):
            try:
                item = self.items.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                continue
            if item is _DONE:
                return
            if self.error is None:  # after a failure the rest is dropped
                try:
                    self._deliver(item)
                except BaseException as err:  # noqa: BLE001 - raised on the pool's thread
                    self.error = err

    def _deliver(self, item: Any) -> None:
        while not (self._stopped.is_set() or self.dropped.is_set()):
            try:
                self._target(item, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                continue
