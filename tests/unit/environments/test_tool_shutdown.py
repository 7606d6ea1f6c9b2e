"""Stopping the tool threads: queued calls are cancelled, the running ones waited for within
a bound (issue: a SIGTERM stop started 252 queued tool calls and exited 260 s after the
signal, past the signal's window)."""

from __future__ import annotations

import threading
import time

from megatron_rl.environments.tools import ToolExecutor
from megatron_rl.rewards.config import RewardConfig

# The unsafe mode needs no box on the machine; these calls run no program.
REWARD = RewardConfig(code_allow_unsafe_sandbox=True)


class Blocking:
    """An environment whose step blocks until released (a tool waiting on its program)."""

    def __init__(self) -> None:
        self.started = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def step(self, call):
        with self.lock:
            self.started += 1
        self.release.wait(timeout=10)
        return call, True


def test_close_cancels_queued_calls_and_waits_for_the_running_ones_within_a_bound():
    env = Blocking()
    executor = ToolExecutor(2, REWARD)
    futures = [executor.submit(env, i) for i in range(40)]
    while env.started < 2:
        time.sleep(0.01)
    threading.Timer(0.3, env.release.set).start()  # the running calls end after 0.3 s
    began = time.monotonic()
    executor.close()
    took = time.monotonic() - began
    assert env.started == 2  # no queued call was started by the shutdown
    assert sum(f.cancelled() for f in futures) == 38
    assert [f.result() for f in futures[:2]] == [(0, True), (1, True)]
    assert 0.2 < took < 5  # waited for the two running calls, not for 20 rounds of them


def test_close_gives_up_on_a_call_past_its_bound(caplog):
    env = Blocking()
    executor = ToolExecutor(1, REWARD)
    executor.submit(env, 0)
    while env.started < 1:
        time.sleep(0.01)
    began = time.monotonic()
    executor.close(timeout=0.2)
    assert time.monotonic() - began < 2
    assert "1 tool calls still running after 0 s at shutdown" in caplog.text
    env.release.set()
