"""Doubles of an episode's engine and environment for the EngineRunner tests (shared by the
episode-steps and token-identity tests)."""

from __future__ import annotations

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

    def step(self):
        from megatron_rl.rollout.engine.vllm_engine import TokenDelta

        deltas = []
        for rid, (ids, stop) in list(self.active.items()):
            del self.active[rid]
            reason = "stop" if ids[-1] in stop else "length"
            deltas.append(TokenDelta(rid, ids, [-0.5] * len(ids), True, reason, None))
        return deltas
