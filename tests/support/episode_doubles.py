"""Doubles of an episode's engine and environment for the EngineRunner tests (shared by the
episode-steps and token-identity tests)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_rl.environments.protocol import Environment, ToolResult


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


class SleepyTool:
    """The runner's ``EpisodeSteps`` with a tool that takes ``seconds`` a call (on a thread of
    its own) and answers ``observation`` (ids); a model turn that ends on ``call_id`` calls
    it. ``ended``: the episodes ended, as (prompt, sample)."""

    def __init__(self, call_id: int, observation: list[int], seconds: float, max_turns: int = 3):
        self.stop_token_ids, self.stop_strings, self.max_turns = (call_id,), (), max_turns
        self.observation, self.seconds = list(observation), seconds
        self.ended: list[tuple[int, int]] = []
        self._threads = ThreadPoolExecutor(4)

    def tool_step(self, spec, sample, turn_ids) -> Future:
        def call() -> list[int]:
            time.sleep(self.seconds)
            return self.observation

        return self._threads.submit(call)

    def end(self, spec) -> list[tuple[str, float]]:
        self.ended.append((spec.prompt_index, spec.sample_index))
        return [("ok", self.seconds)]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
