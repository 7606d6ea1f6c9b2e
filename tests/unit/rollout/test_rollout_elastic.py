"""Elastic engines without vLLM: event pipes that survive a killed writer, the restart budget
and its message, and the pool's bookkeeping of a dead engine's requests (fake engines on
real pipes, the real GeneratorPool). The SIGKILL of a real engine process in a training run
is in test_trainer_loop.py."""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import threading
from types import SimpleNamespace

import pytest
from support.fake_engines import FakeEngines, FakeHandle, channel, die_writing, submitted

from megatron_rl.rollout.client import GenerationStopped, WeightsNeeded
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.messages import (
    Cancel,
    JoinTransport,
    Push,
    Pushed,
    Ready,
    SamplesDone,
    StatusReport,
    TransportJoined,
)
from megatron_rl.rollout.pool import GeneratorPool
from megatron_rl.rollout.pool.fanout import Fanout
from megatron_rl.rollout.pool.restarts import RestartBudget, refusal_message
from megatron_rl.rollout.samples import Sample
from megatron_rl.rollout.wire import EventChannels, EventWriter


def test_a_dead_writers_complete_events_are_read_and_its_half_message_dropped():
    channels = EventChannels()
    reader, conn = multiprocessing.Pipe(duplex=False)
    channels.add(0, reader)
    other = channel(channels, 1)
    writer = EventWriter(conn)
    sample = Sample(3, 1, [1, 2], [5], [-0.5], [0], [True], "stop")
    writer.put(SamplesDone(0, [sample], 0))
    writer.put(StatusReport(0, {"n": 1}))
    other.put(Ready(1, 64))
    die_writing(writer, SamplesDone(0, [Sample(3, 2, [1])], 0))
    got = []
    while True:
        try:
            got.append(channels.get(timeout=0.5))
        except queue.Empty:
            break
    # each engine's events in order; the half-written one never shows up
    mine = [e for e in got if e.engine == 0]
    assert mine == [SamplesDone(0, [sample], 0), StatusReport(0, {"n": 1})]
    assert mine[0].samples[0] is not sample  # it crossed the pipe, whole
    assert Ready(1, 64) in got
    assert channels.drain(0) == []  # nothing complete is left; the channel is closed
    other.close()
    channels.close()


def test_drain_returns_the_unread_events_of_one_engine_in_order():
    channels = EventChannels()
    a, b = channel(channels, 0), channel(channels, 1)
    for n in range(3):
        a.put(StatusReport(0, {"n": n}))
        b.put(StatusReport(1, {"n": n}))
    a.close(), b.close()
    first = channels.get(timeout=1)  # reads what both pipes hold
    assert isinstance(first, StatusReport)
    rest_a = channels.drain(0)
    seen_a = ([first] if first.engine == 0 else []) + rest_a
    assert [e.status["n"] for e in seen_a] == [0, 1, 2]
    seen_b = ([first] if first.engine == 1 else []) + [
        channels.get(0) for _ in range(3 - (first.engine == 1))
    ]
    assert [e.status["n"] for e in seen_b] == [0, 1, 2]
    with pytest.raises(queue.Empty):
        channels.get(0)
    channels.close()


def test_restart_budget_counts_within_the_window():
    now = [0.0]
    budget = RestartBudget(2, 60.0, clock=lambda: now[0])
    assert budget.take(0) and budget.take(0)
    assert not budget.take(0)  # a third within a minute
    assert budget.take(1)  # per engine
    now[0] = 61.0  # the first two left the window
    assert budget.recent(0) == 0 and budget.take(0)
    assert budget.total == 4
    assert not RestartBudget(0, 60.0).take(0)


def test_refusal_message_names_the_engine_the_keys_and_the_log_tail(tmp_path):
    log = tmp_path / "engine-3.log"
    log.write_text("".join(f"line {i}\n" for i in range(1, 31)))
    budget = RestartBudget(1, 1800.0)
    budget.take(3)
    text = refusal_message(3, "subprocess", "GPUs [6, 7]", budget, str(log))
    assert "vLLM engine 3 exited unexpectedly (placement subprocess, devices GPUs [6, 7])" in text
    assert "restarted 1 time(s) in the last 30 min" in text
    assert "rollout.engine_max_restarts is 1" in text
    assert "rollout.engine_restart_window_minutes 30" in text
    tail = text.split(f"({log}):\n")[1].splitlines()
    assert tail == [f"line {i}" for i in range(11, 31)]  # the last 20 lines


def test_fanout_drops_a_dead_engines_lane_and_delivers_to_the_others():
    live, dead = queue.Queue(), queue.Queue(maxsize=1)
    dead.put("never taken")  # a dead engine takes nothing
    engines = [
        SimpleNamespace(index=0, put_weights=live.put),
        SimpleNamespace(index=1, put_weights=dead.put),
    ]
    waited = []

    def wait(index):
        waited.append(index)
        lanes.drop(index)

    lanes = Fanout(engines, wait)
    with lanes:
        for item in ("b0", "b1", "b2", None):
            lanes.put(item)
        lanes.finish()
    assert [live.get_nowait() for _ in range(4)] == ["b0", "b1", "b2", None]
    assert set(waited) == {1}


# -- the pool's bookkeeping, on fake engines ------------------------------------------------


HF = SimpleNamespace(vocab_size=100, eos_token_id=2)


@pytest.fixture
def make_fake_pool(tmp_path):
    """The real pool over :class:`FakeEngines`: ``make_fake_pool(**pool_kwargs)``."""
    made = []

    def make(**kwargs):
        fakes = FakeEngines(tmp_path)
        config = RolloutConfig(
            engines=2, placement="subprocess", samples_per_prompt=2, engine_max_restarts=1
        )
        made.append(GeneratorPool("unused", config, launcher=fakes, text_config=HF, **kwargs))
        return made[-1], fakes

    yield make
    for pool in made:
        pool.close()


@pytest.fixture
def fake_pool(make_fake_pool):
    return make_fake_pool()


def _returned(spec, version: int) -> Sample:
    sample = Sample(spec.prompt_index, spec.sample_index, list(spec.prompt_ids))
    sample.append([5], [-0.5], version, True)
    return sample


def _serve_one_push(pool, fakes, index, pushes):
    """The restarted engine's side of a push: the command, the buckets, the ack."""
    handle = pool.engine_handles()[index]

    def run():
        command = handle.commands.get(timeout=30)
        assert isinstance(command, Push)
        while handle.weights.get(timeout=30) is not None:
            pass
        pushes.append(command.version)
        fakes.writers[index].put(Pushed(index, command.version, 0.0, 1, 16, None))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _push_to_both(pool, fakes):
    """A push served by both engines: the HF directory's weights are stale from now on."""
    import torch

    threads = [_serve_one_push(pool, fakes, index, []) for index in (0, 1)]
    pool.push_weights(iter([[("w", torch.zeros(4))]]))
    for thread in threads:
        thread.join(30)


def test_a_dead_engines_requests_are_resubmitted_exactly_once_each(make_fake_pool):
    import torch

    pool, fakes = make_fake_pool(initial_version=3)
    _push_to_both(pool, fakes)  # version 4: the HF directory's weights are stale now
    indices = pool.submit([[10, 11], [12], [13, 14, 15]], seeds=[7, 8, 9])
    handles = pool.engine_handles()
    by_engine = {i: submitted(h) for i, h in enumerate(handles)}
    assert sorted(len(s) for s in by_engine.values()) == [2, 4]
    victim = max(by_engine, key=lambda i: len(by_engine[i]))
    survivor = 1 - victim
    lost = by_engine[victim]
    # one sample comes back whole; the next is half written when the process is killed
    fakes.writers[victim].put(SamplesDone(victim, [_returned(lost[0], 4)], 4))
    fakes.kill(pool, victim, half=SamplesDone(victim, [_returned(lost[1], 4)], 4))
    got = pool.poll(timeout=2)
    assert [(s.prompt_index, s.sample_index) for s in got] == [
        (lost[0].prompt_index, lost[0].sample_index)
    ]
    assert fakes.spawned == [0, 1, victim] and pool.restarts == 1
    resubmitted = submitted(handles[survivor])
    assert resubmitted == lost[1:]  # the same requests (seeds, budgets), none twice
    assert pool.in_flight == len(lost) - 1 + len(by_engine[survivor])
    # the restarted engine is up but runs stale weights: it takes nothing until reweighed
    pool.poll(timeout=0.5)
    assert pool.needs_weights() and victim in pool.stale_engines
    pushes = []
    thread = _serve_one_push(pool, fakes, victim, pushes)
    stats = pool.reweigh(iter([[("w", torch.zeros(4))]]))
    thread.join(30)
    assert pushes == [4] and stats.version == pool.version == 4  # the current version
    assert not pool.needs_weights() and pool.stale_engines == []
    assert submitted(handles[survivor]) == []  # the reweigh went to the restarted only
    # everything comes back once: the survivor returns its own and the resubmitted requests
    todo = by_engine[survivor] + resubmitted
    fakes.writers[survivor].put(SamplesDone(survivor, [_returned(s, 4) for s in todo], 4))
    got += pool.poll(timeout=2)
    want = {(i, j) for i in indices for j in range(2)}
    assert sorted((s.prompt_index, s.sample_index) for s in got) == sorted(want)
    assert pool.in_flight == 0


def _commands(handle) -> list:
    """Every command an engine (its handle) was sent since the last look."""
    commands = []
    while not handle.commands.empty():
        commands.append(handle.commands.get_nowait())
    return commands


def test_a_stopped_generate_cancels_its_requests_and_none_of_its_samples_comes_back(
    fake_pool, caplog
):
    """A validation given up on a stop (``generate(stop_when=...)``, issue 49): every engine
    that holds one of its requests is told to drop its prompts (``Cancel``), the training
    prompt in flight is untouched, and a sample of a cancelled prompt that an engine had
    finished before it heard (its ``SamplesDone`` crossing the ``Cancel``) never comes back:
    not through ``poll`` (a training batch), not in flight. Before: ``generate`` had no
    stop, the pass ran to its end."""
    pool, fakes = fake_pool
    (train,) = pool.submit([[20, 21]], seeds=[1])  # the rollout source's, on one engine
    handles = pool.engine_handles()
    held = {
        i: [s for c in _commands(h) if hasattr(c, "specs") for s in c.specs]
        for i, h in enumerate(handles)
    }
    asked = []

    def stop_when() -> bool:  # asked after each wait on the engines
        asked.append(True)
        if len(asked) == 1:  # the validation's requests are out; one sample comes back
            for i, handle in enumerate(handles):
                held[i] += [s for c in _commands(handle) for s in c.specs]
            engine = next(i for i in held if any(s.prompt_index != train for s in held[i]))
            first = next(s for s in held[engine] if s.prompt_index != train)
            fakes.writers[engine].put(SamplesDone(engine, [_returned(first, 0)], 0))
        return len(asked) >= 3  # the signal

    with pytest.raises(GenerationStopped, match="stopped with 1 of 6 samples"):
        pool.generate([[10], [11], [12]], seeds=[4, 5, 6], stop_when=stop_when)
    validation = {s.prompt_index for specs in held.values() for s in specs} - {train}
    assert len(validation) == 3
    for i, handle in enumerate(handles):
        mine = {s.prompt_index for s in held[i]} & validation
        cancels = [c for c in _commands(handle) if isinstance(c, Cancel)]
        assert cancels == ([Cancel(tuple(sorted(validation)))] if mine else [])
    assert pool.in_flight == 2  # the training prompt's samples only
    # an engine returns what it finished before the Cancel, with the training samples
    for i in held:
        late = [_returned(s, 0) for s in held[i]]
        fakes.writers[i].put(SamplesDone(i, late, 0))
    with caplog.at_level("WARNING"):
        got = pool.poll(timeout=2)
        got += pool.poll(timeout=0.5)
    assert sorted((s.prompt_index, s.sample_index) for s in got) == [(train, 0), (train, 1)]
    assert pool.in_flight == 0 and "not given" not in caplog.text


def test_requests_wait_when_no_engine_runs_the_current_weights(fake_pool):
    pool, fakes = fake_pool
    _push_to_both(pool, fakes)
    pool.submit([[10]], seeds=[1])
    owner = next(i for i, h in enumerate(pool.engine_handles()) if submitted(h))
    for index in (0, 1):
        fakes.kill(pool, index)
    pool.poll(timeout=0.5)  # both restarted: the request waits in the pool
    assert pool.restarts == 2 and pool.in_flight == 2 and pool.pending_requests == 2
    assert all(submitted(h) == [] for h in pool.engine_handles())
    pool.poll(timeout=0.5)  # the restarted engines are ready, with stale weights
    with pytest.raises(WeightsNeeded):
        pool.generate([[20]])
    assert pool.pending_requests == 2 and pool.in_flight == 2  # generate's request withdrawn
    assert owner in (0, 1)


def test_one_death_too_many_fails_with_the_engine_and_its_log(fake_pool):
    pool, fakes = fake_pool
    fakes.kill(pool, 1)
    pool.poll(timeout=0.5)
    assert pool.restarts == 1
    fakes.kill(pool, 1)  # the second within the window; engine_max_restarts is 1
    with pytest.raises(RuntimeError) as err:
        pool.poll(timeout=0.5)
    text = str(err.value)
    assert "vLLM engine 1 exited unexpectedly (placement subprocess, devices cpu)" in text
    assert "engine 1 incarnation 2\nboom" in text


@dataclasses.dataclass(frozen=True)
class Gossip:  # an event type the pool does not know (an engine of another version)
    engine: int


def test_an_unknown_event_fails_the_pool_naming_its_type(fake_pool):
    pool, fakes = fake_pool
    fakes.writers[1].put(Gossip(1))
    fakes.writers[1].flush()
    with pytest.raises(TypeError, match=r"generator pool: unknown message .*Gossip\(engine=1\)"):
        pool.poll(timeout=2)
    assert pool.closed


def test_in_process_engines_are_not_restarted():
    class DeadThreads:  # the in-process launcher's rule, with an engine thread that died
        restartable = False
        events = queue.Queue()

        def start(self, count):
            dead = FakeHandle(0, EventChannels())
            dead.alive = False
            return [dead]

        def restart(self, index):
            raise AssertionError("an in-process engine was restarted")

        def close(self):
            pass

    config = RolloutConfig(placement="in_process", weight_transport="host", engines=1)
    with pytest.raises(RuntimeError, match="vLLM engine 0 exited unexpectedly.*in_process"):
        GeneratorPool("unused", config, launcher=DeadThreads(), text_config=HF)


def test_an_engine_process_output_goes_to_its_console_and_its_log(tmp_path):
    """``tee_output`` in a fresh process (it rewires file descriptors 1 and 2): Python
    prints and raw writes reach both the process's own stdout / stderr and the log, where
    a line of one stream is never cut by the other's (stdout's line is half written when
    stderr's comes)."""
    import subprocess
    import sys

    log = tmp_path / "engine-0.log"
    code = (
        "import os, sys, time\n"
        "from megatron_rl.rollout.engine.output import tee_output\n"
        f"tee_output({str(log)!r})\n"
        "print('from python', flush=True)\n"
        "os.write(1, b'half ')\n"
        "time.sleep(0.2)\n"
        "os.write(2, b'raw stderr\\n')\n"
        "time.sleep(0.2)\n"
        "os.write(1, b'a line\\n')\n"
        "os.write(1, b'x' * 1_500_000 + b'\\n')\n"  # longer than the copier holds back
        "time.sleep(0.5)\n"  # the copying threads are daemons
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    long = "x" * 1_500_000
    assert proc.stdout == f"from python\nhalf a line\n{long}\n" and proc.stderr == "raw stderr\n"
    lines = log.read_text().splitlines()
    assert sorted(lines) == ["from python", "half a line", "raw stderr", long]
    assert lines.index("from python") < lines.index("half a line")


# -- a group transport (nccl) re-formed around a death, on fake engines ---------------------


class GroupEngines(FakeEngines):
    """Fake engines that serve a group transport's side: each incarnation answers
    ``JoinTransport`` (counting its joins) and takes a push's buckets, then acks it.
    ``hold_ready``: a restarted engine reports Ready only when the test says so."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        self.hold_ready = False
        self.rendezvous = None  # the sender's side of the next formation, if any
        self.joins: dict[int, int] = {}  # id(handle) -> JoinTransport taken
        self.join_infos: list[tuple[int, dict]] = []  # (engine, its JoinTransport init_info)
        self.loaded: list[tuple[int, int, int]] = []  # (engine, version, buckets)
        self._held: dict[int, EventWriter] = {}

    def _started(self, handle, writer):
        if self.hold_ready and self.spawned.count(handle.index) > 1:
            self._held[handle.index] = writer
        else:
            super()._started(handle, writer)
        threading.Thread(target=self._serve, args=(handle, writer), daemon=True).start()

    def make_ready(self, index):
        writer = self._held.pop(index)
        writer.put(Ready(index, 64))
        writer.flush()  # in the pipe: the pool's next look sees it

    def _serve(self, handle, writer):
        while handle.alive:
            try:
                command = handle.commands.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(command, JoinTransport):
                self.joins[id(handle)] = self.joins.get(id(handle), 0) + 1
                self.join_infos.append((handle.index, command.init_info))
                writer.put(TransportJoined(handle.index))
            elif isinstance(command, Push):
                count = 0
                while handle.weights.get(timeout=30) is not None:
                    count += 1
                self.loaded.append((handle.index, command.version, count))
                writer.put(Pushed(handle.index, command.version, 0.0, count, 16, None))


class GroupSender:
    """The sender end of one formation: it takes buckets until closed (then it must not)."""

    blocking = False

    def __init__(self, members):
        self.members, self.closed, self.sent = members, False, 0

    def pack(self, bucket):
        assert not self.closed, "a closed group's sender was used"
        return bucket

    def send(self, bucket):
        assert not self.closed, "a closed group's sender was used"
        self.sent += 1

    def close(self):
        self.closed = True


@pytest.fixture
def group_pool(tmp_path):
    """The real pool over fake engines, with a group transport (joins on the pool's
    ``JoinTransport``, as ``nccl`` does) whose opener records each formation."""
    from megatron_rl.rollout.weights.senders import Transport

    fakes = GroupEngines(tmp_path)
    senders: list[GroupSender] = []

    def open_group(config, hf_config, engines, wait_joined):
        for engine in engines:  # as _open_nccl does, with each engine's rank payload
            engine.send(JoinTransport({"rank_offset": 1 + engines.index(engine)}))
        wait_joined(fakes.rendezvous)  # the sender's side (NcclSender.connect), if any
        senders.append(GroupSender([e.index for e in engines]))
        return senders[-1]

    group = Transport("group", lambda config: "megatron_rl_cpu", False, open_group)
    config = RolloutConfig(
        engines=2, placement="subprocess", samples_per_prompt=2, push_timeout_seconds=20
    )
    pool = GeneratorPool("unused", config, launcher=fakes, transport=group, text_config=HF)
    yield pool, fakes, senders
    pool.close()


def _bucket():
    import torch

    return [("w", torch.zeros(4))]


def test_a_group_is_formed_anew_of_the_survivors_then_with_the_restarted_engine(group_pool):
    pool, fakes, senders = group_pool
    first = pool.engine_handles()
    assert [s.members for s in senders] == [[0, 1]]  # formed once the engines were up
    pool.push_weights(iter([_bucket(), _bucket()]))
    assert [s.members for s in senders] == [[0, 1]] and senders[0].sent == 2  # same group
    fakes.hold_ready = True
    fakes.kill(pool, 1)
    pool.poll(timeout=0.5)  # engine 1 restarted, not up yet: the group is not touched
    assert pool.restarts == 1 and len(senders) == 1 and not senders[0].closed
    pool.push_weights(iter([_bucket()]))
    # of the survivor alone, before the push: the old group closed, engine 0 joined again
    assert [s.members for s in senders] == [[0, 1], [0]] and senders[0].closed
    assert fakes.joins[id(first[0])] == 2 and senders[1].sent == 1
    assert pool.version == 2 and 0 not in pool.stale_engines
    fakes.make_ready(1)
    pool.poll(timeout=0.5)
    assert pool.needs_weights()
    pool.reweigh(iter([_bucket()]))  # a group of the restarted engine alone
    restarted = pool.engine_handles()[1]
    assert [s.members for s in senders][2:] == [[1]] and senders[1].closed
    assert fakes.joins[id(restarted)] == 1 and not pool.needs_weights()
    pool.push_weights(iter([_bucket()]))  # everyone again
    assert [s.members for s in senders][3:] == [[0, 1]] and senders[2].closed
    assert fakes.joins == {id(first[0]): 3, id(first[1]): 1, id(restarted): 2}
    pool.push_weights(iter([_bucket()]))  # no change: no new group
    assert len(senders) == 4 and senders[3].sent == 2
    # every engine loaded exactly the pushes that went to it, each bucket once
    assert sorted(fakes.loaded) == [  # (engine, version, buckets), in any order of engines
        (0, 1, 2), (0, 2, 1), (0, 3, 1), (0, 4, 1), (1, 1, 2), (1, 2, 1), (1, 3, 1), (1, 4, 1)
    ]  # fmt: skip


def test_a_death_during_a_group_broadcast_fails_at_once_naming_why(group_pool):
    """The survivors' workers would wait in the broadcast for ever (no abort in vLLM 0.32's
    PyNccl): the pool must stop the run with that reason, not restart or hang."""
    import time

    pool, fakes, senders = group_pool
    released = threading.Event()

    def send(bucket):  # a broadcast blocks until every member received: one never will
        fakes.kill(pool, 1)
        released.wait(60)

    broadcast = senders[-1]  # the group's sender end, made a blocking broadcast
    broadcast.blocking, broadcast.send, broadcast.close = True, send, released.set
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        pool.push_weights(iter([_bucket()]))
    assert time.monotonic() - start < 10 and released.is_set() and pool.closed
    text = str(err.value)
    assert "vLLM engine 1 (placement subprocess, devices cpu) exited while a weight push" in text
    assert "cannot abort" in text and "resume it from its last checkpoint" in text
    assert pool.restarts == 0


def test_a_death_during_a_groups_rendezvous_fails_at_once_naming_why(group_pool):
    """Forming the group anew (a restarted engine is up): a member dies while the sender
    waits in the rendezvous for every rank; the pool watches the engines meanwhile."""
    import time

    pool, fakes, senders = group_pool
    fakes.hold_ready = True
    fakes.kill(pool, 1)
    pool.poll(timeout=0.5)
    fakes.make_ready(1)
    pool.poll(timeout=0.5)
    released = threading.Event()

    def rendezvous():  # engine 0 dies before it joins: the rendezvous would wait for ever
        fakes.kill(pool, 0)
        released.wait(60)

    fakes.rendezvous = rendezvous
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        pool.push_weights(iter([_bucket()]))
    released.set()
    assert time.monotonic() - start < 10 and pool.closed
    assert (
        "vLLM engine 0 (placement subprocess, devices cpu) exited while forming the "
        "weight-transfer group" in str(err.value)
    )
    assert [s.members for s in senders] == [[0, 1]] and senders[0].closed  # none formed


def test_the_nccl_group_is_formed_anew_with_the_ranks_vllm_expects(tmp_path, monkeypatch):
    """The real ``nccl`` transport (``senders._open_nccl``, ``NcclSender``, vLLM's packed
    producer) on CPU up to the NCCL calls, over three fake engines: engine 1 dies, the next
    push forms a group of engines 0 and 2 (ranks 1 and 2 of 3, vLLM's worker init info, a
    fresh port; the old communicator destroyed), and once engine 1 is back a group of all
    three again. Stand-ins: the communicators and the CUDA device index."""
    import torch
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    import megatron_rl.platform.device as device
    from megatron_rl.platform import get_platform
    from megatron_rl.rollout.weights.nccl import NcclSender

    get_platform()  # on CPU: the torch.cuda stream stand-ins every run has
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(device, "get_platform", lambda: device.Platform("cuda", "nccl", False))
    monkeypatch.setattr(device.Platform, "torch_device", lambda self: torch.device("cpu"))
    # CUDA-only: the sender marks each tensor as read by vLLM's packing stream
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    communicators = []

    class Communicator:  # rank 0's end of one group
        destroyed = False

        def broadcast(self, tensor, src):
            pass

        def destroy(self):
            self.destroyed = True

    def connect(sender):  # the rendezvous: every worker has joined
        sender.group = Communicator()
        communicators.append((sender.world_size, sender.port, sender.group))

    monkeypatch.setattr(NcclSender, "connect", connect)
    fakes = GroupEngines(tmp_path)
    config = RolloutConfig(
        engines=3,
        placement="subprocess",
        weight_transport="nccl",
        nccl_address="127.0.0.1",
        push_timeout_seconds=20,
    )
    pool = GeneratorPool("unused", config, launcher=fakes, text_config=HF)
    try:
        vllm = NCCLWeightTransferEngine.__new__(NCCLWeightTransferEngine)

        def formation() -> dict[int, tuple[int, int, int]]:
            """engine -> (rank offset, world size, port) of the joins since the last call"""
            infos = [(i, vllm.parse_init_info(info)) for i, info in fakes.join_infos]
            fakes.join_infos.clear()
            return {i: (f.rank_offset, f.world_size, f.master_port) for i, f in infos}

        first = formation()
        assert {i: f[:2] for i, f in first.items()} == {0: (1, 4), 1: (2, 4), 2: (3, 4)}
        fakes.hold_ready = True
        fakes.kill(pool, 1)
        pool.poll(timeout=0.5)
        pool.push_weights(iter([_bucket()]))
        survivors = formation()
        assert {i: f[:2] for i, f in survivors.items()} == {0: (1, 3), 2: (2, 3)}
        assert survivors[0][2] != first[0][2] and communicators[0][2].destroyed
        assert [(w, p) for w, p, _ in communicators][1] == (3, survivors[0][2])
        fakes.make_ready(1)
        pool.poll(timeout=0.5)
        pool.push_weights(iter([_bucket()]))  # the restarted engine is up: all three again
        again = formation()
        assert {i: f[:2] for i, f in again.items()} == {0: (1, 4), 1: (2, 4), 2: (3, 4)}
        assert communicators[1][2].destroyed and not communicators[2][2].destroyed
        assert sorted(fakes.loaded) == [(0, 1, 1), (0, 2, 1), (1, 2, 1), (2, 1, 1), (2, 2, 1)]
        assert not pool.needs_weights() and pool.version == 2
    finally:
        pool.close()


def test_an_engine_process_rendezvous_file_is_its_launchers_and_goes_with_its_death(tmp_path):
    """Issue 49 item 12: vLLM names its one-process world's FileStore ``/tmp/vllm_dist_<uuid>``
    and removes it when the world closes; a SIGKILLed engine process left it in /tmp. An
    engine process builds vLLM with the file in its launcher's directory, named after its
    pid (vLLM's own executor function, as it calls it), and the launcher removes a dead
    engine's files (``ProcessEngine.discard``); the directory goes at the launcher's close.
    The temporary directory itself is not moved (the episodes' tool sandbox uses it)."""
    import os
    import tempfile

    from vllm.v1.executor import multiproc_executor, uniproc_executor

    from megatron_rl.rollout.engine.vllm_engine import _file_store_in
    from megatron_rl.rollout.pool.launchers import remove_file_stores

    original = uniproc_executor.get_file_store_init_method
    with _file_store_in(str(tmp_path)):
        made = [uniproc_executor.get_file_store_init_method() for _ in range(2)]
        made.append(multiproc_executor.get_file_store_init_method())
        assert tempfile.gettempdir() != str(tmp_path)
    assert uniproc_executor.get_file_store_init_method is original  # restored
    prefix = f"file://{tmp_path}/vllm_dist_pid{os.getpid()}_"
    assert all(m.startswith(prefix) and len(m) == len(prefix) + 32 for m in made), made
    assert len(set(made)) == 3
    with _file_store_in(None):  # engines on threads of the trainer: vLLM's own
        assert original().startswith(f"file://{tempfile.gettempdir()}/vllm_dist_")
    # the dead engine's files go; another engine's (another pid) and the log stay
    for m in made:
        open(m.removeprefix("file://"), "w").close()
    other = tmp_path / "vllm_dist_pid1_abc"
    other.write_text("")
    (tmp_path / "engine-0.log").write_text("log")
    removed = remove_file_stores(str(tmp_path), os.getpid())
    assert sorted(removed) == sorted(m.rsplit("/", 1)[1] for m in made)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-0.log", other.name]
