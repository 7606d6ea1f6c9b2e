"""The TCP bridge between the generator pool and engine tasks (megatron_rl.rollout.wire: the
wire; megatron_rl.rollout.pool.remote: the pool's end; .engine.serve: the engine task's end).

The engine side runs a scripted runner with the real runner's queue protocol, on threads of
this process; the vLLM engine itself is exercised by the Slurm test.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.platform import free_port
from megatron_rl.rollout import wire
from megatron_rl.rollout.engine import serve
from megatron_rl.rollout.messages import (
    Failed,
    Hello,
    Init,
    Push,
    Pushed,
    Ready,
    RequestSpec,
    SamplesDone,
    Stop,
    Stopped,
    Submit,
)
from megatron_rl.rollout.pool import remote
from megatron_rl.rollout.pool.fanout import Fanout
from megatron_rl.rollout.samples import Sample
from megatron_rl.rollout.weights.buckets import (
    flat_update,
    shared_update,
    tensors_update,
    unpack_views,
)

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Started:  # test-only events: the pool's end forwards every event to the pool's queue
    engine: int
    hf_dir: str
    config: object


@dataclass(frozen=True)
class Header:
    engine: int
    info: dict


@dataclass(frozen=True)
class Received:
    engine: int
    tensors: dict


def scripted_runner(index, hf_dir, config, settings, commands, weights_get, events):
    """The runner's protocol without vLLM: echoes submits (an empty prompt: fails), reports
    pushed tensors."""
    events.put(Ready(index, 64))
    events.put(Started(index, hf_dir, config))
    while True:
        command = commands.get()
        if isinstance(command, Stop):
            events.put(Stopped(index))
            return
        if isinstance(command, Submit):
            if not command.specs[0].prompt_ids:
                events.put(Failed(index, "Traceback: scripted failure"))
                return
            samples = [
                Sample(
                    s.prompt_index,
                    s.sample_index,
                    list(s.prompt_ids),
                    routed_experts=routing_rows(len(s.prompt_ids)),
                )
                for s in command.specs
            ]
            events.put(SamplesDone(index, samples, None))
        elif isinstance(command, Push):
            received = {}
            while (update := weights_get()) is not None:
                if "buffer" not in update:  # an NCCL bucket header: the tensors go by NCCL
                    events.put(Header(index, update))
                    continue
                views = unpack_views(
                    update["buffer"], update["dtype_names"], update["shapes"], update["offsets"]
                )
                received.update({n: v.clone() for n, v in zip(update["names"], views)})
            events.put(Pushed(index, command.version, 0.0, len(received), 0, None))
            events.put(Received(index, received))


def routing_rows(positions: int) -> np.ndarray:
    """Routed-expert rows ``[positions, 4 layers, top-2]`` (uint8, as engines record them)."""
    return (np.arange(positions * 8) * 37 % 251).astype(np.uint8).reshape(positions, 4, 2)


@pytest.fixture
def job_env(monkeypatch):
    port = free_port()
    monkeypatch.setenv(wire.ADDR_ENV, f"127.0.0.1:{port}")
    monkeypatch.setenv(wire.KEY_ENV, "0123456789abcdef0123")
    return ("127.0.0.1", port), b"0123456789abcdef0123"


def start_engine_task(address, authkey, index, results, runner=scripted_runner):
    def task():
        link = serve.connect(address, authkey, timeout=20)
        results[index] = serve.serve_engine(link, index, runner)
        link.close()

    thread = threading.Thread(target=task, daemon=True)
    thread.start()
    return thread


def next_event(events, kind, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = events.get(timeout=deadline - time.monotonic())
        if isinstance(event, kind):
            return event
    raise AssertionError(f"no {kind.__name__} event")


def weight_bucket():
    g = torch.Generator().manual_seed(0)
    return [
        ("w.bf16", torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        ("w.f32.transposed", torch.randn(3, 4, generator=g).t()),  # not contiguous
        ("w.i64", torch.arange(-3, 6, dtype=torch.int64).reshape(3, 3)),
        ("w.bool", torch.tensor([True, False, True])),
        ("w.scalar", torch.tensor(2.5)),
        ("w.empty", torch.empty(0, 4)),
    ]


def test_commands_weights_and_events_cross_the_connection_exactly(job_env):
    address, key = job_env
    results: dict[int, int] = {}
    tasks = [start_engine_task(address, key, i, results) for i in (1, 0)]  # any order
    events: queue.Queue = queue.Queue()
    engines = remote.accept_engines(2, "/models/hf", {"engines": 2}, None, events)
    assert [e.index for e in engines] == [0, 1]
    started = [next_event(events, Started), next_event(events, Started)]
    assert {e.engine for e in started} == {0, 1}
    assert all(e.hf_dir == "/models/hf" and e.config == {"engines": 2} for e in started)

    bucket = weight_bucket()
    for engine in engines:
        engine.send(Push(1, "keep"))
    with Fanout(engines, lambda index: None) as lanes:  # what a remote pool does
        lanes.put(flat_update(bucket[:2]))  # flattened once, streamed to both engines
        lanes.finish()
    for engine in engines:  # the other forms are flattened by the link
        engine.put_weights(tensors_update(bucket[2:4]))  # tensors form (in-process pools)
        engine.put_weights(shared_update(bucket[4:]))  # flat-buffer form (subprocess pools)
        engine.put_weights(None)
    for _ in engines:
        event = next_event(events, Received)
        index, received = event.engine, event.tensors
        assert list(received) == [name for name, _ in bucket]
        for name, tensor in bucket:
            assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
            assert torch.equal(received[name], tensor), (index, name)

    engines[1].send(Submit((RequestSpec(7, 0, (1, 2, 3), 8, 1.0, 1.0),)))
    done = next_event(events, SamplesDone)
    assert done.engine == 1 and done.samples[0].prompt_ids == [1, 2, 3]
    routed = done.samples[0].routed_experts  # routing replay's rows travel with the sample
    assert routed.dtype == np.uint8 and np.array_equal(routed, routing_rows(3))

    for engine in engines:
        engine.send(Stop())
    for engine in engines:
        engine.join(timeout=10)
    for task in tasks:
        task.join(timeout=10)
    assert results == {0: 0, 1: 0}  # both engine tasks exit 0 after stop


def test_engine_task_that_goes_away_is_dead_and_what_is_sent_to_it_is_dropped(job_env):
    """Like an engine process's queue, a lost connection never raises in the pool's sends:
    the pool learns of the death from ``is_alive`` (and restarts the engine, or fails)."""
    address, key = job_env
    events: queue.Queue = queue.Queue()
    link_box = {}

    def vanishing_task():
        link = serve.connect(address, key, timeout=20)
        link.send(Hello(0, {"host": "test", "pid": 0}))
        link_box["init"] = link.recv()
        link.close()  # the task dies

    thread = threading.Thread(target=vanishing_task, daemon=True)
    thread.start()
    (engine,) = remote.accept_engines(1, "/hf", None, None, events)
    thread.join(timeout=10)
    assert link_box["init"] == Init("/hf", None, None)
    deadline = time.monotonic() + 10
    while engine.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.is_alive()
    for _ in range(50):  # the first sends may still land in the socket buffer
        engine.put_weights(tensors_update(weight_bucket()))
        engine.send(Push(1, "keep"))
    assert not engine.is_alive() and engine._lost


def test_silent_engine_counts_as_dead_after_the_timeout(job_env, monkeypatch):
    address, key = job_env
    monkeypatch.setenv(wire.TIMEOUT_ENV, "0.5")
    events: queue.Queue = queue.Queue()

    def silent_task():  # connected, never sends a heartbeat
        link = serve.connect(address, key, timeout=20)
        link.send(Hello(0, {"host": "test", "pid": 0}))
        link.recv()
        time.sleep(5)
        link.close()

    threading.Thread(target=silent_task, daemon=True).start()
    (engine,) = remote.accept_engines(1, "/hf", None, None, events)
    assert engine.is_alive()
    time.sleep(0.8)
    assert not engine.is_alive()


def test_engine_task_exits_3_when_the_trainer_goes_away_and_1_when_its_engine_fails(job_env):
    address, key = job_env
    results: dict[int, int] = {}
    tasks = [start_engine_task(address, key, i, results) for i in (0, 1)]
    events: queue.Queue = queue.Queue()
    engines = remote.accept_engines(2, "/hf", None, None, events)
    next_event(events, Ready), next_event(events, Ready)
    engines[0].terminate()  # no stop command: the trainer crashed
    engines[1].send(Submit((RequestSpec(0, 0, (), 8, 1.0, 1.0),)))  # scripted: fails
    assert next_event(events, Failed).traceback == "Traceback: scripted failure"
    for task in tasks:
        task.join(timeout=15)
    assert results == {0: 3, 1: 1}


def test_missing_engine_is_named_after_the_connect_timeout_and_bad_index_rejected(
    job_env, monkeypatch
):
    address, key = job_env
    monkeypatch.setenv(wire.CONNECT_TIMEOUT_ENV, "3")
    results: dict[int, int] = {}
    start_engine_task(address, key, 5, results)  # out of range: rejected
    start_engine_task(address, key, 0, results)
    with pytest.raises(RuntimeError, match=r"generator engine\(s\) \[1\] did not connect"):
        remote.accept_engines(2, "/hf", None, None, queue.Queue())
    assert results.get(5) == 4


def test_generator_entry_reports_a_missing_job_environment_and_an_absent_trainer(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "megatron_rl.launch.generator"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and serve.ADDR_ENV in proc.stderr
    env.update(
        {serve.ADDR_ENV: f"127.0.0.1:{free_port()}", serve.KEY_ENV: "k" * 32, "SLURM_PROCID": "3"}
    )
    proc = subprocess.run(
        [*cmd, "--connect-timeout", "2"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "engine 3" in proc.stderr and "did not accept a connection within 2 s" in proc.stderr


def test_nccl_bucket_headers_cross_the_connection_as_they_are(job_env):
    """With weight_transport nccl only a bucket's header (vLLM's NCCL update info) goes to a
    remote engine; the tensors follow by broadcast."""
    from megatron_rl.rollout.weights.nccl import bucket_header, group_layout, worker_payload

    bucket = weight_bucket()
    header = bucket_header(bucket)
    assert header["names"] == [n for n, _ in bucket]
    assert header["dtype_names"] == ["bfloat16", "float32", "int64", "bool", "float32", "float32"]
    assert header["shapes"] == [[5, 7], [4, 3], [3, 3], [3], [], [0, 4]]
    assert group_layout(3, 2) == (7, [1, 3, 5])  # sender 0, then 2 workers per engine
    payload = worker_payload("10.0.0.1", 29511, 3, 7, 2**20)  # vLLM's worker init info
    assert payload["master_address"] == "10.0.0.1" and payload["master_port"] == 29511
    assert (payload["rank_offset"], payload["world_size"], payload["packed"]) == (3, 7, True)
    assert payload["packed_buffer_size_bytes"] == 2**20 and "nccl_unique_id_b64" not in payload

    address, key = job_env
    results: dict[int, int] = {}
    task = start_engine_task(address, key, 0, results)
    events: queue.Queue = queue.Queue()
    (engine,) = remote.accept_engines(1, "/models/hf", {"engines": 1}, None, events)
    next_event(events, Ready)
    engine.send(Push(1, "keep"))
    engine.put_weights(header)
    engine.put_weights(None)
    assert next_event(events, Header).info == header
    assert next_event(events, Received).tensors == {}
    engine.send(Stop())
    engine.join(timeout=10)
    task.join(timeout=10)
    assert results == {0: 0}


def test_a_remote_engine_that_reconnects_gets_its_lost_requests_exactly_once(job_env, monkeypatch):
    """Remote elasticity without vLLM: the real pool with two scripted engine tasks. Engine
    0's connection dies while it holds requests; its task reconnects (as the generator's
    supervisor does after restarting the engine process); the pool counts a restart and
    resubmits: every sample comes back once."""
    from types import SimpleNamespace

    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.pool import GeneratorPool

    address, key = job_env
    monkeypatch.setenv(wire.CONNECT_TIMEOUT_ENV, "120")
    hf = SimpleNamespace(vocab_size=100, eos_token_id=2)
    links, results, held = {}, {}, []

    def task(index, runner):
        link = serve.connect(address, key, timeout=120)  # the pool imports torch first
        links[index] = link
        results[index] = serve.serve_engine(link, index, runner)
        link.close()

    def silent_runner(index, hf_dir, config, settings, commands, weights_get, events):
        events.put(Ready(index, 64))
        while not isinstance(command := commands.get(), Stop):
            held.extend(command.specs)  # takes requests, never answers

    def answering_runner(index, hf_dir, config, settings, commands, weights_get, events):
        class PoolEvents:  # the scripted runner's test-only events are not for a pool
            def put(self, event):
                if not isinstance(event, (Started, Header, Received)):
                    events.put(event)

        scripted_runner(index, hf_dir, config, settings, commands, weights_get, PoolEvents())

    def start(index, runner):
        thread = threading.Thread(target=task, args=(index, runner), daemon=True)
        thread.start()
        return thread

    tasks = [start(0, silent_runner), start(1, answering_runner)]
    config = RolloutConfig(engines=2, placement="remote", samples_per_prompt=2)
    pool = GeneratorPool("/models/hf", config, text_config=hf)
    try:
        pool.submit([[10, 11], [12], [13]], seeds=[1, 2, 3])
        got, deadline = [], time.monotonic() + 10
        while len(got) + len(held) < 6 and time.monotonic() < deadline:
            got += pool.poll(timeout=0.5)
        assert held and len(got) + len(held) == 6  # engine 0 holds some
        links[0].close()  # engine 0's process dies with its requests
        tasks[0].join(timeout=10)
        assert results[0] == 3  # its end saw the connection go
        deadline = time.monotonic() + 10
        while pool.restarts == 0 and time.monotonic() < deadline:
            got += pool.poll(timeout=0.5)
        assert pool.restarts == 1
        tasks[0] = start(0, answering_runner)  # the supervisor's new engine process
        deadline = time.monotonic() + 20
        while pool.in_flight and time.monotonic() < deadline:
            got += pool.poll(timeout=0.5)
        pairs = sorted((s.prompt_index, s.sample_index) for s in got)
        assert pairs == [(i, j) for i in range(3) for j in range(2)]  # each once
        assert pool.in_flight == 0
    finally:
        pool.close()
    for thread in tasks:
        thread.join(timeout=10)
    assert results == {0: 0, 1: 0}  # both stopped by the pool at the end


def test_the_generator_task_restarts_an_engine_process_killed_by_a_signal_only(monkeypatch):
    """The supervisor's rule: a signal death (-9: SIGKILL, OOM) starts the engine process
    again with the same arguments; an exit status (0 stopped, 1 failed, 3 no trainer ...)
    ends the task with it."""
    from megatron_rl.launch import generator

    started, statuses = [], iter([-9, -11, 3])

    class FakeProcess:
        def __init__(self, command, process_group=None):
            started.append(command)
            self.pid = 10**7 + len(started)  # no such process: killpg finds none

        def wait(self):
            return next(statuses)

    monkeypatch.setattr(generator.subprocess, "Popen", FakeProcess)
    assert generator.supervise(2, ["--engine", "2", "--no-supervise"]) == 3
    assert len(started) == 3 and all(c == started[0] for c in started)
    assert started[0][1:] == [
        "-m",
        "megatron_rl.launch.generator",
        "--engine",
        "2",
        "--no-supervise",
    ]


def test_a_generator_tasks_engine_gets_a_rendezvous_directory_it_owns_and_removes(
    job_env, monkeypatch, tmp_path
):
    """Issue 49 (second GPU reading): a Slurm generator task's engine left vLLM's
    /tmp/vllm_dist_<uuid> behind when the task was SIGKILLed, as engine processes did
    before. Its engine builds vLLM with a rendezvous directory the task owns (locked while
    it lives, removed at exit; a killed task's is removed by the next launcher on the
    node)."""
    import fcntl
    import tempfile

    from megatron_rl.rollout.engine import runner as runner_module
    from megatron_rl.rollout.pool.launchers import ENGINE_LOGS_PREFIX, remove_orphaned_logs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = {}

    def real_runner_double(index, hf_dir, config, settings, commands, weights_get, events, **kw):
        store = kw["store_dir"]
        seen["store"] = store
        fd = os.open(os.path.join(store, ".owner"), os.O_RDONLY)
        try:
            with pytest.raises(OSError):  # held by this task
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert remove_orphaned_logs(str(tmp_path)) == []  # a live task's stays
        scripted_runner(index, hf_dir, config, settings, commands, weights_get, events)

    monkeypatch.setattr(runner_module, "run_engine", real_runner_double)
    address, authkey = job_env
    events: queue.Queue = queue.Queue()
    results: dict = {}
    thread = start_engine_task(address, authkey, 0, results, runner=None)
    (engine,) = remote.accept_engines(1, "/hf", None, None, events)
    engine.send(Stop())
    thread.join(20)
    assert results[0] == 0
    assert os.path.basename(seen["store"]).startswith(ENGINE_LOGS_PREFIX)
    assert os.path.dirname(seen["store"]) == str(tmp_path)
    assert not os.path.exists(seen["store"])  # removed at exit
