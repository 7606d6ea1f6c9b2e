"""The pool's book of requests: which engine holds which, which wait, which came back.

Every request the pool hands out is kept as its :class:`RequestSpec` (with its seed and
thinking budget) until its sample returns, so that the requests of an engine that dies can be
resubmitted exactly as submitted (:meth:`RequestBook.withdraw`, then :meth:`take_pending`).
Requests that no engine can take now (none runs the current weights) wait here. Per engine,
the requests generating over time are integrated (:class:`~megatron_rl.rollout.load.InFlightClock`)
for the engines' idle fractions: a request held by an engine counts unless it is an episode
that waits on a tool call (the engine's ``ToolWaits``), which does not use the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine.interruption import InterruptionPolicy
from megatron_rl.rollout.load import InFlightClock
from megatron_rl.rollout.messages import RequestSpec
from megatron_rl.rollout.samples import Sample

logger = logging.getLogger(__name__)

Key = tuple[int, int]  # (prompt index, sample index)


@dataclass(frozen=True)
class Sampling:
    """One ``submit``'s sampling settings."""

    samples_per_prompt: int
    max_tokens: int
    temperature: float
    top_p: float

    @classmethod
    def of(
        cls,
        config: RolloutConfig,
        samples_per_prompt: int | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> Sampling:
        """The settings given, else the config's; checked."""
        n = samples_per_prompt or config.samples_per_prompt
        max_tokens = max_tokens or config.max_tokens
        temperature = config.temperature if temperature is None else temperature
        top_p = config.top_p if top_p is None else top_p
        if n < 1 or max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(
                f"invalid sampling settings: samples_per_prompt={n} max_tokens={max_tokens} "
                f"temperature={temperature} top_p={top_p}"
            )
        return cls(n, max_tokens, temperature, top_p)


def check_prompt(prompt: Sequence[int], vocab: int, max_model_len: int) -> tuple[int, ...]:
    """``prompt``'s token ids, checked against the vocabulary and the engines' length."""
    ids = tuple(int(t) for t in prompt)
    if not ids:
        raise ValueError("empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len {max_model_len}")
    return ids


class RequestBook:
    """Requests by engine (``engines`` of them), waiting ones, finished samples."""

    def __init__(self, engines: int, policy: InterruptionPolicy | None = None) -> None:
        self.policy = policy
        self.next_prompt = 0
        self.done: list[Sample] = []  # finished, not yet returned by the pool
        self.pending: list[RequestSpec] = []  # of a dead engine (or none usable), waiting
        self._held: list[dict[Key, RequestSpec]] = [{} for _ in range(engines)]
        self._finished_tokens = [0] * engines  # response tokens returned, per engine
        self._busy = [InFlightClock() for _ in range(engines)]  # of generating()
        self._on_tools = [0] * engines  # held episodes waiting on a tool call (ToolWaits)
        self.statuses: dict[int, dict[str, Any]] = {}  # the engines' last StatusReport
        self.cancelled: set[int] = set()  # prompts given up (:meth:`cancel`)

    # -- new requests ----------------------------------------------------------------------
    def new_prompt(
        self, ids: tuple[int, ...], sampling: Sampling, seed: int | None, problem: Any = None
    ) -> list[RequestSpec]:
        """The requests of a new prompt (its index: the next one). With ``seed``, sample j
        uses the seeds derived from (seed, j), whichever engine runs it; with ``problem``
        every sample is an episode of the engines' environment on it."""
        index = self.next_prompt
        self.next_prompt += 1
        n, max_tokens, temperature, top_p = dataclasses.astuple(sampling)
        seeds = [None] * n if seed is None else [sample_seed(seed, j) for j in range(n)]
        return [
            RequestSpec(index, j, ids, max_tokens, temperature, top_p, self._budget(s), s, problem)
            for j, s in enumerate(seeds)
        ]

    def _budget(self, seed: int | None) -> int | None:
        if self.policy is None:
            return None
        if seed is None:
            return self.policy.draw_budget()
        return random.Random(seed).randint(*self.policy.budget_range)

    # -- who holds what --------------------------------------------------------------------
    def outstanding(self, engine: int) -> int:
        return len(self._held[engine])

    def held(self, engine: int) -> list[RequestSpec]:
        return list(self._held[engine].values())

    def generating(self, engine: int) -> int:
        """The requests of ``engine`` that generate: held, less the episodes that wait on a
        tool call (as the engine last said)."""
        return max(self.outstanding(engine) - self._on_tools[engine], 0)

    def tool_waits(self, engine: int, waiting: int) -> None:
        """``engine``'s ``ToolWaits``: ``waiting`` of its episodes wait on a tool call."""
        self._on_tools[engine] = waiting
        self._busy[engine].observe(self.generating(engine))

    @property
    def in_flight(self) -> int:
        """Requests handed to an engine or waiting, not yet returned."""
        return sum(len(h) for h in self._held) + len(self.pending)

    def least_loaded(self, usable: Iterable[int]) -> int | None:
        """The engine of ``usable`` with the fewest requests (the first of equals)."""
        return min(usable, key=self.outstanding, default=None)

    def hold(self, engine: int, specs: Sequence[RequestSpec]) -> None:
        """``engine`` was given ``specs``."""
        self._held[engine].update(((s.prompt_index, s.sample_index), s) for s in specs)
        self._busy[engine].observe(self.generating(engine))

    def wait(self, specs: Sequence[RequestSpec]) -> None:
        """No engine can take ``specs`` now: they wait (:meth:`take_pending`)."""
        self.pending.extend(specs)

    def take_pending(self) -> list[list[RequestSpec]]:
        """The waiting requests, a prompt's samples together, in their order (emptied)."""
        pending, self.pending = self.pending, []
        by_prompt: dict[int, list[RequestSpec]] = {}
        for spec in pending:
            by_prompt.setdefault(spec.prompt_index, []).append(spec)
        return list(by_prompt.values())

    def withdraw(self, engine: int) -> list[RequestSpec]:
        """The requests of ``engine`` (it died), which holds none any more: they wait."""
        specs = self.held(engine)
        self._held[engine] = {}
        self._on_tools[engine] = 0  # its restart waits on nothing
        self._busy[engine].observe(0)
        self.pending.extend(specs)
        return specs

    def drop_held(self) -> None:
        """The engines are gone (the pool closed): what they held is dropped."""
        self._held = [{} for _ in self._held]

    def forget_prompts(self, prompts: set[int]) -> None:
        """Drop the waiting requests and finished samples of ``prompts`` (withdrawn)."""
        self.pending = [s for s in self.pending if s.prompt_index not in prompts]
        self.done = [s for s in self.done if s.prompt_index not in prompts]

    def cancel(self, prompts: set[int]) -> list[int]:
        """Give up ``prompts``: their requests held by engines, waiting, or finished and not
        taken are dropped, and a sample of theirs that an engine returns later (it finished
        before the engine heard of it) is dropped as well. Returns the engines that held
        one (to be told: ``Cancel``)."""
        holders = []
        for engine, held in enumerate(self._held):
            keys = [key for key in held if key[0] in prompts]
            for key in keys:
                del held[key]
            if keys:
                holders.append(engine)
                self._busy[engine].observe(self.generating(engine))
        self.forget_prompts(prompts)
        self.cancelled |= prompts
        return holders

    # -- samples back ----------------------------------------------------------------------
    def returned(self, engine: int, samples: Sequence[Sample]) -> None:
        """``engine`` returned ``samples``: they are done, its requests released."""
        kept = []
        for sample in samples:
            if sample.prompt_index in self.cancelled:  # given up: nobody wants it
                continue
            if self._held[engine].pop((sample.prompt_index, sample.sample_index), None) is None:
                # never expected: every request is returned by one engine, once
                logger.warning("engine %d returned a sample it was not given: dropped", engine)
                continue
            kept.append(sample)
        self._busy[engine].observe(self.generating(engine))
        self.done.extend(kept)
        self._finished_tokens[engine] += sum(len(s) for s in kept)

    def take_done(self, prompts: set[int] | None = None) -> list[Sample]:
        """The finished samples (of ``prompts`` only, if given), removed from the book."""
        if prompts is None:
            done, self.done = self.done, []
            return done
        mine, keep = [], []
        for sample in self.done:
            (mine if sample.prompt_index in prompts else keep).append(sample)
        self.done = keep
        return mine

    def reported(self, engine: int, status: dict[str, Any]) -> None:
        """``engine``'s ``StatusReport``: with the response tokens it returned before it
        (its samples sent before the report are counted: consistent)."""
        self.statuses[engine] = {**status, "finished_tokens": self._finished_tokens[engine]}

    def status(self, engine: int) -> dict[str, Any]:
        """``engine``'s last reported status (an idle one's if none)."""
        idle = {"version": None, "requests": 0, "tokens": 0, "oldest_version": None}
        return self.statuses.get(engine) or {
            **idle,
            "finished_tokens": self._finished_tokens[engine],
        }

    # -- load ------------------------------------------------------------------------------
    def reset_load(self) -> None:
        for engine, clock in enumerate(self._busy):
            clock.reset(self.generating(engine))

    def idle_fractions(self) -> list[float]:
        fractions = []
        for engine, clock in enumerate(self._busy):
            clock.observe(self.generating(engine))
            fractions.append(clock.averages()[1])
        return fractions


def sample_seed(prompt_seed: int, sample_index: int) -> int:
    """Seed of sample ``sample_index`` of a prompt seeded ``prompt_seed`` (63-bit)."""
    return (int(prompt_seed) * 1_000_003 + sample_index * 7_919 + 1) % (2**63 - 1)
