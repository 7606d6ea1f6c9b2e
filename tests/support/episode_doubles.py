"""Doubles of an episode's engine and environment for the EngineRunner tests (shared by the
episode-steps and token-identity tests)."""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_rl.environments.protocol import Environment, ToolResult
from megatron_rl.rollout.engine.runner import EngineRunner
from megatron_rl.rollout.messages import Ready, Stopped


class Echo(Environment):
    """Answers every call with its code's length (no sandbox: the executor's threads only)."""

    def run(self, code: str) -> ToolResult:
        return ToolResult("ok", f"{len(code)}\n")


class Scripted:
    """An engine that writes ``turns[k]`` (ids) as its k-th request's output."""

    def __init__(self, turns, max_model_len: int = 1000):
        self.turns, self.added, self.active = list(turns), [], {}
        self.max_model_len = max_model_len

    def add(self, request_id, prompt_ids, max_tokens, temperature, top_p, stop, **_):
        self.added.append(list(prompt_ids))
        self.active[request_id] = (self.turns.pop(0), stop)

    def has_work(self):
        return bool(self.active)

    def abort(self, request_ids):
        for rid in request_ids:
            del self.active[rid]
        return {}

    def step(self):
        from megatron_rl.rollout.engine.vllm_engine import TokenDelta

        deltas = []
        for rid, (ids, stop) in list(self.active.items()):
            del self.active[rid]
            reason = "stop" if ids[-1] in stop else "length"
            deltas.append(TokenDelta(rid, ids, [-0.5] * len(ids), True, reason, None))
        return deltas


class Timed(Scripted):
    """A :class:`Scripted` engine whose every request generates for ``seconds`` (wall time,
    in steps of 10 ms) before it writes its turn."""

    def __init__(self, turns, seconds: float, max_model_len: int = 1000):
        super().__init__(turns, max_model_len)
        self.seconds, self.due = seconds, {}

    def add(self, request_id, *args, **kwargs):
        super().add(request_id, *args, **kwargs)
        self.due[request_id] = time.monotonic() + self.seconds

    def step(self):
        time.sleep(0.01)
        now = time.monotonic()
        ready = {rid: self.active.pop(rid) for rid in list(self.active) if self.due[rid] <= now}
        active, self.active = self.active, ready
        try:
            return super().step()
        finally:
            self.active = active


class RunnerThreads:
    """A launcher for the real GeneratorPool whose engine i is an EngineRunner on a thread,
    over ``make_engine()`` and the episodes ``steps`` (no vLLM)."""

    restartable = False

    def __init__(self, make_engine, steps, settings) -> None:
        self.make_engine, self.steps, self.settings = make_engine, steps, settings
        self.events: queue.Queue = queue.Queue()

    def start(self, count: int) -> list:
        return [_RunnerThread(i, self) for i in range(count)]

    def restart(self, index: int):
        raise NotImplementedError("runner threads are not restarted")

    def close(self) -> None:
        pass


class _RunnerThread:
    log_path, exitcode = None, None

    def __init__(self, index: int, launcher: RunnerThreads) -> None:
        self.index = index
        self.commands, self.weights = queue.Queue(), queue.Queue()
        engine = launcher.make_engine()
        runner = EngineRunner(index, engine, launcher.settings, launcher.events, launcher.steps)

        def serve() -> None:
            launcher.events.put(Ready(index, engine.max_model_len))
            runner.serve(self.commands, self.weights.get)
            launcher.events.put(Stopped(index))

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    @property
    def pid(self) -> int:
        return os.getpid()

    def send(self, command) -> None:
        self.commands.put(command)

    def put_weights(self, item, timeout=None) -> None:
        self.weights.put(item, timeout=timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def leftover_events(self) -> list:
        return []

    def join(self, timeout=None) -> None:
        self.thread.join(timeout)

    def terminate(self) -> None:
        pass

    def discard(self) -> None:
        pass


class SleepyTool:
    """The runner's ``EpisodeSteps`` with a tool that takes ``seconds`` a call (on a thread of
    its own) and answers ``observation`` (ids); a model turn that ends on ``call_id`` calls
    it. ``ended``: the episodes ended, as (prompt, sample); ``calls``: each call's time span."""

    def __init__(self, call_id: int, observation: list[int], seconds: float, max_turns: int = 3):
        self.stop_token_ids, self.stop_strings, self.max_turns = (call_id,), (), max_turns
        self.observation, self.seconds = list(observation), seconds
        self.ended: list[tuple[int, int]] = []
        self.calls: list[tuple[float, float]] = []  # each call's (start, end), monotonic
        self._threads = ThreadPoolExecutor(4)

    def tool_step(self, spec, sample, turn_ids) -> Future:
        def call() -> list[int]:
            start = time.monotonic()
            time.sleep(self.seconds)
            self.calls.append((start, time.monotonic()))
            return self.observation

        return self._threads.submit(call)

    def end(self, spec) -> list[tuple[str, float]]:
        self.ended.append((spec.prompt_index, spec.sample_index))
        return [("ok", self.seconds)]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
