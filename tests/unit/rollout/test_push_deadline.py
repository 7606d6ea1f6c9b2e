"""``rollout.push_timeout_seconds`` bounds the time without progress, as its error says: each
engine that joins the weight-transfer group, each bucket and each engine's ack start it again
(issue 36, 12). ``nccl_m2n`` forms one communicator per engine, one after another: 64 of them
take far longer than one; a push of a large model far longer than one bucket."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.messages import Pushed
from megatron_rl.rollout.pool.pusher import WeightPusher
from megatron_rl.rollout.weights.senders import Transport

TIMEOUT = 0.6  # rollout.push_timeout_seconds
STEP = 0.2  # one communicator formed, one bucket broadcast: well within the timeout
STEPS = 5  # together: longer than the timeout


class _Handle:
    def __init__(self, index: int) -> None:
        self.index, self.sent, self.weights = index, [], []

    def send(self, command) -> None:
        self.sent.append(command)

    def put_weights(self, item, timeout=None) -> None:
        self.weights.append(item)


class _Sender:
    """A blocking transport's sender end (as ``nccl``'s, ``nccl_m2n``'s): each bucket's
    collective takes ``STEP``."""

    blocking = True

    def __init__(self) -> None:
        self.sent = 0

    def pack(self, bucket):
        return [name for name, _ in bucket]

    def send(self, bucket) -> None:
        time.sleep(STEP)
        self.sent += 1

    def close(self) -> None:
        pass


def _pusher(engines: int, join_steps: int | None = None):
    """A pusher over a per-engine group transport: its ``connect`` forms the engines'
    communicators one by one (``STEP`` each; none after ``join_steps``), each engine
    answering TransportJoined once its own is formed; every engine acks a push once all of
    its buckets are out."""
    formed: list[int] = []
    senders: list[_Sender] = []
    targets = [SimpleNamespace(index=i, handle=_Handle(i)) for i in range(engines)]

    def open_per_engine(config, hf_config, handles, wait_joined):
        def connect() -> None:
            for handle in handles:
                if join_steps is not None and len(formed) == join_steps:
                    time.sleep(60)  # this engine never joins
                time.sleep(STEP)
                formed.append(handle.index)

        wait_joined(connect)
        senders.append(_Sender())
        return senders[-1]

    def pump(timeout: float) -> None:  # the pool's event loop
        time.sleep(min(timeout, 0.02))
        pusher.joined.update(formed)  # TransportJoined events
        for target in targets:
            if senders and senders[-1].sent == expected_buckets[0] and target.handle.sent:
                version = target.handle.sent[-1].version
                if not any(a.engine == target.index for a in pusher._acks.get(version, [])):
                    pusher.acked(Pushed(target.index, version, 0.0, 1, 4, None))

    expected_buckets = [0]
    closed: list[bool] = []
    transport = Transport("per-engine", lambda config: "x", False, open_per_engine)
    pusher = WeightPusher(
        RolloutConfig(push_timeout_seconds=TIMEOUT),
        transport,
        None,
        pump=pump,
        is_current=lambda engine: True,
        closed=lambda: bool(closed),
        close=lambda: closed.append(True),
    )
    return pusher, targets, expected_buckets, closed


def test_a_group_formed_one_engine_at_a_time_has_the_timeout_per_engine():
    pusher, targets, _, closed = _pusher(STEPS)
    start = time.monotonic()
    pusher.form(targets)
    assert time.monotonic() - start > TIMEOUT  # longer than the timeout in all
    assert pusher.joined == set(range(STEPS)) and not closed


def test_an_engine_that_never_joins_still_times_out_naming_the_key():
    pusher, targets, _, closed = _pusher(STEPS, join_steps=2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no progress from the engines joining.*push_timeout"):
        pusher.form(targets)
    assert time.monotonic() - start < 2 * STEP + TIMEOUT + 2
    assert closed


def test_a_push_longer_than_the_timeout_passes_when_each_bucket_is_within_it():
    pusher, targets, expected, closed = _pusher(2)
    pusher.form(targets)
    expected[0] = STEPS
    buckets = [[(f"w{i}", torch.zeros(1))] for i in range(STEPS)]
    start = time.monotonic()
    result = pusher.push(1, iter(buckets), targets, "keep", lambda: None)
    assert time.monotonic() - start > TIMEOUT
    assert result.stats.buckets == STEPS and sorted(result.acks) == [0, 1] and not closed
