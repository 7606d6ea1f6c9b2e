"""The engine runner's side of multi-turn episodes (``rollout.engine.runner.EpisodeSteps``):
an environment per episode, its tool calls on a ``ToolExecutor``, token-in / token-out."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.environments.formats import ToolFormat
from megatron_rl.environments.protocol import Environment, EnvironmentContext, ToolResult
from megatron_rl.environments.registry import make_environment, tool_format
from megatron_rl.environments.tools import ToolExecutor
from megatron_rl.rewards.config import RewardConfig


class EnvironmentSteps:
    """``EpisodeSteps`` over environments: episode ``(prompt_index, sample_index)`` gets its
    own environment (``make()``, reset on its request's ``problem``) at its first call.

    A model turn is read with ``fmt.parse_ids`` (None: a final answer, the episode ends);
    a call runs as ``Environment.step`` on ``executor``; its output is tokenized once
    (``fmt.observation_ids``). ``results[(prompt_index, sample_index)]``: the episode's tool
    results, in order, until ``end`` hands them over (the step's tool metrics).
    """

    def __init__(
        self,
        fmt: ToolFormat,
        tokenizer: Any,
        executor: ToolExecutor,
        make: Callable[[], Environment],
        max_turns: int,
    ) -> None:
        self.fmt = fmt
        self.tokenizer = tokenizer
        self.executor = executor
        self.make = make
        self.max_turns = max_turns
        self.stop_token_ids = tuple(fmt.stop_token_ids(tokenizer))
        self.stop_strings = tuple(fmt.stop_strings)
        self.results: dict[tuple[int, int], list[ToolResult]] = {}
        self._environments: dict[tuple[int, int], Environment] = {}
        self._lock = threading.Lock()

    @classmethod
    def build(
        cls, config: EnvironmentConfig, sandbox: RewardConfig, tokenizer: Any, max_turns: int
    ) -> EnvironmentSteps:
        """The episodes of ``rollout.environment`` (``config``), tools run in ``sandbox`` (the
        run's ``reward`` section) on ``config.tool_workers`` threads; ``close()`` ends them."""
        context = EnvironmentContext(config, sandbox, tokenizer, max_turns)
        executor = ToolExecutor(config.tool_workers, sandbox)
        return cls(
            tool_format(config, tokenizer),
            tokenizer,
            executor,
            lambda: make_environment(config.name, context),
            max_turns,
        )

    def end(self, spec) -> list[tuple[str, float]]:
        """The episode of ``spec`` is over: its tool calls as ``(outcome, seconds)``."""
        key = (spec.prompt_index, spec.sample_index)
        with self._lock:
            self._environments.pop(key, None)
            results = self.results.pop(key, [])
        return [(r.outcome, r.seconds) for r in results]

    def close(self) -> None:
        """Stop the tool threads (calls under way finish in their sandbox's limits)."""
        self.executor.close()

    def tool_step(self, spec, sample, turn_ids: list[int]) -> Future[list[int] | None] | None:
        """The future observation ids of the call ``turn_ids`` makes (None: no call)."""
        call = self.fmt.parse_ids(turn_ids, self.tokenizer)
        key = (spec.prompt_index, spec.sample_index)
        if call is None:
            self._environments.pop(key, None)
            return None
        environment = self._environments.get(key)
        if environment is None:
            environment = self._environments[key] = self.make()
            environment.reset(spec.problem)
        observation: Future[list[int] | None] = Future()

        def done(step: Future[tuple[ToolResult, bool]]) -> None:
            with self._lock:
                # Cancelled: the runner gave the episode up (``Cancel``) and ended it; its
                # result is nobody's. Else it is running now: a later cancel fails, and
                # ``end`` (under the lock) takes the result kept here.
                if not observation.set_running_or_notify_cancel():
                    return
                try:
                    result, end = step.result()
                except BaseException as exc:  # noqa: BLE001 - the runner raises it
                    observation.set_exception(exc)
                    return
                self.results.setdefault(key, []).append(result)
            try:
                if end:
                    self._environments.pop(key, None)
                    observation.set_result(None)
                else:
                    observation.set_result(self.fmt.observation_ids(result.output, self.tokenizer))
            except BaseException as exc:  # noqa: BLE001 - the runner raises it
                observation.set_exception(exc)

        self.executor.submit(environment, call).add_done_callback(done)
        return observation
