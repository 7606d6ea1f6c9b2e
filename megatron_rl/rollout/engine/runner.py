"""The loop that owns one engine: requests, interruptions, policy versions, weight loads.

An :class:`EngineRunner` steps its :class:`~megatron_rl.rollout.engine.VLLMEngine` and, between
two steps, handles commands from the pool: new requests, or a weight push (the engine goes on
generating until the push's first bucket arrives, then loads the buckets while its requests
in flight wait in vLLM's scheduler, then generation goes on with the new weights). Every token is tagged with the version of the weights that produced
it. It runs on a thread of the trainer's process or as the main loop of an engine process;
both talk to the pool through queues:

- ``commands``: the commands of :mod:`megatron_rl.rollout.messages` (``Submit``, ``Cancel``,
  ``Push``, ``AskStatus``, ``JoinTransport``, ``Stop``);
- ``weights``: a push's bucket update infos, then ``None`` (``get`` takes ``block=False``);
- ``events``: the events of :mod:`megatron_rl.rollout.messages` (``Ready``, ``SamplesDone``,
  ``ToolWaits``, ``Pushed``, ``StatusReport``, ``TransportJoined``, ``Failed``, ``Stopped``, and ``Alive``
  from a thread of an engine process: ``rollout.engine_stall_timeout``); one queue
  shared by in-process and remote engines, a pipe of its own for an engine process
  (:mod:`megatron_rl.rollout.wire`).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rl.platform.config import LAUNCHER_VARS
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine.interruption import find_subsequence
from megatron_rl.rollout.engine.nccl_env import drop_trainer_only_vars
from megatron_rl.rollout.messages import (
    Alive,
    AskStatus,
    Cancel,
    Failed,
    JoinTransport,
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
    ToolWaits,
    TransportJoined,
    unknown_message,
)
from megatron_rl.rollout.samples import Sample

logger = logging.getLogger(__name__)

_NOTHING = object()  # no weights item waiting
_TOOL_POLL_S = 0.01  # how long an engine with nothing to generate waits on a tool at a time


class EpisodeSteps(Protocol):
    """Multi-turn episodes (issue 38), as an engine runner drives them, token-in / token-out.

    A request is an episode when its spec carries a ``problem``. ``stop_token_ids`` and
    ``stop_strings``: the tool-call format's stops (added to every episode request's; a stop
    string is kept in the output and vLLM cuts the ids after the token that completes it);
    ``max_turns``: model turns per episode. ``tool_step(spec, sample, turn_ids)``: the model
    turn that just ended on one of those stops (``turn_ids``: exactly the ids the engine
    produced); None ends the episode (no call: a final answer), else a future (a
    ``ToolExecutor`` thread: the engine keeps serving other requests meanwhile) of the
    observation's ids, tokenized once (None: the environment ended the episode).
    ``end(spec)``: the episode is over; its tool calls as ``(outcome, seconds)``.
    """

    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    max_turns: int

    def tool_step(
        self, spec: RequestSpec, sample: Sample, turn_ids: list[int]
    ) -> Future[list[int] | None] | None: ...

    def end(self, spec: RequestSpec) -> list[tuple[str, float]]: ...


@dataclass
class _Track:
    spec: RequestSpec
    sample: Sample
    phase: str = "think"  # "think" -> ("answer" after an interruption)
    closed: bool = False  # the think-close marker appeared within the budget
    request_id: str = ""
    turns: int = 1  # model turns so far (multi-turn episodes)
    turn_start: int = 0  # where the current model turn starts in the response
    salt: str = ""  # the prefix-cache salt of its first request (see EngineRunner._salt)


class EngineRunner:
    """Requests and versions of one engine (see the module docstring)."""

    def __init__(
        self,
        index: int,
        engine,
        settings: RunnerSettings,
        events,
        episodes: EpisodeSteps | None = None,
    ) -> None:
        self.index = index
        self.engine = engine
        self.settings = settings
        self.events = events
        self.episodes = episodes
        self._tools: dict[Future, _Track] = {}  # episodes waiting on a tool call
        self._tool_waits_sent = 0  # len(_tools) as the pool last heard it (ToolWaits)
        self.version = 0
        self.kv_on_push = "keep"  # of the last push: whether KV of older weights is kept
        self.requests: dict[str, _Track] = {}
        self._finished: list[Sample] = []
        self._seq = 0
        self.stepping_since: float | None = None  # monotonic start of the step under way

    # -- commands ---------------------------------------------------------------------------
    def serve(self, commands, weights_get: Callable[..., Any]) -> None:
        """Handle commands between engine steps until ``Stop``.

        A push does not pause generation when it is announced: the engine goes on stepping
        until the push's first bucket is in its weights queue (``weights_get(block=False)``
        finds it), and only then loads (see :meth:`push`)."""
        pending: tuple[int, str] | None = None  # (version, kv_on_push) of an announced push
        while True:
            idle = not self.engine.has_work() and not self._tools
            for command in _commands(commands, block=idle and pending is None):
                if isinstance(command, Stop):
                    return
                if isinstance(command, Submit):
                    for spec in command.specs:
                        self.submit(spec)
                elif isinstance(command, Cancel):
                    self.cancel(set(command.prompts))
                elif isinstance(command, Push):
                    pending = (command.version, command.kv_on_push)
                elif isinstance(command, AskStatus):
                    self.events.put(StatusReport(self.index, self.status()))
                elif isinstance(command, JoinTransport):  # join the NCCL weight-transfer group
                    self.engine.init_transport(command.init_info)
                    self.events.put(TransportJoined(self.index))
                else:
                    raise unknown_message(command, f"engine {self.index}")
            if pending is not None:
                # idle: wait for the first bucket; busy: take it only if it is there
                first = _next_bucket(weights_get, block=not self.engine.has_work())
                if first is not _NOTHING:
                    self.push(*pending, weights_get, first=first)
                    pending = None
            self.step()

    def step(self) -> None:
        """One engine step (if there is work); finished samples go out as an event. Tool
        calls that have returned continue their episodes first."""
        if self._tools:
            if not self.engine.has_work():  # nothing else to do: wait a little for a tool
                wait(list(self._tools), timeout=_TOOL_POLL_S, return_when=FIRST_COMPLETED)
            self._continue_episodes()
        if self.engine.has_work():
            self.stepping_since = time.monotonic()
            try:
                deltas = self.engine.step()
            finally:
                self.stepping_since = None
            for delta in deltas:
                track = self.requests.get(delta.request_id)
                if track is not None:
                    self._advance(track, delta)
        self._flush()

    def oldest_version(self) -> int | None:
        """The oldest policy version among the samples in flight (None if there are none)."""
        versions = [
            self.version if t.sample.oldest_version is None else t.sample.oldest_version
            for t in self._in_flight()
        ]
        return min(versions, default=None)

    def _in_flight(self) -> list[_Track]:
        """The samples in flight: generating, or an episode waiting on its tool call."""
        return [*self.requests.values(), *self._tools.values()]

    def status(self) -> dict[str, Any]:
        """Version, requests and tokens in flight, oldest version in flight."""
        return {
            "version": self.version,
            "requests": len(self.requests) + len(self._tools),
            "tokens": sum(len(t.sample) for t in self._in_flight()),
            "oldest_version": self.oldest_version(),
        }

    def push(
        self,
        version: int,
        kv_on_push: str,
        weights_get: Callable[[], Any],
        first: Any = _NOTHING,
    ) -> None:
        """Load the buckets that ``weights_get`` returns (until None), after ``first`` if it
        was taken already, then run ``version``. Generation is paused meanwhile: vLLM's
        layerwise reload keeps layers on the meta device until the last bucket is in; the
        ``pushed`` event reports this pause."""
        start = time.perf_counter()
        ended = []  # the push's end (None) was taken from the queue

        def updates() -> Iterator[Any]:
            item = weights_get() if first is _NOTHING else first
            while item is not None:
                yield item
                item = weights_get()
            ended.append(True)

        try:
            tensors, nbytes = self.engine.load_weights(updates(), kv_on_push)
        except BaseException:
            # Report first: the pusher may be blocked until every engine has taken the bucket
            # (an NCCL broadcast), and then never sends the end of the push we would wait for.
            self.events.put(Failed(self.index, traceback.format_exc()))
            for _ in () if ended else _until_none(weights_get):  # let the pusher finish
                pass
            raise
        self.version = version
        self.kv_on_push = kv_on_push
        seconds = time.perf_counter() - start
        self.events.put(
            Pushed(self.index, version, seconds, tensors, nbytes, self.oldest_version())
        )

    # -- requests ---------------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> None:
        """Start generating one sample."""
        sample = Sample(
            spec.prompt_index,
            spec.sample_index,
            list(spec.prompt_ids),
            thinking_budget=spec.budget,
            engine=self.index,
        )
        self._start(_Track(spec, sample), list(spec.prompt_ids), spec.max_tokens)

    def cancel(self, prompts: set[int]) -> None:
        """Drop every request of ``prompts``: aborted in the engine, an episode waiting on
        its tool call forgotten (a call under way ends in its thread, within the sandbox's
        limits; its result is not used), a finished sample not sent yet dropped."""
        ids = [rid for rid, track in self.requests.items() if track.spec.prompt_index in prompts]
        if ids:
            self.engine.abort(ids)
        dropped = [self.requests.pop(rid) for rid in ids]
        for future, track in list(self._tools.items()):
            if track.spec.prompt_index in prompts:
                del self._tools[future]
                future.cancel()
                dropped.append(track)
        for track in dropped:
            if self._episode(track):  # its environment is let go
                self.episodes.end(track.spec)
        self._finished = [s for s in self._finished if s.prompt_index not in prompts]

    def _start(self, track: _Track, prompt_ids: list[int], max_tokens: int) -> None:
        max_tokens = min(max_tokens, self.engine.max_model_len - len(prompt_ids))
        if max_tokens < 1:
            self._finish(track, "length")
            return
        self._seq += 1
        track.request_id = f"e{self.index}-{self._seq}"
        self.requests[track.request_id] = track
        stop = list(self.settings.stop_token_ids)
        stop_strings: tuple[str, ...] = ()
        if self._episode(track):
            stop += [i for i in self.episodes.stop_token_ids if i not in stop]
            stop_strings = self.episodes.stop_strings
        seed = track.spec.seed
        if seed is not None:
            # the answer phase after an interruption, and every later turn of an episode,
            # is a new request: a different stream
            seed += (track.phase != "think") + 2 * (track.turns - 1)
        self.engine.add(
            track.request_id,
            prompt_ids,
            max_tokens,
            track.spec.temperature,
            track.spec.top_p,
            stop,
            cache_salt=self._salt(track),
            seed=seed,
            **({"stop_strings": stop_strings} if stop_strings else {}),
        )

    def _salt(self, track: _Track) -> str:
        """The request's prefix-cache salt: blocks are shared only among requests of one
        policy version. An episode's later turn keeps its first request's salt while pushes
        keep the KV of older weights (``kv_on_push: keep``, PipelineRL): it then continues
        from its own cached context as an unfinished request would, where a new salt would
        prefill the whole context again at every turn after a push (its tokens are exactly
        the cached ones; only the new ones are computed by the current weights)."""
        if not track.salt or self.kv_on_push != "keep":
            track.salt = f"v{self.version}"
        return track.salt

    def _episode(self, track: _Track) -> bool:
        """Whether ``track`` is a multi-turn episode (the engine runs episodes and its spec
        has a problem); other requests (validation of a single-turn run, probes) are not."""
        return self.episodes is not None and track.spec.problem is not None

    def _advance(self, track: _Track, delta) -> None:
        sample = track.sample
        before = len(sample.response_ids)
        sample.append(delta.token_ids, delta.logprobs, self.version, True)
        budget = track.spec.budget
        if track.phase == "think" and budget is not None:
            close = self.settings.close_ids
            if not track.closed:
                start = max(0, before - len(close) + 1)
                track.closed = find_subsequence(sample.response_ids[:budget], close, start) >= 0
            natural_stop = (
                delta.finished and delta.finish_reason == "stop" and len(sample) <= budget
            )
            if len(sample) >= budget and not track.closed and not natural_stop:
                if not delta.finished:
                    routed = self.engine.abort([delta.request_id])
                    sample.add_routed_experts(routed.get(delta.request_id))
                sample.add_routed_experts(delta.routed_experts)
                del self.requests[delta.request_id]
                self._interrupt(track)
                return
        if delta.finished:
            sample.add_routed_experts(delta.routed_experts)
            del self.requests[delta.request_id]
            if delta.finish_reason == "stop" and self._call_tool(track, delta.stop_reason):
                return
            self._finish(track, delta.finish_reason or "length")

    def _call_tool(self, track: _Track, stop_reason: Any = None) -> bool:
        """A model turn that ended on a tool-call stop (id, or a stop string: vLLM's
        ``stop_reason``) goes to the episode's tool step (off this thread); False: the
        episode ends here."""
        episodes, sample = self.episodes, track.sample
        if not self._episode(track) or track.turns >= episodes.max_turns:
            return False
        if track.phase != "think":  # after a forced interruption: the answer, no more calls
            return False
        turn = sample.response_ids[track.turn_start :]
        on_string = isinstance(stop_reason, str) and stop_reason in episodes.stop_strings
        if not turn or not (on_string or turn[-1] in episodes.stop_token_ids):
            return False
        future = episodes.tool_step(track.spec, sample, turn)
        if future is None:
            return False
        self._tools[future] = track
        return True

    def _continue_episodes(self) -> None:
        """Episodes whose tool call returned: the observation's ids are appended (no loss,
        log-prob 0, no version) and the engine goes on from all the ids so far, within the
        episode's token budget (``max_tokens``: model and tool tokens)."""
        for future in [f for f in self._tools if f.done()]:
            track = self._tools.pop(future)
            observation = future.result()
            if observation is None:  # the environment ended the episode
                self._finish(track, "stop")
                continue
            sample, budget = track.sample, track.spec.max_tokens
            sample.append_tool(list(observation))
            if len(sample) >= budget:  # the tool's output ran into the budget: cut there
                sample.truncate(budget)
                self._finish(track, "length")
                continue
            track.turns += 1
            track.turn_start = len(sample)
            self._start(track, sample.prompt_ids + sample.response_ids, budget - len(sample))

    def _interrupt(self, track: _Track) -> None:
        """Cut at the budget, append the interruption text (masked), go on answering."""
        sample, text = track.sample, list(self.settings.text_ids)
        sample.truncate(track.spec.budget)
        sample.append(text, [0.0] * len(text), self.version, False)
        sample.interrupted = True
        track.phase = "answer"
        self._start(track, sample.prompt_ids + sample.response_ids, self.settings.answer_budget)

    def _finish(self, track: _Track, reason: str) -> None:
        track.sample.finish_reason = reason
        if self._episode(track):
            track.sample.tools = self.episodes.end(track.spec)
        self._finished.append(track.sample)

    def _flush(self) -> None:
        # The episodes on a tool first: an episode that ends in this step leaves the tool
        # wait and its request together, as the pool sees them.
        if len(self._tools) != self._tool_waits_sent:
            self._tool_waits_sent = len(self._tools)
            self.events.put(ToolWaits(self.index, self._tool_waits_sent))
        if self._finished:
            self.events.put(SamplesDone(self.index, self._finished, self.oldest_version()))
            self._finished = []


def _commands(commands, block: bool) -> Iterator[Any]:
    """The commands waiting now (after blocking for the first one if ``block``)."""
    try:
        yield commands.get() if block else commands.get_nowait()
    except queue.Empty:
        return
    while True:
        try:
            yield commands.get_nowait()
        except queue.Empty:
            return


def _until_none(get: Callable[[], Any]) -> Iterator[Any]:
    while (item := get()) is not None:
        yield item


def _next_bucket(get: Callable[..., Any], block: bool) -> Any:
    """The next item of a weights queue's ``get`` (a bucket, or None: the push's end), or
    ``_NOTHING`` when none is there and ``block`` is false."""
    if block:
        return get()
    try:
        return get(block=False)
    except queue.Empty:
        return _NOTHING


def run_engine(
    index: int,
    hf_dir: str,
    config: RolloutConfig,
    settings: RunnerSettings,
    commands,
    weights_get: Callable[[], Any],
    events,
    beat_seconds: float = 0.0,
    store_dir: str | None = None,
) -> None:
    """Build engine ``index`` and serve until stopped; failures become ``Failed`` events.
    ``beat_seconds`` > 0: an ``Alive`` event that often, from a thread of its own, from now
    until the end (the pool's stall check, ``rollout.engine_stall_timeout``). ``store_dir``:
    an engine process's directory for vLLM's rendezvous file (``VLLMEngine``)."""
    engine = episodes = None
    runner: list[EngineRunner] = []  # the runner once built, for the beat
    done = threading.Event()
    if beat_seconds > 0:
        threading.Thread(
            target=_beat, args=(index, events, runner, done, beat_seconds), daemon=True
        ).start()
    try:
        from megatron_rl.rollout.engine.vllm_engine import VLLMEngine

        episodes = build_episodes(hf_dir, config, settings)
        engine = VLLMEngine(hf_dir, config, index, store_dir)
        runner.append(EngineRunner(index, engine, settings, events, episodes))
        events.put(Ready(index, engine.max_model_len, os.getpid()))
        runner[0].serve(commands, weights_get)
        done.set()
        engine.close()
        events.put(Stopped(index))
    except BaseException:  # reported to the pool, which raises it in the trainer
        done.set()
        events.put(Failed(index, traceback.format_exc()))
        if engine is not None:
            engine.close()
    finally:
        if episodes is not None:
            episodes.close()


def build_episodes(hf_dir: str, config: RolloutConfig, settings: RunnerSettings):
    """The multi-turn episodes an engine runs (``environments.episodes.EnvironmentSteps``:
    ``rollout.environment`` with ``hf_dir``'s tokenizer, tools in ``settings.sandbox``), or
    None when ``rollout.max_turns`` is 1 or no environment is set."""
    if not config.episodes:
        return None
    from megatron_rl.environments.episodes import EnvironmentSteps
    from megatron_rl.models.hf_config import load_tokenizer

    return EnvironmentSteps.build(
        config.environment, settings.sandbox, load_tokenizer(hf_dir), config.max_turns
    )


def _beat(
    index: int, events, runner: list[EngineRunner], done: threading.Event, seconds: float
) -> None:
    """Put ``Alive`` every ``seconds`` until ``done``: the process runs, and how long its loop
    has been inside one engine step (a stalled step is the pool's to judge)."""
    while not done.wait(seconds):
        since = runner[0].stepping_since if runner else None
        events.put(Alive(index, 0.0 if since is None else time.monotonic() - since))


def subprocess_main(
    index: int,
    hf_dir: str,
    config: RolloutConfig,
    settings: RunnerSettings,
    commands,
    weights,
    events,
    log_path: str | None = None,
) -> None:
    """Entry point of an engine process (``placement: subprocess``). ``events``: the write
    end of this engine's event pipe (:mod:`megatron_rl.rollout.wire`); ``log_path``: a
    file that gets a copy of the process's output (its tail names the cause of a death)."""
    # Its own process group: a dead engine's helpers (vLLM workers) go with it on restart.
    os.setpgrp()
    # The trainer stops its engines (Stop, SIGKILL after a grace time; exit_with_parent). A
    # SIGTERM / SIGUSR1 sent to every process of the job (preemption, scancel) is the
    # trainer's to handle: it finishes the step and checkpoints, which may still need us.
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    if log_path is not None:
        from megatron_rl.rollout.engine.output import tee_output

        tee_output(log_path)
    # The engine forms its own one-process world; the trainer's launcher variables would
    # only confuse it.
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    drop_trainer_only_vars()  # CUDA_DEVICE_MAX_CONNECTIONS: Megatron's, not vLLM's
    if config.gpu_ids is not None:  # before anything initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in engine_devices(config, index))
    logging.basicConfig(level=logging.WARNING)
    from megatron_rl.platform import exit_with_parent
    from megatron_rl.rollout.wire import EventWriter

    exit_with_parent()
    writer = EventWriter(events)
    try:
        # vLLM's rendezvous file in the launcher's directory (with the log), not in /tmp:
        # the launcher removes a SIGKILLed engine's, which it never removes itself
        store_dir = os.path.dirname(log_path) if log_path is not None else None
        run_engine(
            index,
            hf_dir,
            config,
            settings,
            commands,
            weights.get,
            writer,
            beat_seconds(config),
            store_dir,
        )
    finally:
        writer.close()


def beat_seconds(config: RolloutConfig) -> float:
    """How often an engine process says it is alive: a few beats per
    ``rollout.engine_stall_timeout`` (at most every 5 s); 0 when the check is off."""
    return min(config.engine_stall_timeout / 4, 5.0)


def engine_devices(config: RolloutConfig, index: int) -> list[int] | None:
    """The GPUs of engine ``index`` (``rollout.gpu_ids``), None: no GPU list (CPU)."""
    if config.gpu_ids is None:
        return None
    tp = config.tensor_parallel
    return list(config.gpu_ids[index * tp : (index + 1) * tp])
