"""Emulated vLLM engines and a pool of them on a simulated clock (no torch import).

``EmulatedPool`` is a :class:`~megatron_rl.rollout.client.RolloutClient`, as
``megatron_rl.rollout.pool.GeneratorPool`` is (``submit``, ``poll``, ``version``,
``push_weights``; its engines never restart), plus ``in_flight``,
``oldest_version_in_flight``, ``staleness``, ``engine_status`` and ``advance`` for the
trainer emulator. It schedules as the real pool does: each prompt's G
samples go to the engine with the fewest outstanding samples.

Each engine emulates vLLM's continuous batching: at most ``max_num_seqs`` running sequences,
admitted in arrival order while the KV cache has room for them; every decode step adds one
token to each running sequence and lasts ``CostModel.decode_step(B, context)``; admitting
sequences costs their prefill; when the KV cache would overflow, the newest sequence is
preempted and later recomputed (prefill of its prompt and the tokens it had), as vLLM V1
does. Weight pushes pause every engine for the push; tokens record the version that made
them. Between events an engine jumps many steps at once (at most ``CHUNK``, with the step
time taken at the chunk's mean context), so a run of thousands of steps simulates in seconds.

``poll(timeout)`` advances the clock by ``timeout`` (the real pool returns at the first
finished sample): the source sees completions up to one poll interval late (the source
polls every 1 s; steps last minutes).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.samples import PushStats, Sample
from megatron_rl.simulation.costs import CostModel
from megatron_rl.simulation.workload import LengthModel

CHUNK = 256  # most decode steps jumped at once (step time at the chunk's mean context)


class SimSample(Sample):
    """A finished sample without token ids. ``versions`` holds one entry per run of tokens
    made by one policy version (what ``oldest_version`` needs); ``segments`` gives the
    (version, tokens) runs for per-token staleness."""

    def __init__(self, prompt_index: int, sample_index: int, prompt_len: int) -> None:
        super().__init__(prompt_index, sample_index, [])
        self.prompt_len = prompt_len
        self.segments: list[tuple[int, int]] = []
        self.tokens = 0
        self.finished_at = 0.0

    def __len__(self) -> int:
        return self.tokens


class _Seq:
    __slots__ = ("sample", "length", "generated", "admit_step", "seg_start", "version")

    def __init__(self, sample: SimSample, length: int) -> None:
        self.sample = sample
        self.length = length  # response tokens to generate
        self.generated = 0  # at admission (synced on every event)
        self.admit_step = 0
        self.seg_start = 0  # generated tokens when the current version's run began
        self.version = 0


class EmulatedEngine:
    """One engine (its TP GPUs together); see the module docstring."""

    def __init__(self, index: int, costs: CostModel, max_num_seqs: int, version: int) -> None:
        self.index = index
        self.costs = costs
        self.max_num_seqs = max_num_seqs
        self.version = version
        self.t = 0.0
        self.step = 0
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []  # admission order (the newest is preempted first)
        self._finish: list[tuple[int, int, _Seq]] = []  # (finish step, tiebreak, seq)
        self._kv_base = 0  # context tokens = _kv_base + len(running) * step
        self._tiebreak = 0
        self.done: list[SimSample] = []
        self.busy_seconds = 0.0
        self.seq_seconds = 0.0  # integral of running sequences over time
        self.preemptions = 0

    @property
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def context_tokens(self) -> int:
        return self._kv_base + len(self.running) * self.step

    def _generated(self, seq: _Seq) -> int:
        return seq.generated + self.step - seq.admit_step

    def submit(self, sample: SimSample, length: int) -> None:
        seq = _Seq(sample, length)
        seq.version = self.version
        self.waiting.append(seq)

    # -- events -------------------------------------------------------------------------------
    def _admit(self) -> float:
        """Admit waiting sequences that fit; returns their prefill seconds."""
        tokens = 0
        cap = self.costs.kv_capacity_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = seq.sample.prompt_len + seq.generated
            if self.running and self.context_tokens() + need + len(self.running) + 1 > cap:
                break
            self.waiting.popleft()
            seq.admit_step = self.step
            self._kv_base += need - self.step
            self.running.append(seq)
            self._tiebreak += 1
            heapq.heappush(
                self._finish, (self.step + seq.length - seq.generated, self._tiebreak, seq)
            )
            tokens += need
        return self.costs.prefill(tokens) if tokens else 0.0

    def _close_segment(self, seq: _Seq) -> None:
        generated = self._generated(seq)
        if generated > seq.seg_start:
            seq.sample.segments.append((seq.version, generated - seq.seg_start))
        seq.seg_start = generated

    def _remove(self, seq: _Seq) -> None:
        self._close_segment(seq)
        generated = self._generated(seq)
        self._kv_base -= seq.sample.prompt_len + seq.generated - seq.admit_step
        seq.generated = generated
        self.running.remove(seq)

    def _preempt_newest(self) -> None:
        seq = self.running[-1]
        self._remove(seq)
        self._finish = [f for f in self._finish if f[2] is not seq]
        heapq.heapify(self._finish)
        self.waiting.appendleft(seq)  # recomputed first when room frees up
        self.preemptions += 1

    def _finish_due(self) -> None:
        while self._finish and self._finish[0][0] <= self.step:
            _, _, seq = heapq.heappop(self._finish)
            self._remove(seq)
            sample = seq.sample
            sample.tokens = seq.generated
            sample.versions = sorted({v for v, _ in sample.segments})
            sample.finish_reason = "stop"
            sample.finished_at = self.t
            sample.engine = self.index
            self.done.append(sample)

    def advance_to(self, until: float) -> None:
        """Generate until the engine's clock reaches ``until`` (it may pass it by one step or
        one prefill: an engine does not stop mid-step)."""
        cap = self.costs.kv_capacity_tokens
        while self.t < until:
            prefill = self._admit()
            if prefill:
                self.t += prefill
                self.busy_seconds += prefill
                continue
            batch = len(self.running)
            if batch == 0:
                self.t = until  # idle: nothing to generate
                return
            room = (cap - self.context_tokens()) // batch
            if room < 1 and batch > 1:
                self._preempt_newest()
                continue
            n = min(self._finish[0][0] - self.step, max(room, 1), CHUNK)
            dt = self.costs.decode_step(batch, self.context_tokens() + batch * n / 2)
            n = max(1, min(n, math.ceil((until - self.t) / dt)))
            self.t += n * dt
            self.step += n
            self.busy_seconds += n * dt
            self.seq_seconds += n * dt * batch
            self._finish_due()

    def load_weights(self, version: int) -> None:
        """New weights: the current runs of tokens close under the old version."""
        for seq in self.running:
            self._close_segment(seq)
            seq.version = version
        for seq in self.waiting:
            seq.version = version
        self.version = version


class EmulatedPool(RolloutClient):
    """A rollout client over emulated engines (the real pool's scheduling)."""

    def __init__(
        self,
        costs: CostModel,
        lengths: LengthModel,
        engines: int,
        max_num_seqs: int,
        seed: int = 0,
        initial_version: int = 0,
    ) -> None:
        self.costs = costs
        self.lengths = lengths
        self.version = initial_version
        self.now = 0.0
        self.seed = seed
        self.engines = [
            EmulatedEngine(i, costs, max_num_seqs, initial_version) for i in range(engines)
        ]
        self._next_prompt = 0
        self._done: list[SimSample] = []
        self.push_seconds = 0.0
        self.pushes = 0

    # -- the GeneratorPool interface ------------------------------------------------------------
    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        samples_per_prompt: int | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seeds: Sequence[int] | None = None,
        problems: Sequence[Any] | None = None,
    ) -> list[int]:
        """Queue ``samples_per_prompt`` samples of each prompt on the least-loaded engine (as
        ``GeneratorPool.submit``); their lengths follow the length model, seeded by ``seeds``
        (the sampling settings are the length model's). It emulates single-turn samples:
        ``problems`` (multi-turn episodes) are refused."""
        if problems is not None:
            raise ValueError("EmulatedPool emulates single-turn samples: no problems")
        if samples_per_prompt is None:
            raise ValueError("EmulatedPool.submit needs samples_per_prompt (it has no config)")
        indices = []
        for p, prompt in enumerate(prompts):
            index = self._next_prompt
            self._next_prompt += 1
            seed = seeds[p] if seeds is not None else self.seed * 1_000_003 + index
            rng = random.Random(seed)
            engine = min(self.engines, key=lambda e: e.outstanding)
            engine.advance_to(self.now)  # it admits from now on, not in the past
            for j in range(samples_per_prompt):
                length, interrupted = self.lengths.response_length(rng)
                sample = SimSample(index, j, len(prompt))
                sample.interrupted = interrupted
                engine.submit(sample, length)
            indices.append(index)
        return indices

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Samples finished by ``now + timeout`` (the clock moves on by ``timeout``)."""
        if self.in_flight and not self._done:
            self.advance(timeout)
        self._gather()
        done, self._done = self._done, []
        return done

    @property
    def in_flight(self) -> int:
        return sum(e.outstanding for e in self.engines)

    def oldest_version_in_flight(self) -> int | None:
        versions = [
            min((s.sample.segments[0][0] if s.sample.segments else s.version) for s in q)
            for e in self.engines
            for q in (e.running, e.waiting)
            if q
        ]
        return min(versions, default=None)

    @property
    def staleness(self) -> int:
        oldest = self.oldest_version_in_flight()
        return 0 if oldest is None else self.version - oldest

    def engine_status(self) -> list[dict[str, int]]:
        return [
            {
                "index": e.index,
                "version": e.version,
                "requests": e.outstanding,
                "running": len(e.running),
                "tokens": e.context_tokens(),
            }
            for e in self.engines
        ]

    # -- what the trainer emulator does -------------------------------------------------------
    def advance(self, seconds: float) -> None:
        """Let the engines generate for ``seconds`` of simulated time."""
        self.now += seconds
        for engine in self.engines:
            engine.advance_to(self.now)

    def push_weights(
        self,
        buckets: Iterable[Any],
        kv_on_push: str | None = None,
        between: Callable[[], None] | None = None,
        *,
        version: int | None = None,
    ) -> PushStats:
        """Push new weights (``version``, default the next; the emulator's trainer counts
        its updates): every engine pauses for the push's duration (the cost model's, whatever
        ``buckets`` hold), then generates with them."""
        seconds = self.costs.push()
        for engine in self.engines:
            engine.advance_to(self.now)
        self.now += seconds
        self.version = self.version + 1 if version is None else version
        for engine in self.engines:
            engine.t = max(engine.t, self.now)  # paused: no progress during the push
            engine.load_weights(self.version)
        self.push_seconds += seconds
        self.pushes += 1
        return PushStats(self.version, 0, 0, 0, seconds=seconds, load_seconds=seconds)

    def reweigh(self, buckets: Iterable[Any]) -> PushStats:
        """Emulated engines never restart: no engine waits for weights."""
        return PushStats(self.version, 0, 0, 0, seconds=0.0, load_seconds=0.0)

    def _gather(self) -> None:
        for engine in self.engines:
            if engine.done:
                self._done.extend(engine.done)
                engine.done = []
