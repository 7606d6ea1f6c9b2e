"""The pool's front: :class:`GeneratorPool` (usage, collaborators: see the package)."""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from megatron_rl.conversion.weight_stream import WeightBucket
from megatron_rl.platform import watchdog
from megatron_rl.rollout.client import GenerationStopped, RolloutClient, WeightsNeeded
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine.interruption import InterruptionPolicy
from megatron_rl.rollout.messages import (
    AskStatus,
    Cancel,
    Event,
    Pushed,
    SamplesDone,
    StatusReport,
    Stopped,
    ToolWaits,
    TransportJoined,
    unknown_message,
)
from megatron_rl.rollout.pool.launchers import (
    EngineHandle,
    EngineLauncher,
    engine_launcher,
    hf_encoder,
    hf_text_config,
    runner_settings,
)
from megatron_rl.rollout.pool.pusher import WeightPusher, Weights
from megatron_rl.rollout.pool.requests import RequestBook, Sampling
from megatron_rl.rollout.pool.restarts import broken_group_message
from megatron_rl.rollout.pool.scheduler import RequestScheduler
from megatron_rl.rollout.pool.supervisor import (
    POLL_SECONDS,
    EngineEvents,
    EngineRecord,
    EngineSupervisor,
)
from megatron_rl.rollout.samples import PushStats, Sample
from megatron_rl.rollout.weights.senders import Transport, transport_for

logger = logging.getLogger(__name__)

_STOP_SECONDS = 30.0  # engines that have not stopped by then are terminated


class PoolState(enum.Enum):
    STARTING = "starting"  # engines started, not all up (``wait=False``)
    RUNNING = "running"  # every engine was up once; the weight transport is open
    CLOSED = "closed"


class GeneratorPool(RolloutClient):
    """N vLLM engines behind one interface (see the module docstring); a
    :class:`~megatron_rl.rollout.client.RolloutClient`.

    ``hf_dir``: the HF model directory the engines start from (config + initial weights).
    ``encode``: text -> token ids without special tokens; needed for interruptions
    (the interruption text and the think-close marker). Without it, and with interruptions
    enabled, the HF tokenizer in ``hf_dir`` is used. ``wait=False`` returns while the engines
    start (the first call that needs them waits), so that the caller can work meanwhile.
    ``launcher`` (default: ``rollout.placement``'s), ``transport`` (default:
    ``rollout.weight_transport``'s) and ``text_config`` (default: ``hf_dir``'s HF config)
    replace what the pool would make itself. ``sandbox``: the run's ``reward`` section
    (``rewards.config.RewardConfig``), whose sandbox the tools of multi-turn episodes run in
    (None: its defaults).
    """

    def __init__(
        self,
        hf_dir: str,
        config: RolloutConfig,
        encode: Callable[[str], list[int]] | None = None,
        wait: bool = True,
        initial_version: int = 0,
        *,
        launcher: EngineLauncher | None = None,
        transport: Transport | None = None,
        text_config: Any = None,
        sandbox: Any = None,
    ) -> None:
        config.validate()
        config = config.resolved()  # weight_transport "auto": decided once, here
        self.config = config
        transport = transport or transport_for(config)
        transport.check(config)  # before any engine starts
        self.hf_dir = str(hf_dir)
        # A resumed trainer continues its numbering: the next push is initial_version + 1.
        self.version = initial_version
        self._hf = text_config if text_config is not None else hf_text_config(self.hf_dir)
        self.policy = None
        if config.interruption.enabled:
            self.policy = InterruptionPolicy.from_config(
                config.interruption, encode or hf_encoder(self.hf_dir)
            )
        self._state = PoolState.STARTING
        self._requests = RequestBook(config.engines, self.policy)
        settings = runner_settings(config, self._hf, self.policy, sandbox)
        launcher = launcher or engine_launcher(self.hf_dir, config, settings)
        handler = EngineEvents(self._on_event, self._on_death, self._on_restart)
        self._engines = EngineSupervisor(config, launcher, handler)
        self._scheduler = RequestScheduler(
            self._engines, self._requests, self._hf.vocab_size, lambda: self.version
        )
        self._pusher = WeightPusher(
            config,
            transport,
            self._hf,
            self._pump,
            self._engines.is_current,
            lambda: self.closed,
            self.close,
        )
        self._engines.start()
        if wait:
            self._wait_ready()

    def _wait_ready(self) -> None:
        self._supervised(self._engines.wait_ready)
        logger.info(
            "generator pool: %d engine(s) ready (%s, weight transport %s)",
            len(self._engines.engines),
            self.config.placement,
            self.config.weight_transport,
        )
        self._pusher.form(list(self._engines.engines))
        self._state = PoolState.RUNNING

    # -- generation -------------------------------------------------------------------------
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
        """Queue ``samples_per_prompt`` samples of every prompt (token ids); returns the
        prompts' indices (``Sample.prompt_index``). Settings default to the config's;
        ``temperature=0`` samples greedily (evaluation). ``seeds`` (one per prompt) make the
        samples (and their thinking budgets) reproducible: sample j of a prompt with seed s
        uses the seeds derived from (s, j), whichever engine runs it and whatever else runs.
        ``problems`` (one per prompt, ``data.prompts.Prompt``): the samples are multi-turn
        episodes of ``rollout.environment`` on them (the engines must run episodes:
        ``rollout.max_turns`` > 1)."""
        self._check_open()
        if problems is not None and not self.episodes:
            raise ValueError(
                "problems given, but the engines run single-turn samples: set "
                "rollout.max_turns > 1 and rollout.environment.name"
            )
        sampling = Sampling.of(self.config, samples_per_prompt, max_tokens, temperature, top_p)
        return self._scheduler.submit(prompts, sampling, seeds, problems)

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Finished samples not returned yet, waiting up to ``timeout`` s for the first."""
        deadline = time.monotonic() + timeout
        while not self._requests.done and self.in_flight:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._pump(min(remaining, POLL_SECONDS))
        self._pump(0.0)
        return self._requests.take_done()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        stop_when: Callable[[], bool] | None = None,
        **settings: Any,
    ) -> list[Sample]:
        """Generate and wait: the samples of ``prompts`` ordered by (prompt, sample). Raises
        ``WeightsNeeded`` (withdrawing its requests) when every engine waits for weights,
        and ``GenerationStopped`` (cancelling them: :meth:`cancel`) as soon as ``stop_when()``
        is true (asked while it waits, e.g. a preemption's signal)."""
        indices = set(self.submit(prompts, **settings))
        mine: list[Sample] = []
        expected = len(indices) * (
            settings.get("samples_per_prompt") or self.config.samples_per_prompt
        )
        while len(mine) < expected:
            self._pump(POLL_SECONDS)
            if stop_when is not None and stop_when():
                self.cancel(indices)
                raise GenerationStopped(
                    f"generate(): stopped with {len(mine)} of {expected} samples; its "
                    "requests were cancelled"
                )
            if self.needs_weights() and not any(e.current for e in self._engines.engines):
                # No engine holds any of our requests now: withdraw them all, so that the
                # caller can reweigh and call again (same seeds: the same samples).
                self._requests.forget_prompts(indices)
                raise WeightsNeeded(
                    "generate(): every engine was restarted and waits for the current weights "
                    "(GeneratorPool.reweigh); this call's requests were withdrawn"
                )
            mine += self._requests.take_done(indices)
        return sorted(mine, key=lambda s: (s.prompt_index, s.sample_index))

    def cancel(self, prompts: Iterable[int]) -> None:
        """Give up every request of ``prompts`` (``Sample.prompt_index``): the engines that
        hold one abort it (``Cancel``), the waiting ones and the finished samples not taken
        are dropped, and none of their samples is returned later (``poll`` included), so
        that they cannot reach a training batch."""
        self._check_open()
        prompts = set(prompts)
        for index in self._requests.cancel(prompts):
            self._engines.engines[index].handle.send(Cancel(tuple(sorted(prompts))))

    # -- state ------------------------------------------------------------------------------
    @property
    def episodes(self) -> bool:
        """Whether the engines run multi-turn episodes (``rollout.max_turns`` > 1 with an
        environment): ``submit(problems=...)`` makes episodes."""
        return self.config.episodes

    @property
    def closed(self) -> bool:
        return self._state is PoolState.CLOSED

    @property
    def in_flight(self) -> int:
        """Samples submitted and not yet finished."""
        return self._requests.in_flight

    @property
    def pending_requests(self) -> int:
        """Requests that wait in the pool for an engine that runs the current weights."""
        return len(self._requests.pending)

    @property
    def restarts(self) -> int:
        """Engine restarts so far (all engines)."""
        return self._engines.restarts

    @property
    def stale_engines(self) -> list[int]:
        """Engines that do not run the current policy version (restarted since the last
        push, starting or waiting for :meth:`reweigh`): they take no request."""
        return [e.index for e in self._engines.engines if not e.current]

    @property
    def joined_transport(self) -> frozenset[int]:
        """Engines that answered ``JoinTransport`` since the weight transport was formed."""
        return frozenset(self._pusher.joined)

    def engine_handles(self) -> list[EngineHandle]:
        """Each engine's handle, by index (a restart replaces it): ``pid``, ``log_path``..."""
        return [e.handle for e in self._engines.engines]

    def oldest_version_in_flight(self) -> int | None:
        """The oldest policy version that produced a token still in flight (a lower bound:
        engines report it whenever samples finish or weights load); None when idle."""
        self._pump(0.0)
        return self._scheduler.oldest_version_in_flight()

    @property
    def staleness(self) -> int:
        """How many versions the newest weights are ahead of the oldest sample in flight."""
        oldest = self.oldest_version_in_flight()
        return 0 if oldest is None else self.version - oldest

    def reset_engine_load(self) -> None:
        """Start a new window for :meth:`engine_idle_fractions`."""
        self._requests.reset_load()

    def engine_idle_fractions(self) -> list[float]:
        """Per engine, the fraction of the time since :meth:`reset_engine_load` (or the
        start) that it had no request of the pool generating. As the pool sees it: requests
        count from their submission until their samples are handled (any pool call), so an
        engine that finished a request counts as busy until the pool's next call; an episode
        that waits on a tool call does not count from the engine's ``ToolWaits`` on until
        the one that says its call returned."""
        return [] if self.closed else self._requests.idle_fractions()

    def engine_status(self) -> list[dict[str, Any]]:
        """Each engine's state, asked now (answered between two engine steps): policy
        ``version``, ``requests`` / ``tokens`` in flight, ``oldest_version`` in flight."""
        self._check_open()
        self._requests.statuses.clear()
        asked = [e for e in self._engines.engines if e.ready]
        for engine in asked:
            engine.handle.send(AskStatus())
        # an engine that dies meanwhile (restarted: another record) answers no more
        while any(
            e.index not in self._requests.statuses and self._engines.is_current(e) for e in asked
        ):
            self._pump(POLL_SECONDS)
        return [self._requests.status(e.index) for e in self._engines.engines]

    def generated_tokens(self) -> int:
        """Response tokens generated so far by every request, finished or in flight (asks the
        engines, like ``engine_status``). The difference of two calls is the decoding work
        done in between (the compute clock splits a validation window by it)."""
        return sum(s["tokens"] + s["finished_tokens"] for s in self.engine_status())

    def needs_weights(self) -> bool:
        """Whether a restarted engine is ready and waits for the current weights
        (:meth:`reweigh`)."""
        return any(e.ready and not e.current for e in self._engines.engines)

    # -- weights ----------------------------------------------------------------------------
    def push_weights(
        self,
        buckets: Iterable[WeightBucket],
        kv_on_push: str | None = None,
        between: Callable[[], None] | None = None,
    ) -> PushStats:
        """Load HF-named full tensors into every engine (in flight: requests are kept) and
        advance the policy version. Returns when every engine runs the new weights.

        ``buckets``: e.g. ``iter_hf_weights(model, config.weight_bucket_bytes)``; each is
        packed once and sent to all engines at the same time (:mod:`.pusher`), which go on
        generating until it arrives. ``kv_on_push``: "keep" or "recompute" (RolloutConfig).
        ``between``: called on this thread after each bucket and whenever the push waits,
        e.g. the rollout source's ``feed``: it may ``poll`` and ``submit`` (an engine takes
        requests sent during a push after its load, or before it if it has not begun
        loading). Until this returns, ``version`` is the old one: requests submitted
        meanwhile are recorded as of the old version, a lower bound of their versions.
        """
        self._check_open()
        kv_on_push = kv_on_push or self.config.kv_on_push
        if kv_on_push not in ("keep", "recompute"):
            raise ValueError(f"kv_on_push must be 'keep' or 'recompute', got {kv_on_push!r}")
        targets = [e for e in self._engines.engines if e.ready]  # restarted: once they are up
        return self._push(self.version + 1, buckets, targets, kv_on_push, between)

    def reweigh(self, buckets: Iterable[WeightBucket]) -> PushStats:
        """Load the current weights (``buckets``: the trainer's, as for :meth:`push_weights`)
        into the restarted engines that wait for them (:meth:`needs_weights`), which then
        take requests; the version does not change. Every bucket is consumed (the stream is
        collective on the trainer's ranks) even when no engine waits any more."""
        self._check_open()
        targets = [e for e in self._engines.engines if e.ready and not e.current]
        return self._push(self.version, buckets, targets, "keep")

    def _push(
        self,
        version: int,
        buckets: Iterable[WeightBucket],
        targets: list[EngineRecord],
        kv_on_push: str,
        between: Callable[[], None] | None = None,
    ) -> PushStats:
        """Load ``buckets`` into ``targets`` as policy ``version``. An engine that dies
        meanwhile is restarted (it gets the weights later) and drops out of the push."""
        done = self._pusher.push(version, buckets, targets, kv_on_push, between or (lambda: None))
        self.version = version
        for engine in targets:
            if engine.index in done.acks and self._engines.is_current(engine):
                engine.current = True
        self._scheduler.resubmit()
        return done.stats

    # -- the engines' events (the supervisor's handler) -----------------------------------
    def _pump(self, timeout: float) -> None:
        """Handle the queued events, first waiting up to ``timeout`` s for one."""
        watchdog.beat("waiting on the generator pool")  # a trainer rank's progress
        self._supervised(self._engines.pump, timeout)

    def _supervised(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` of the supervisor: what it raises (an engine failed, died for good,
        sent what the pool does not know) closes the pool first."""
        try:
            fn(*args)
        except Exception:
            self.close()
            raise

    def _on_event(self, event: Event) -> None:
        if isinstance(event, SamplesDone):
            self._engines.engines[event.engine].oldest = event.oldest
            self._requests.returned(event.engine, event.samples)
        elif isinstance(event, ToolWaits):
            self._requests.tool_waits(event.engine, event.waiting)
        elif isinstance(event, Pushed):
            self._engines.engines[event.engine].oldest = event.oldest
            self._pusher.acked(event)
        elif isinstance(event, StatusReport):
            self._requests.reported(event.engine, event.status)
        elif isinstance(event, TransportJoined):
            self._pusher.joined.add(event.engine)
        elif not isinstance(event, Stopped):
            raise unknown_message(event, "generator pool")

    def _on_death(self, engine: EngineRecord, devices: str) -> None:
        phase = self._pusher.phase
        if phase.group_busy and self._pusher.is_member(engine):
            raise RuntimeError(
                broken_group_message(
                    engine.index, self.config, devices, phase.value, engine.handle.log_path
                )
            )

    def _on_restart(self, old: EngineRecord, new: EngineRecord, why: str) -> None:
        new.current = self._pusher.weights is Weights.HF_DIR
        specs = self._requests.withdraw(old.index)
        logger.warning(
            "vLLM engine %d %s: restarted (%d time(s) in the last %g min); %d request(s) "
            "resubmitted",
            old.index,
            why,
            self._engines.recent_restarts(old.index),
            self.config.engine_restart_window_minutes,
            len(specs),
        )
        self._scheduler.resubmit()

    # -- checks and shutdown ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the generator pool is closed")
        if self._state is PoolState.STARTING:
            self._wait_ready()

    def close(self) -> None:
        """Stop the engines (requests in flight are dropped). Idempotent."""
        if self.closed:
            return
        self._state = PoolState.CLOSED
        pushing = self._pusher.phase.pushing

        def end_push(handle: EngineHandle) -> None:
            try:  # an engine that failed in a push waits for its end
                handle.put_weights(None, timeout=1.0)
            except (ValueError, OSError, queue.Full):  # closed, or the engine takes none
                pass

        self._engines.close(_STOP_SECONDS, end_push if pushing else None)
        self._requests.drop_held()
        self._pusher.close()  # e.g. the NCCL group's sender end
        self._engines.close_launcher()  # event pipes, engine logs

    def __enter__(self) -> GeneratorPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
