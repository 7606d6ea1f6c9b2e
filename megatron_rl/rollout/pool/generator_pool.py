"""The generator pool: N vLLM engines, requests spread over them, in-flight weight pushes.

Typical use (PipelineRL)::

    pool = GeneratorPool(hf_dir, RolloutConfig(...), encode=tokenizer_encode)
    pool.submit(prompts)                       # generation starts, in the background
    samples = pool.poll(timeout=1.0)           # finished samples, as they come
    pool.push_weights(iter_hf_weights(model))  # engines keep their requests in flight
    pool.close()

``generate(prompts)`` is the blocking form. The pool is driven from one thread; the engines
run on their own threads (``placement: in_process``), processes (``subprocess``) or tasks
that connect over TCP (``remote``, see :mod:`megatron_rl.rollout.pool.remote`); all of them run
:func:`megatron_rl.rollout.engine.runner.run_engine`, and the pool reaches each through an
:class:`~megatron_rl.rollout.pool.launchers.EngineHandle` (commands and events:
:mod:`megatron_rl.rollout.messages`; weights: the transport's
:class:`~megatron_rl.rollout.weights.buckets.WeightSender`, chosen once: :mod:`megatron_rl.rollout.weights.senders`).

Elastic engines (``subprocess``): the pool knows every request it handed to each engine
(its :class:`RequestSpec`, with its seed). An engine process that dies is restarted on its
devices (within ``rollout.engine_max_restarts``, :mod:`.restarts`); its events up to its
last complete message are handled, and the requests it had not returned go to the engines
that run the current weights (or wait for one: ``_pending``), exactly as submitted. An engine
process that is alive but stalled for ``rollout.engine_stall_timeout`` (no beat from it, or
one engine step that long: a SIGSTOP, a frozen worker) is killed and handled the same way. A
restarted engine takes requests once it runs the current policy version: at the next
``push_weights``, or earlier by ``reweigh`` (the trainer re-sends its weights to that engine
only; the pool keeps no copy of them). Every token thus still carries a known version.

A group transport (``nccl``: ``Transport.joins_at_build`` false) has fixed members, and a
dead rank would block every later broadcast. Its group is therefore formed of exactly the
engines a push goes to: when they differ from the members (an engine died, or a restarted
one is ready), the pool closes its sender end and forms the group anew first (each member
leaves its old group; :meth:`_form`). After a death that is twice: of the survivors at the
next push, then with the restarted engine once it is up (``reweigh``: of it alone). A death
while a group push is under way (its broadcasts, until every target has loaded) cannot be
survived: the peers' workers wait in a collective that vLLM 0.32's PyNccl cannot abort; the
run fails with a message that says so.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.conversion.weight_stream import WeightBucket
from megatron_rl.platform import watchdog
from megatron_rl.rollout.client import WeightsNeeded
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine.interruption import InterruptionPolicy
from megatron_rl.rollout.engine.runner import engine_devices
from megatron_rl.rollout.load import InFlightClock
from megatron_rl.rollout.messages import (
    EVENTS,
    Alive,
    AskStatus,
    Event,
    Failed,
    Push,
    Pushed,
    Ready,
    RequestSpec,
    RunnerSettings,
    SamplesDone,
    StatusReport,
    Stop,
    Stopped,
    Submit,
    TransportJoined,
    unknown_message,
)
from megatron_rl.rollout.pool.fanout import Fanout
from megatron_rl.rollout.pool.launchers import EngineHandle, engine_launcher
from megatron_rl.rollout.pool.restarts import (
    RestartBudget,
    broken_group_message,
    refusal_message,
)
from megatron_rl.rollout.samples import PushStats, Sample
from megatron_rl.rollout.weights.buckets import WeightSender
from megatron_rl.rollout.weights.senders import transport_for

logger = logging.getLogger(__name__)

_POLL_SECONDS = 1.0
_STOP_SECONDS = 30.0  # engines that have not stopped by then are terminated


@dataclass
class _Engine:
    """The pool's bookkeeping of one engine, around its handle (replaced on a restart)."""

    index: int
    handle: EngineHandle
    oldest: int | None = None  # oldest version in flight, as last reported
    max_model_len: int = 0
    ready: bool = False  # built, answering commands
    current: bool = True  # runs the pool's policy version: may take requests
    # (prompt index, sample index) -> the request, submitted and not yet returned
    specs: dict[tuple[int, int], RequestSpec] = field(default_factory=dict)
    # its beats (``Alive``): the last event's time, the length of its step under way then
    beating: bool = False
    last_seen: float = 0.0
    step_seconds: float = 0.0

    @property
    def outstanding(self) -> int:
        return len(self.specs)


class GeneratorPool:
    """N vLLM engines behind one interface (see the module docstring).

    ``hf_dir``: the HF model directory the engines start from (config + initial weights).
    ``encode``: text -> token ids without special tokens; needed for interruptions
    (the interruption text and the think-close marker). Without it, and with interruptions
    enabled, the HF tokenizer in ``hf_dir`` is used. ``wait=False`` returns while the engines
    start (the first call that needs them waits), so that the caller can work meanwhile.
    """

    def __init__(
        self,
        hf_dir: str,
        config: RolloutConfig,
        encode: Callable[[str], list[int]] | None = None,
        wait: bool = True,
        initial_version: int = 0,
    ) -> None:
        config.validate()
        config = config.resolved()  # weight_transport "auto": decided once, here
        self.config = config
        self._transport = transport_for(config)
        self.hf_dir = str(hf_dir)
        # A resumed trainer continues its numbering: the next push is initial_version + 1.
        self.version = initial_version
        self._hf = _text_config(self.hf_dir)
        self.policy = None
        if config.interruption.enabled:
            self.policy = InterruptionPolicy.from_config(
                config.interruption, encode or _hf_encoder(self.hf_dir)
            )
        self._next_prompt = 0
        self._done: list[Sample] = []
        self._acks: dict[int, list[Pushed]] = {}
        self._status: dict[int, dict[str, Any]] = {}
        self._finished_tokens: dict[int, int] = {}  # engine -> response tokens returned
        self._closed = False
        self._sender: WeightSender | None = None  # the trainer end of weight_transport
        self._transport_acks: set[int] = set()
        self._members: list[_Engine] | None = None  # of the sender's group; None: not formed
        self._group_busy: str | None = None  # what a group transport is doing (no death then)
        self._pushing = False  # between a push's Push commands and its end
        self._pending: list[RequestSpec] = []  # requests of a dead engine, waiting for one
        self._pushed = False  # a push happened: the HF directory's weights are not current
        window = config.engine_restart_window_minutes * 60
        self._restarts = RestartBudget(config.engine_max_restarts, window)
        self._launcher = engine_launcher(self.hf_dir, config, self._settings())
        self._events = self._launcher.events
        # per engine: requests in flight over time, as the pool sees them (engine_idle_fractions)
        self._busy = [InFlightClock() for _ in range(config.engines)]
        self._engines = self._start_engines()
        if wait:
            self._wait_ready()

    # -- set-up -----------------------------------------------------------------------------
    def _settings(self) -> RunnerSettings:
        stop = self.config.stop_token_ids
        if stop is None:
            eos = getattr(self._hf, "eos_token_id", None)
            stop = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if self.policy is None:
            return RunnerSettings(tuple(stop))
        return RunnerSettings(
            tuple(stop), self.policy.text_ids, self.policy.close_ids, self.policy.answer_budget
        )

    def _start_engines(self) -> list[_Engine]:
        from megatron_rl.platform import get_platform
        from megatron_rl.rollout.engine.vllm_engine import cpu_worker_binding

        config = self.config
        if not get_platform().is_gpu and config.gpu_ids:
            raise ValueError("rollout.gpu_ids need GPUs; this machine has none")
        if not get_platform().is_gpu and config.placement != "remote":
            cpu_worker_binding(config.tensor_parallel)  # a CPU core per engine worker
        return [_Engine(h.index, h) for h in self._launcher.start(config.engines)]

    def _wait_ready(self) -> None:
        if self._members is not None:
            return
        while not all(e.ready for e in self._engines):
            self._handle(self._next_event())
        logger.info(
            "generator pool: %d engine(s) ready (%s, weight transport %s)",
            len(self._engines),
            self.config.placement,
            self.config.weight_transport,
        )
        self._form(list(self._engines))

    def _form(self, members: list[_Engine]) -> None:
        """Open the transport's sender end for ``members`` (the engines of a group transport
        join it now: the previous group, if any, is closed and each member leaves it)."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        self._members, self._transport_acks = members, set()
        if members:
            self._group_busy = "forming the weight-transfer group"
            try:
                self._sender = self._transport.open(
                    self.config, self._hf, [e.handle for e in members], self._wait_joined
                )
            finally:
                self._group_busy = None
            logger.debug("weight transport: formed of engines %s", [e.index for e in members])

    def _wait_joined(self, connect: Callable[[], None] | None = None) -> None:
        """Run ``connect`` (the sender's side of the group's rendezvous) while watching the
        engines, then wait until every member has joined (``TransportJoined``). A member
        that dies meanwhile fails the run (``_replace``); no progress within
        ``rollout.push_timeout_seconds`` raises."""
        deadline = time.monotonic() + self.config.push_timeout_seconds
        what = "the engines joining the weight-transfer group"
        if connect is not None:
            self._watched(connect, deadline, what)
        while not {e.index for e in self._members} <= self._transport_acks:
            self._pump(_POLL_SECONDS)
            self._check_deadline(deadline, what)

    # -- generation -------------------------------------------------------------------------
    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        samples_per_prompt: int | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[int]:
        """Queue ``samples_per_prompt`` samples of every prompt (token ids); returns the
        prompts' indices (``Sample.prompt_index``). Settings default to the config's;
        ``temperature=0`` samples greedily (evaluation). ``seeds`` (one per prompt) make the
        samples (and their thinking budgets) reproducible: sample j of a prompt with seed s
        uses the seeds derived from (s, j), whichever engine runs it and whatever else runs."""
        self._check_open()
        n = samples_per_prompt or self.config.samples_per_prompt
        max_tokens = max_tokens or self.config.max_tokens
        temperature = self.config.temperature if temperature is None else temperature
        top_p = self.config.top_p if top_p is None else top_p
        if n < 1 or max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(
                f"invalid sampling settings: samples_per_prompt={n} max_tokens={max_tokens} "
                f"temperature={temperature} top_p={top_p}"
            )
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        indices = []
        for p, prompt in enumerate(prompts):
            ids = self._check_prompt(prompt)
            index = self._next_prompt
            self._next_prompt += 1
            sample_seeds = (
                [None] * n if seeds is None else [_sample_seed(seeds[p], j) for j in range(n)]
            )
            specs = [
                RequestSpec(index, j, ids, max_tokens, temperature, top_p, self._budget(seed), seed)
                for j, seed in enumerate(sample_seeds)
            ]
            self._assign(specs)
            indices.append(index)
        return indices

    def _assign(self, specs: list[RequestSpec]) -> None:
        """Hand one prompt's requests to the least loaded engine that runs the current
        weights; without one they wait in ``_pending`` (see :meth:`_dispatch_pending`)."""
        usable = [e for e in self._engines if e.current]
        if not usable:
            self._pending.extend(specs)
            return
        engine = min(usable, key=lambda e: e.outstanding)
        engine.handle.send(Submit(tuple(specs)))
        engine.specs.update(((s.prompt_index, s.sample_index), s) for s in specs)
        self._busy[engine.index].observe(engine.outstanding)
        if engine.oldest is None:
            engine.oldest = self.version

    def _dispatch_pending(self) -> None:
        """Resubmit the waiting requests, a prompt's samples together, in their order."""
        pending, self._pending = self._pending, []
        by_prompt: dict[int, list[RequestSpec]] = {}
        for spec in pending:
            by_prompt.setdefault(spec.prompt_index, []).append(spec)
        for specs in by_prompt.values():
            self._assign(specs)

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Finished samples not returned yet, waiting up to ``timeout`` s for the first."""
        deadline = time.monotonic() + timeout
        while not self._done and self.in_flight:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._pump(min(remaining, _POLL_SECONDS))
        self._pump(0.0)
        done, self._done = self._done, []
        return done

    def generate(self, prompts: Sequence[Sequence[int]], **settings: Any) -> list[Sample]:
        """Generate and wait: the samples of ``prompts`` ordered by (prompt, sample). Raises
        ``WeightsNeeded`` (withdrawing its requests) when every engine waits for weights."""
        indices = set(self.submit(prompts, **settings))
        mine: list[Sample] = []
        expected = len(indices) * (
            settings.get("samples_per_prompt") or self.config.samples_per_prompt
        )
        while len(mine) < expected:
            self._pump(_POLL_SECONDS)
            if self.needs_weights() and not any(e.current for e in self._engines):
                # No engine holds any of our requests now: withdraw them all, so that the
                # caller can reweigh and call again (same seeds: the same samples).
                self._pending = [s for s in self._pending if s.prompt_index not in indices]
                self._done = [s for s in self._done if s.prompt_index not in indices]
                raise WeightsNeeded(
                    "generate(): every engine was restarted and waits for the current weights "
                    "(GeneratorPool.reweigh); this call's requests were withdrawn"
                )
            keep = []
            for sample in self._done:
                (mine if sample.prompt_index in indices else keep).append(sample)
            self._done = keep
        return sorted(mine, key=lambda s: (s.prompt_index, s.sample_index))

    @property
    def in_flight(self) -> int:
        """Samples submitted and not yet finished."""
        return sum(e.outstanding for e in self._engines) + len(self._pending)

    def oldest_version_in_flight(self) -> int | None:
        """The oldest policy version that produced a token still in flight (a lower bound:
        engines report it whenever samples finish or weights load); None when idle."""
        self._pump(0.0)
        versions = [e.oldest for e in self._engines if e.outstanding and e.oldest is not None]
        return min(versions, default=None)

    def reset_engine_load(self) -> None:
        """Start a new window for :meth:`engine_idle_fractions`."""
        for clock, engine in zip(self._busy, self._engines):
            clock.reset(engine.outstanding)

    def engine_idle_fractions(self) -> list[float]:
        """Per engine, the fraction of the time since :meth:`reset_engine_load` (or the
        start) that it had no request of the pool in flight. As the pool sees it: requests
        count from their submission until their samples are handled (any pool call), so an
        engine that finished a request counts as busy until the pool's next call."""
        fractions = []
        for clock, engine in zip(self._busy, self._engines):
            clock.observe(engine.outstanding)
            fractions.append(clock.averages()[1])
        return fractions

    def engine_status(self) -> list[dict[str, Any]]:
        """Each engine's state, asked now (answered between two engine steps): policy
        ``version``, ``requests`` / ``tokens`` in flight, ``oldest_version`` in flight."""
        self._check_open()
        self._status = {}
        asked = [e for e in self._engines if e.ready]
        for engine in asked:
            engine.handle.send(AskStatus())
        # an engine that dies meanwhile (restarted: another object) answers no more
        while any(e.index not in self._status and self._engines[e.index] is e for e in asked):
            self._pump(_POLL_SECONDS)
        idle = {"version": None, "requests": 0, "tokens": 0, "oldest_version": None}
        return [
            self._status.get(e.index)
            or {**idle, "finished_tokens": self._finished_tokens.get(e.index, 0)}
            for e in self._engines
        ]

    def generated_tokens(self) -> int:
        """Response tokens generated so far by every request, finished or in flight (asks the
        engines, like ``engine_status``). The difference of two calls is the decoding work
        done in between (the compute clock splits a validation window by it)."""
        return sum(s["tokens"] + s["finished_tokens"] for s in self.engine_status())

    def needs_weights(self) -> bool:
        """Whether a restarted engine is ready and waits for the current weights
        (:meth:`reweigh`)."""
        return any(e.ready and not e.current for e in self._engines)

    @property
    def restarts(self) -> int:
        """Engine restarts so far (all engines)."""
        return self._restarts.total

    @property
    def staleness(self) -> int:
        """How many versions the newest weights are ahead of the oldest sample in flight."""
        oldest = self.oldest_version_in_flight()
        return 0 if oldest is None else self.version - oldest

    # -- weights ----------------------------------------------------------------------------
    def push_weights(
        self,
        buckets: Iterable[WeightBucket],
        kv_on_push: str | None = None,
        between: Callable[[], None] | None = None,
    ) -> PushStats:
        """Load HF-named full tensors into every engine (in flight: requests are kept) and
        advance the policy version. Returns when every engine runs the new weights.

        ``buckets``: e.g. ``iter_hf_weights(model, config.weight_bucket_bytes)``. Each bucket
        is packed once and sent to all engines at the same time (:mod:`.fanout`); engines
        go on generating until it arrives. A few buckets are held at a time (two per
        engine queue, one per sending lane). ``kv_on_push``: "keep" or "recompute" (see
        RolloutConfig); default: the config's.

        ``between``: called on this thread after each bucket and whenever the push waits (for
        a lane, a broadcast, the engines' loads), e.g. the rollout source's ``feed``: it may
        ``poll`` and ``submit`` (commands and weights travel apart; an engine takes requests
        sent during a push after its load, or before it if it has not begun loading). Until
        this returns, ``version`` is the old one: requests submitted meanwhile are recorded
        as of the old version, a lower bound of the versions that generate them.
        """
        self._check_open()
        kv_on_push = kv_on_push or self.config.kv_on_push
        if kv_on_push not in ("keep", "recompute"):
            raise ValueError(f"kv_on_push must be 'keep' or 'recompute', got {kv_on_push!r}")
        targets = [e for e in self._engines if e.ready]  # restarted ones: once they are up
        return self._push(self.version + 1, buckets, targets, kv_on_push, between)

    def reweigh(self, buckets: Iterable[WeightBucket]) -> PushStats:
        """Load the current weights (``buckets``: the trainer's, as for :meth:`push_weights`)
        into the restarted engines that wait for them (:meth:`needs_weights`), which then
        take requests; the version does not change. Every bucket is consumed (the stream is
        collective on the trainer's ranks) even when no engine waits any more."""
        self._check_open()
        targets = [e for e in self._engines if e.ready and not e.current]
        return self._push(self.version, buckets, targets, "keep")

    def _push(
        self,
        version: int,
        buckets: Iterable[WeightBucket],
        targets: list[_Engine],
        kv_on_push: str,
        between: Callable[[], None] | None = None,
    ) -> PushStats:
        """Load ``buckets`` into ``targets`` as policy ``version``. An engine that dies
        meanwhile is restarted (it gets the weights later) and drops out of the push.
        ``between``: see :meth:`push_weights`."""
        start = time.perf_counter()
        # Refused before any engine is told: one told of an empty push would run the next
        # version, ahead of the pool, and tag its tokens with it.
        buckets = iter(buckets)
        first = next(buckets, None)
        if first is None:
            raise ValueError("push_weights got no buckets: this rank is not the stream's sender")
        buckets = itertools.chain([first], buckets)
        group = not self._transport.joins_at_build
        if group and [id(e) for e in targets] != [id(e) for e in self._members]:
            self._form(targets)  # a death, or a restarted engine: the group is the targets
        between = between or (lambda: None)
        # No engine may keep the trainer waiting forever: one that failed raises at once (its
        # event), one that died is restarted or raises, one that hangs when the deadline passes.
        deadline = time.monotonic() + self.config.push_timeout_seconds
        self._acks = {}
        self._pushed = True  # an engine restarted from now on needs weights from the trainer
        for engine in targets:
            engine.handle.send(Push(version, kv_on_push))
        if group and targets:
            self._group_busy = "a weight push over the group"
        self._pushing = True
        try:
            return self._send_buckets(version, buckets, targets, deadline, between, start)
        finally:
            self._group_busy, self._pushing = None, False

    def _send_buckets(
        self,
        version: int,
        buckets: Iterable[WeightBucket],
        targets: list[_Engine],
        deadline: float,
        between: Callable[[], None],
        start: float,
    ) -> PushStats:
        """The part of :meth:`_push` after the ``Push`` commands: the buckets, the acks."""
        sender = self._sender

        def wait(index: int) -> None:
            self._pump(0.0)  # raises if an engine failed, or died past its restarts
            if not self._same(targets, index):
                lanes.drop(index)
            self._check_deadline(deadline, f"engine {index} taking a weight bucket")
            between()

        tensors = nbytes = count = 0
        lanes = Fanout([e.handle for e in targets], wait)  # before any call of wait
        with lanes:
            try:
                for bucket in buckets:
                    if targets:  # with none, consumed all the same (the stream is collective)
                        lanes.put(sender.pack(bucket))
                        if sender.blocking:  # the NCCL broadcast, received by every engine
                            self._watched(
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
                if not self._closed:  # a failed engine closed the pool: nobody to tell
                    lanes.put(None)
                    lanes.finish()
        acks = self._wait_acks(version, targets, deadline, between)
        self.version = version
        for engine in targets:
            if engine.index in acks and self._same(targets, engine.index):
                engine.current = True
        if self._pending:
            self._dispatch_pending()
        return PushStats(
            version=version,
            tensors=tensors,
            bytes=nbytes,
            buckets=count,
            seconds=time.perf_counter() - start,
            load_seconds=max((a.seconds for a in acks.values()), default=0.0),
        )

    def _same(self, targets: list[_Engine], index: int) -> bool:
        """Whether engine ``index`` of ``targets`` is still the same process (not restarted)."""
        return any(e is self._engines[index] for e in targets if e.index == index)

    def _wait_acks(
        self,
        version: int,
        targets: list[_Engine],
        deadline: float,
        between: Callable[[], None] = lambda: None,
    ) -> dict[int, Pushed]:
        """The ``Pushed`` events of ``targets`` by engine index (not of those restarted);
        ``between()`` after each wait."""
        while True:
            acked = {a.engine: a for a in self._acks.get(version, [])}
            waiting = [
                e.index for e in targets if e.index not in acked and self._same(targets, e.index)
            ]
            if not waiting:
                self._acks.pop(version, None)
                return acked
            self._pump(_POLL_SECONDS)
            self._check_deadline(deadline, f"engine(s) {waiting} loading the weights")
            between()

    def _watched(
        self,
        fn: Callable[[], None],
        deadline: float,
        what: str,
        between: Callable[[], None] = lambda: None,
    ) -> None:
        """Run ``fn`` (a blocking collective with the engines) on a helper thread while this
        one watches the engines: an engine error or exit, or the deadline, raises here;
        ``between()`` after each look."""
        failure: list[BaseException] = []

        def target() -> None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                failure.append(err)

        worker = threading.Thread(target=target, name="weight-send", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(_POLL_SECONDS)
            if worker.is_alive():
                self._pump(0.0)  # raises if an engine failed or died
                self._check_deadline(deadline, what)
                between()
        if failure:
            raise RuntimeError(f"weight push: {what} failed") from failure[0]

    def _check_deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            self.close()
            raise TimeoutError(
                f"weight push: no progress from {what} within rollout.push_timeout_seconds "
                f"({self.config.push_timeout_seconds:g} s); the generator pool was closed"
            )

    # -- events -----------------------------------------------------------------------------
    def _next_event(self) -> Event:
        """Block until the next event; raises if an engine failed or died."""
        while True:
            try:
                event = self._events.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                self._check_alive()
                continue
            self._raise_on_error(event)
            return event

    def _pump(self, timeout: float) -> None:
        """Handle the queued events, first waiting up to ``timeout`` s for one."""
        watchdog.beat("waiting on the generator pool")  # a trainer rank's progress
        block = timeout > 0
        while True:
            try:
                event = self._events.get(timeout=timeout) if block else self._events.get_nowait()
            except queue.Empty:
                self._check_alive()
                return
            self._raise_on_error(event)
            self._handle(event)
            block = False

    def _raise_on_error(self, event: Event) -> None:
        if isinstance(event, Failed):
            self.close()
            raise RuntimeError(f"vLLM engine {event.engine} failed:\n{event.traceback}")

    def _handle(self, event: Event) -> None:
        if isinstance(event, EVENTS):  # any event says that its engine runs
            self._engines[event.engine].last_seen = time.monotonic()
        if isinstance(event, Alive):
            engine = self._engines[event.engine]
            engine.beating, engine.step_seconds = True, event.step_seconds
        elif isinstance(event, SamplesDone):
            self._take_samples(event)
        elif isinstance(event, Pushed):
            self._engines[event.engine].oldest = event.oldest
            self._acks.setdefault(event.version, []).append(event)
        elif isinstance(event, StatusReport):
            # the engine's samples sent before it are counted: consistent
            finished = self._finished_tokens.get(event.engine, 0)
            self._status[event.engine] = {**event.status, "finished_tokens": finished}
        elif isinstance(event, Ready):
            engine = self._engines[event.engine]
            engine.max_model_len, engine.ready = event.max_model_len, True
        elif isinstance(event, TransportJoined):
            self._transport_acks.add(event.engine)
        elif not isinstance(event, Stopped):
            self.close()
            raise unknown_message(event, "generator pool")

    def _take_samples(self, event: SamplesDone) -> None:
        index = event.engine
        engine = self._engines[index]
        samples, engine.oldest = [], event.oldest
        for sample in event.samples:
            if engine.specs.pop((sample.prompt_index, sample.sample_index), None) is None:
                # never expected: every request is returned by one engine, once
                logger.warning("engine %d returned a sample it was not given: dropped", index)
                continue
            samples.append(sample)
        self._busy[index].observe(engine.outstanding)
        self._done.extend(samples)
        tokens = sum(len(s) for s in samples)
        self._finished_tokens[index] = self._finished_tokens.get(index, 0) + tokens

    def _check_alive(self) -> None:
        for engine in list(self._engines):
            if self._closed:
                return
            if not engine.handle.is_alive():
                self._replace(engine)
            elif (stall := self._stalled(engine)) is not None:
                logger.error(
                    "vLLM engine %d (pid %s) %s: killed", engine.index, engine.handle.pid, stall
                )
                engine.handle.discard()  # SIGKILL reaches a stopped process too
                self._replace(engine, why=stall)

    def _stalled(self, engine: _Engine) -> str | None:
        """Why ``engine`` counts as stalled (``rollout.engine_stall_timeout``), or None.
        Only engines that beat are judged (processes; from their first beat on)."""
        limit = self.config.engine_stall_timeout
        if not (engine.beating and limit > 0):
            return None
        key = f"rollout.engine_stall_timeout {limit:g} s"
        silent = time.monotonic() - engine.last_seen
        if silent > limit:
            return f"sent nothing for {silent:.0f} s ({key}): stalled"
        if engine.step_seconds > limit:
            return f"has been in one engine step for {engine.step_seconds:.0f} s ({key}): stalled"
        return None

    def _replace(self, engine: _Engine, why: str = "exited unexpectedly") -> None:
        """Engine ``engine`` died (or stalled, ``why``: killed already): handle what it sent,
        restart it (or raise when its restarts are spent, or its placement cannot restart),
        resubmit its requests."""
        config, index = self.config, engine.index
        elastic = self._launcher.restartable
        for event in engine.handle.leftover_events():  # its complete messages, in order
            self._raise_on_error(event)
            self._handle(event)
        devices = engine_devices(config, index)
        devices = "cpu" if devices is None else f"GPUs {devices}"
        if self._group_busy is not None and any(e is engine for e in self._members or ()):
            self.close()
            raise RuntimeError(
                broken_group_message(
                    index, config, devices, self._group_busy, engine.handle.log_path
                )
            )
        if not (elastic and self._restarts.take(index)):
            if elastic:
                message = refusal_message(
                    index, config.placement, devices, self._restarts, engine.handle.log_path, why
                )
            else:  # in-process engines share the trainer's process
                message = (
                    f"vLLM engine {index} exited unexpectedly (placement {config.placement}, "
                    f"devices {devices}; restarts need placement subprocess or remote)"
                )
            self.close()
            raise RuntimeError(message)
        engine.handle.discard()
        specs = list(engine.specs.values())
        new = _Engine(index, self._launcher.restart(index), max_model_len=engine.max_model_len)
        new.current = not self._pushed
        self._engines[index] = new
        self._busy[index].observe(0)
        if why == "exited unexpectedly":
            why += f" (exit code {engine.handle.exitcode})"
        logger.warning(
            "vLLM engine %d %s: restarted (%d time(s) in the last %g min); %d request(s) "
            "resubmitted",
            index,
            why,
            self._restarts.recent(index),
            config.engine_restart_window_minutes,
            len(specs),
        )
        self._pending.extend(specs)
        self._dispatch_pending()

    # -- checks and shutdown ----------------------------------------------------------------
    def _budget(self, seed: int | None = None) -> int | None:
        if self.policy is None:
            return None
        if seed is None:
            return self.policy.draw_budget()
        return random.Random(seed).randint(*self.policy.budget_range)

    def _check_prompt(self, prompt: Sequence[int]) -> tuple[int, ...]:
        ids = tuple(int(t) for t in prompt)
        if not ids:
            raise ValueError("empty prompt")
        vocab = self._hf.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        limit = min(e.max_model_len for e in self._engines)
        if len(ids) >= limit:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len {limit}")
        return ids

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the generator pool is closed")
        self._wait_ready()

    def close(self) -> None:
        """Stop the engines (requests in flight are dropped). Idempotent."""
        engines, self._engines = getattr(self, "_engines", []), []
        self._closed = True
        pushing = getattr(self, "_pushing", False)
        for engine in engines:
            try:
                if pushing:  # end the push: an engine that failed in it waits for its end
                    engine.handle.put_weights(None, timeout=1.0)
            except (ValueError, OSError, queue.Full):  # closed, or the engine takes none
                pass
            try:
                engine.handle.send(Stop())
            except (ValueError, OSError):  # queue or connection already closed
                pass
        deadline = time.monotonic() + _STOP_SECONDS
        for engine in engines:
            while engine.handle.is_alive() and time.monotonic() < deadline:
                engine.handle.join(timeout=_POLL_SECONDS / 4)
                self._discard_events()  # an engine process flushes its events as it stops
            if engine.handle.is_alive():
                engine.handle.terminate()
        if getattr(self, "_sender", None) is not None:  # e.g. the NCCL group's sender end
            self._sender.close()
            self._sender = None
        if getattr(self, "_launcher", None) is not None:
            self._launcher.close()  # event pipes, engine logs

    def _discard_events(self) -> None:
        events = getattr(self, "_events", None)
        try:
            while events is not None:
                events.get_nowait()
        except (queue.Empty, OSError, ValueError):  # none left, or the queue is closed
            pass

    def __enter__(self) -> GeneratorPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _text_config(hf_dir: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    return getattr(config, "text_config", config)


def _hf_encoder(hf_dir: str) -> Callable[[str], list[int]]:
    from pathlib import Path

    if not any(Path(hf_dir).glob("tokenizer*")):
        raise ValueError(
            "rollout.interruption needs a tokenizer: pass encode= or put one in the model dir"
        )
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _sample_seed(prompt_seed: int, sample_index: int) -> int:
    """Seed of sample ``sample_index`` of a prompt seeded ``prompt_seed`` (63-bit)."""
    return (int(prompt_seed) * 1_000_003 + sample_index * 7_919 + 1) % (2**63 - 1)
