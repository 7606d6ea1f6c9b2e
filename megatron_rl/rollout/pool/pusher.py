"""A weight push from the pool's side: the transport's sender end, its group, the buckets.

:class:`WeightPusher` holds the sender end of ``rollout.weight_transport`` (chosen once:
:mod:`megatron_rl.rollout.weights.senders`). A group transport (``nccl``:
``Transport.joins_at_build`` false) has fixed members, so its group is formed of exactly the
engines a push goes to (:meth:`WeightPusher.form`). A push tells its targets, packs each
bucket once and hands it to a lane per engine (:mod:`.fanout`), then waits for every
target's ``Pushed``. What it is doing is its :class:`PushPhase`: an engine that dies while
a group forms or broadcasts cannot be survived (its peers wait in a collective).

The pusher waits through callables of its pool: ``pump`` (handle the engines' events;
raises, the pool closed, if one failed or died for good), ``is_current`` (an engine not
replaced since), ``closed`` and ``close`` (a push that makes no progress within
``rollout.push_timeout_seconds`` closes the pool, then raises).

That timeout is one of *progress* (:class:`Deadline`), not of the whole push or formation:
it starts again at each bucket, each engine that joins the group, each engine's ack. A push
of a 400 GB model in 1 GB buckets, or ``nccl_m2n``'s formation of one communicator per
engine (64 one after another), takes far longer than any one step, which is what the
timeout bounds (and what its error names).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rl.conversion.weight_stream import WeightBucket
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.messages import Push, Pushed
from megatron_rl.rollout.pool.fanout import Fanout
from megatron_rl.rollout.pool.launchers import EngineHandle
from megatron_rl.rollout.samples import PushStats
from megatron_rl.rollout.weights.buckets import WeightSender
from megatron_rl.rollout.weights.senders import Transport

logger = logging.getLogger(__name__)

POLL_SECONDS = 1.0


class PushPhase(enum.Enum):
    """What the pusher is doing; the value says it in words (errors name it)."""

    IDLE = "nothing"
    FORMING = "forming the weight-transfer group"
    PUSHING = "a weight push"  # buckets out, loads awaited: a death drops its engine out
    GROUP_PUSHING = "a weight push over the group"  # a death cannot be survived

    @property
    def pushing(self) -> bool:
        """Between a push's ``Push`` commands and its end (engines may wait for buckets)."""
        return self in (PushPhase.PUSHING, PushPhase.GROUP_PUSHING)

    @property
    def group_busy(self) -> bool:
        """The group transport is in a collective with its members."""
        return self in (PushPhase.FORMING, PushPhase.GROUP_PUSHING)


class Deadline:
    """``seconds`` without progress (``rollout.push_timeout_seconds``): :meth:`renew` at each
    step of progress starts the time again (:meth:`progress`: when a count of steps grew)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._count = 0
        self.renew()

    def renew(self) -> None:
        self.at = time.monotonic() + self.seconds

    def progress(self, count: int) -> None:
        """``count``: steps done so far (engines joined, acks): renew when it grew."""
        if count > self._count:
            self._count = count
            self.renew()

    def passed(self) -> bool:
        return time.monotonic() > self.at


class Weights(enum.Enum):
    """Which weights the pool's policy version names (what a restarted engine lacks)."""

    HF_DIR = "the HF directory's"  # no push yet: an engine started from it is current
    TRAINER = "the trainer's"  # pushed: a restarted engine needs them again (reweigh)


class Target(Protocol):
    index: int
    handle: EngineHandle


@dataclass
class PushResult:
    """A finished push: its stats and the acks of the targets (by engine index)."""

    stats: PushStats
    acks: dict[int, Pushed]


class WeightPusher:
    """The trainer end of the pool's weight transport (see the module docstring)."""

    def __init__(
        self,
        config: RolloutConfig,
        transport: Transport,
        hf_config: Any,
        pump: Callable[[float], None],
        is_current: Callable[[Target], bool],
        closed: Callable[[], bool],
        close: Callable[[], None],
    ) -> None:
        self.config = config
        self.transport = transport
        self._hf_config = hf_config
        self._pump, self._is_current = pump, is_current
        self._closed, self._close = closed, close
        self.phase = PushPhase.IDLE
        self.weights = Weights.HF_DIR
        self.sender: WeightSender | None = None
        self.members: list[Target] | None = None  # of the sender's group; None: not formed
        self.joined: set[int] = set()  # members that answered JoinTransport
        self._acks: dict[int, list[Pushed]] = {}

    @contextlib.contextmanager
    def _in(self, phase: PushPhase) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def is_member(self, engine: Target) -> bool:
        return any(m is engine for m in self.members or ())

    def acked(self, event: Pushed) -> None:
        self._acks.setdefault(event.version, []).append(event)

    # -- the group -------------------------------------------------------------------------
    def form(self, members: list[Target]) -> None:
        """Open the transport's sender end for ``members`` (the engines of a group transport
        join it now: the previous group, if any, is closed and each member leaves it)."""
        self.close()
        self.members, self.joined = members, set()
        if members:
            with self._in(PushPhase.FORMING):
                self.sender = self.transport.open(
                    self.config, self._hf_config, [e.handle for e in members], self.wait_joined
                )
            logger.debug("weight transport: formed of engines %s", [e.index for e in members])

    def wait_joined(self, connect: Callable[[], None] | None = None) -> None:
        """Run ``connect`` (the sender's side of the group's rendezvous) while watching the
        engines, then wait until every member has joined (``TransportJoined``). A member
        that dies meanwhile fails the run; no engine joining within
        ``rollout.push_timeout_seconds`` (of the start, or of the last one) raises: a
        transport with a communicator per engine (``nccl_m2n``) forms them one by one."""
        deadline = Deadline(self.config.push_timeout_seconds)
        what = "the engines joining the weight-transfer group"

        def joined() -> None:
            deadline.progress(len(self.joined))

        if connect is not None:
            self.watched(connect, deadline, what, joined)
        while not {e.index for e in self.members} <= self.joined:
            self._pump(POLL_SECONDS)
            joined()
            self.check_deadline(deadline, what)

    def close(self) -> None:
        """Close the sender end (e.g. the NCCL group's). Idempotent."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    # -- a push ----------------------------------------------------------------------------
    def push(
        self,
        version: int,
        buckets: Iterable[WeightBucket],
        targets: list[Target],
        kv_on_push: str,
        between: Callable[[], None],
    ) -> PushResult:
        """Load ``buckets`` into ``targets`` as policy ``version``. An engine that dies
        meanwhile (restarted: no longer current) drops out of the push."""
        start = time.perf_counter()
        # Refused before any engine is told: one told of an empty push would run the next
        # version, ahead of the pool, and tag its tokens with it.
        buckets = iter(buckets)
        first = next(buckets, None)
        if first is None:
            raise ValueError("push_weights got no buckets: this rank is not the stream's sender")
        buckets = itertools.chain([first], buckets)
        group = not self.transport.joins_at_build
        if group and [id(e) for e in targets] != [id(e) for e in self.members]:
            self.form(targets)  # a death, or a restarted engine: the group is the targets
        # No engine may keep the trainer waiting forever: one that failed raises at once (its
        # event), one that died is restarted or raises, one that hangs when the deadline passes
        # (per bucket and per ack: a whole push may take far longer).
        deadline = Deadline(self.config.push_timeout_seconds)
        self._acks = {}
        self.weights = Weights.TRAINER  # an engine restarted from now on needs them
        for engine in targets:
            engine.handle.send(Push(version, kv_on_push))
        phase = PushPhase.GROUP_PUSHING if group and targets else PushPhase.PUSHING
        with self._in(phase):
            tensors, nbytes, count = self._send_buckets(buckets, targets, deadline, between)
            acks = self._wait_acks(version, targets, deadline, between)
        stats = PushStats(
            version=version,
            tensors=tensors,
            bytes=nbytes,
            buckets=count,
            seconds=time.perf_counter() - start,
            load_seconds=max((a.seconds for a in acks.values()), default=0.0),
        )
        return PushResult(stats, acks)

    def _send_buckets(
        self,
        buckets: Iterable[WeightBucket],
        targets: Sequence[Target],
        deadline: Deadline,
        between: Callable[[], None],
    ) -> tuple[int, int, int]:
        """The buckets, after the ``Push`` commands: each packed once, to every target, with
        ``deadline`` renewed for each. Returns the tensors, bytes and buckets sent."""
        sender = self.sender
        by_index = {e.index: e for e in targets}

        def wait(index: int) -> None:
            self._pump(0.0)  # raises if an engine failed, or died past its restarts
            if not self._is_current(by_index[index]):
                lanes.drop(index)
            self.check_deadline(deadline, f"engine {index} taking a weight bucket")
            between()

        tensors = nbytes = count = 0
        lanes = Fanout([e.handle for e in targets], wait)  # before any call of wait
        with lanes:
            try:
                for bucket in buckets:
                    deadline.renew()  # progress: the previous bucket is out, this one built
                    if targets:  # with none, consumed all the same (the stream is collective)
                        lanes.put(sender.pack(bucket))
                        if sender.blocking:  # the NCCL broadcast, received by every engine
                            self.watched(
                                lambda b=bucket: sender.send(b),
                                deadline,
                                "weight broadcast",
                                between,
                            )
                        else:
                            sender.send(bucket)
                    between()
                    count += 1
                    tensors += len(bucket)
                    nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            finally:
                if not self._closed():  # a failed engine closed the pool: nobody to tell
                    lanes.put(None)
                    lanes.finish()
        return tensors, nbytes, count

    def _wait_acks(
        self,
        version: int,
        targets: Sequence[Target],
        deadline: Deadline,
        between: Callable[[], None],
    ) -> dict[int, Pushed]:
        """The ``Pushed`` events of ``targets`` by engine index (not of those restarted);
        ``between()`` after each wait; ``deadline`` renewed by each ack."""
        deadline.renew()  # the last bucket is out: the engines' loads from now
        while True:
            acked = {a.engine: a for a in self._acks.get(version, [])}
            deadline.progress(len(acked))
            waiting = [e.index for e in targets if e.index not in acked and self._is_current(e)]
            if not waiting:
                self._acks.pop(version, None)
                return acked
            self._pump(POLL_SECONDS)
            self.check_deadline(deadline, f"engine(s) {waiting} loading the weights")
            between()

    def watched(
        self,
        fn: Callable[[], None],
        deadline: Deadline,
        what: str,
        between: Callable[[], None] = lambda: None,
    ) -> None:
        """Run ``fn`` (a blocking collective with the engines) on a helper thread while this
        one watches the engines: an engine error or exit, or the deadline, raises here;
        ``between()`` after each look (before the deadline is checked: it may renew it)."""
        failure: list[BaseException] = []

        def target() -> None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                failure.append(err)

        worker = threading.Thread(target=target, name="weight-send", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(POLL_SECONDS)
            if worker.is_alive():
                self._pump(0.0)  # raises if an engine failed or died
                between()
                self.check_deadline(deadline, what)
        if failure:
            raise RuntimeError(f"weight push: {what} failed") from failure[0]

    def check_deadline(self, deadline: Deadline, what: str) -> None:
        if deadline.passed():
            self._close()
            raise TimeoutError(
                f"weight push: no progress from {what} within rollout.push_timeout_seconds "
                f"({self.config.push_timeout_seconds:g} s since the last bucket, engine "
                "joined or engine loaded); the generator pool was closed"
            )
