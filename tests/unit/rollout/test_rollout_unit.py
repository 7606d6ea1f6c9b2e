"""Rollout logic without a vLLM engine: config checks, interruption, versions, bucket packing.

The runner is driven by a scripted fake engine whose token at absolute position ``p`` of a
sequence is ``script(prompt, p)``, so every expected response is written down by hand.
"""

from __future__ import annotations

import collections
import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_rl.rollout.config import InterruptionConfig, RolloutConfig
from megatron_rl.rollout.engine.interruption import (
    InterruptionPolicy,
    count_subsequence,
    find_subsequence,
)
from megatron_rl.rollout.engine.runner import EngineRunner
from megatron_rl.rollout.engine.vllm_engine import TokenDelta
from megatron_rl.rollout.messages import (
    Push,
    Pushed,
    RequestSpec,
    RunnerSettings,
    SamplesDone,
    Stop,
    Submit,
)

TEXT = (90, 91, 92)  # interruption text
CLOSE = (70, 71)  # think-close marker (two tokens: it can straddle a step boundary)
STOP = 2


class FakeEngine:
    """One token per request per step: ``script(prompt_ids, absolute_position)``. With
    ``routing``, a finished or aborted request returns routed-expert rows ``[positions, 2, 1]``
    for the positions it processed (all but its last token): layer 0 dense (0), layer 1
    ``routing(request number, position)``."""

    def __init__(self, script, max_model_len: int = 1000, routing=None) -> None:
        self.script = script
        self.routing = routing
        self.max_model_len = max_model_len
        self.active: dict[str, list] = {}
        self.added: list[tuple[str, list[int], int]] = []
        self.aborted: list[str] = []
        self.loaded: list = []

    def add(
        self,
        request_id,
        prompt_ids,
        max_tokens,
        temperature,
        top_p,
        stop,
        cache_salt=None,
        seed=None,
    ):
        self.added.append((request_id, list(prompt_ids), max_tokens))
        self.active[request_id] = [list(prompt_ids), 0, max_tokens, stop]

    def abort(self, request_ids):
        rows = {rid: self._rows(rid) for rid in request_ids if self.routing}
        for rid in request_ids:
            self.aborted.append(rid)
            del self.active[rid]
        return rows

    def _rows(self, rid) -> np.ndarray:
        prompt, count = self.active[rid][:2]
        number = [a[0] for a in self.added].index(rid)
        rows = np.zeros((len(prompt) + count - 1, 2, 1), dtype=np.uint8)
        rows[:, 1, 0] = [self.routing(number, p) for p in range(len(rows))]
        return rows

    def has_work(self) -> bool:
        return bool(self.active)

    def step(self) -> list[TokenDelta]:
        deltas = []
        for rid, state in list(self.active.items()):
            prompt, count, max_tokens, stop = state
            token = self.script(prompt, len(prompt) + count)
            state[1] = count = count + 1
            reason = "stop" if token in stop else ("length" if count >= max_tokens else None)
            rows = self._rows(rid) if reason and self.routing else None
            if reason:
                del self.active[rid]
            deltas.append(TokenDelta(rid, [token], [-0.25], reason is not None, reason, rows))
        return deltas

    def load_weights(self, updates, kv_on_push="keep"):
        self.loaded.extend(updates)
        return len(self.loaded), 0


def make_runner(script, max_model_len=1000, answer_budget=5, routing=None):
    events = queue.Queue()
    settings = RunnerSettings((STOP,), TEXT, CLOSE, answer_budget)
    engine = FakeEngine(script, max_model_len, routing)
    return EngineRunner(0, engine, settings, events), engine, events


def run_to_end(runner, engine, events):
    while engine.has_work():
        runner.step()
    return drain(events)


def drain(events):
    samples = []
    while not events.empty():
        event = events.get()
        if isinstance(event, SamplesDone):
            samples += event.samples
    return samples


def spec(prompt, budget, max_tokens=30, index=0, problem=None):
    return RequestSpec(index, 0, tuple(prompt), max_tokens, 1.0, 1.0, budget, problem=problem)


def counting(prompt, pos):
    """Tokens 10, 11, 12 ... by absolute position (never the marker, the text or STOP)."""
    return 10 + pos % 50


def test_interrupted_sample_gets_the_text_once_after_the_cut_and_an_answer_budget():
    runner, engine, events = make_runner(counting, answer_budget=5)
    runner.submit(spec([1, 2, 3], budget=7, max_tokens=30))
    (sample,) = run_to_end(runner, engine, events)
    think = [counting(None, p) for p in range(3, 10)]  # positions 3..9: the 7 budget tokens
    answer_start = 3 + 7 + len(TEXT)
    answer = [counting(None, p) for p in range(answer_start, answer_start + 5)]
    assert sample.response_ids == think + list(TEXT) + answer
    assert sample.interrupted and sample.finish_reason == "length"
    assert sample.mask == [True] * 7 + [False] * 3 + [True] * 5
    assert sample.logprobs == [-0.25] * 7 + [0.0] * 3 + [-0.25] * 5
    assert count_subsequence(sample.response_ids, TEXT) == 1
    assert len(sample) == 7 + len(TEXT) + 5
    # the thinking request was cut at exactly the budget; the answer continues the sequence
    first, second = engine.added
    assert first[1] == [1, 2, 3] and engine.aborted == [first[0]]
    assert second[1] == [1, 2, 3, *think, *TEXT] and second[2] == 5


def test_sample_that_closes_its_thinking_is_untouched():
    def closes(prompt, pos):  # marker at positions 6, 7 (response tokens 3 and 4)
        return {6: CLOSE[0], 7: CLOSE[1]}.get(pos, counting(prompt, pos))

    runner, engine, events = make_runner(closes)
    runner.submit(spec([1, 2, 3], budget=7, max_tokens=20))
    (sample,) = run_to_end(runner, engine, events)
    assert sample.response_ids == [closes(None, p) for p in range(3, 23)]
    assert not sample.interrupted and sample.finish_reason == "length"
    assert all(sample.mask) and len(engine.added) == 1 and not engine.aborted


def test_marker_straddling_the_budget_does_not_count_as_closed():
    def late(prompt, pos):  # marker at response tokens 6, 7: completes after a budget of 7
        return {9: CLOSE[0], 10: CLOSE[1]}.get(pos, counting(prompt, pos))

    runner, engine, events = make_runner(late, answer_budget=2)
    runner.submit(spec([1, 2, 3], budget=7))
    (sample,) = run_to_end(runner, engine, events)
    assert sample.interrupted
    assert sample.response_ids[:7] == [late(None, p) for p in range(3, 10)]
    assert sample.response_ids[7:10] == list(TEXT)


def test_stop_token_at_the_budget_ends_the_sample_without_interruption():
    def stops(prompt, pos):
        return STOP if pos == 3 + 6 else counting(prompt, pos)  # 7th response token

    runner, engine, events = make_runner(stops)
    runner.submit(spec([1, 2, 3], budget=7))
    (sample,) = run_to_end(runner, engine, events)
    assert sample.finish_reason == "stop" and not sample.interrupted
    assert sample.response_ids[-1] == STOP and len(sample) == 7


def test_no_budget_means_no_interruption_and_max_model_len_caps_every_request():
    runner, engine, events = make_runner(counting, max_model_len=12, answer_budget=50)
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=30, index=0))
    runner.submit(spec([1, 2, 3], budget=4, max_tokens=30, index=1))
    plain, cut = sorted(run_to_end(runner, engine, events), key=lambda s: s.prompt_index)
    assert len(plain) == 12 - 3 and not plain.interrupted
    # 3 prompt + 4 thinking + 3 text leave 2 positions for the answer
    assert cut.interrupted and len(cut) == 4 + 3 + 2 and cut.finish_reason == "length"


def test_tokens_after_a_push_carry_the_new_version():
    runner, engine, events = make_runner(counting)
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=10))
    for _ in range(4):
        runner.step()
    assert runner.status() == {"version": 0, "requests": 1, "tokens": 4, "oldest_version": 0}
    buckets = collections.deque([{"names": ["w"]}, None])
    runner.push(1, "keep", buckets.popleft)
    assert engine.loaded == [{"names": ["w"]}]
    pushed = events.get()
    assert isinstance(pushed, Pushed) and pushed.version == 1 and pushed.oldest == 0
    (sample,) = run_to_end(runner, engine, events)
    assert sample.versions == [0] * 4 + [1] * 6
    assert runner.oldest_version() is None


def test_an_engine_generates_until_the_pushs_first_bucket_arrives():
    """A push does not pause the engine when it is announced: the engine steps on with the old
    weights until the first bucket is in its weights queue, then loads and goes on."""
    runner, engine, events = make_runner(counting)
    commands, weights = queue.Queue(), queue.Queue()
    commands.put(Submit((spec([1, 2, 3], budget=None, max_tokens=12),)))
    commands.put(Push(1, "keep"))
    step, steps = engine.step, []

    def step_and_deliver():
        steps.append(1)
        if len(steps) == 5:  # the trainer's bucket arrives during the 5th step
            weights.put({"names": ["w"]})
            weights.put(None)
        return step()

    engine.step = step_and_deliver
    serving = threading.Thread(target=runner.serve, args=(commands, weights.get), daemon=True)
    serving.start()
    try:
        kinds = [events.get(timeout=30) for _ in range(2)]
    finally:
        commands.put(Stop())
        serving.join(10)
    pushed, done = kinds
    assert (pushed.engine, pushed.version) == (0, 1) and engine.loaded == [{"names": ["w"]}]
    (sample,) = done.samples
    assert sample.versions == [0] * 5 + [1] * 7


def test_fanout_feeds_every_engine_while_one_engine_takes_nothing():
    """Each item goes to every engine's queue on a lane of its own: an engine whose queue is
    full (it takes nothing) does not hold the others up, and all get the same objects."""
    from megatron_rl.rollout.pool.fanout import Fanout

    stuck, free = queue.Queue(maxsize=2), queue.Queue()
    engines = [
        SimpleNamespace(index=0, put_weights=stuck.put),
        SimpleNamespace(index=1, put_weights=free.put),
    ]
    items, waited = [object() for _ in range(4)], []
    with Fanout(engines, waited.append) as lanes:
        for item in items:  # engine 0: two in its queue, one being delivered, one in the lane
            lanes.put(item)
        got = [free.get(timeout=30) for _ in items]
    assert all(a is b for a, b in zip(got, items)) and stuck.qsize() == 2
    assert set(waited) <= {0}  # only ever waited for the stuck engine


def test_fanout_raises_a_lanes_failure_on_the_callers_thread():
    from megatron_rl.rollout.pool.fanout import Fanout

    class Gone:
        def put(self, item, timeout=None):
            raise ConnectionError("generator engine 1: connection lost")

    live = queue.Queue()
    engines = [
        SimpleNamespace(index=0, put_weights=live.put),
        SimpleNamespace(index=1, put_weights=Gone().put),
    ]
    with Fanout(engines, lambda index: None) as lanes:
        lanes.put("bucket")
        with pytest.raises(ConnectionError, match="engine 1: connection lost"):
            lanes.finish()
    assert live.get(timeout=5) == "bucket"


def test_interrupted_sample_routing_is_the_thinking_requests_up_to_the_cut_then_the_answers():
    runner, engine, events = make_runner(
        counting, answer_budget=5, routing=lambda r, p: 100 * r + p
    )
    runner.submit(spec([1, 2, 3], budget=7, max_tokens=30, index=0))
    runner.submit(spec([4, 5], budget=None, max_tokens=4, index=1))
    cut, plain = sorted(run_to_end(runner, engine, events), key=lambda s: s.prompt_index)
    assert cut.interrupted and not plain.interrupted
    # request 0 (thinking) processed positions 0..8 (3 prompt + 6 of its 7 tokens: aborted
    # when the 7th came) and the sample keeps them. The answer request (number 2) prefilled
    # 0..12 (with the interruption text) and decoded: positions 9..16 are its own.
    sequence = len(cut.prompt_ids) + len(cut)
    assert cut.routed_experts.shape == (sequence - 1, 2, 1)
    expected = list(range(9)) + [200 + p for p in range(9, sequence - 1)]
    assert cut.routed_experts[:, 1, 0].tolist() == expected
    assert not cut.routed_experts[:, 0].any()
    assert plain.routed_experts[:, 1, 0].tolist() == [100 + p for p in range(2 + 4 - 1)]


def test_recorder_files_rows_by_position_and_keeps_the_first_routing():
    from megatron_rl.rollout.engine.routing import RoutingRecorder

    recorder = RoutingRecorder(num_layers=3, topk=2, num_experts=8)

    def step(ids, layout, positions):  # layer 1 routes every token to (position, 7)
        recorder.begin_step()
        topk = torch.tensor([[p % 7, 7] for p in positions])
        recorder.capture(1, topk)
        recorder.end_step(ids, np.array(layout), torch.tensor(positions))

    step(["a-x1y2z3w4", "b-00000000"], [0, 3, 5], [0, 1, 2, 0, 1])  # prefill a (3), b (2)
    step(["b-00000000", "a-x1y2z3w4"], [0, 1, 2], [2, 3])  # decode: one token each
    recorder.begin_step()  # b is recomputed (preempted) from 0 with a new routing: kept out
    recorder.capture(1, torch.tensor([[1, 2]] * 4))
    recorder.end_step(["b-00000000"], np.array([0, 4]), torch.tensor([0, 1, 2, 3]))
    a, b = recorder.take("a"), recorder.take("b")
    assert a.dtype == np.uint8 and a.shape == (4, 3, 2)
    assert a[:, 1].tolist() == [[0, 7], [1, 7], [2, 7], [3, 7]] and not a[:, [0, 2]].any()
    assert b[:, 1].tolist() == [[0, 7], [1, 7], [2, 7], [1, 2]]  # position 3 is new
    assert recorder.take("a").shape == (0, 3, 2)  # taken: forgotten
    with pytest.raises(RuntimeError, match="prefix caching"):
        step(["c-00000000"], [0, 2], [5, 6])  # positions 0..4 never computed


def test_budget_draws_are_uniform_over_the_inclusive_range_and_seeded():
    config = InterruptionConfig(enabled=True, thinking_budget=(5, 8), text="ab", think_close="c")
    policy = InterruptionPolicy.from_config(config, lambda s: [ord(c) for c in s])
    draws = [policy.draw_budget() for _ in range(4000)]
    counts = collections.Counter(draws)
    assert set(counts) == {5, 6, 7, 8}
    assert all(abs(c / 4000 - 0.25) < 0.04 for c in counts.values())
    again = InterruptionPolicy.from_config(config, lambda s: [ord(c) for c in s])
    assert [again.draw_budget() for _ in range(50)] == draws[:50]
    assert policy.text_ids == (97, 98) and policy.close_ids == (99,)
    assert policy.max_response_tokens(8) == 8 + 2 + config.answer_budget


def test_subsequence_search():
    assert find_subsequence([1, 2, 3, 2, 3], [2, 3]) == 1
    assert find_subsequence([1, 2, 3, 2, 3], [2, 3], start=2) == 3
    assert find_subsequence([1, 2], [2, 3]) == -1
    assert count_subsequence([7, 7, 7], [7, 7]) == 2


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"engines": 0}, "engines"),
        ({"placement": "cloud"}, "placement"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"kv_on_push": "drop"}, "kv_on_push"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ({"dtype": "int8"}, "dtype"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"engines": 2, "gpu_ids": [0, 1, 2]}, "gpu_ids"),
        ({"weight_transport": "rdma"}, "weight_transport"),
        ({"weight_transport": "nccl"}, "placement"),  # in_process: engines share our GPU
        ({"weight_transport": "nccl", "placement": "subprocess", "colocate": True}, "colocate"),
        ({"push_timeout_seconds": 0}, "push_timeout_seconds"),
        ({"startup_timeout_minutes": -1}, "startup_timeout_minutes"),
        ({"return_routed_experts": True, "enforce_eager": False}, "enforce_eager"),
        ({"interruption": InterruptionConfig(thinking_budget=(9, 3))}, "thinking_budget"),
        ({"interruption": InterruptionConfig(answer_budget=0)}, "answer_budget"),
        (
            {"max_tokens": 100, "interruption": InterruptionConfig(enabled=True)},
            "thinking_budget",
        ),
    ],
)
def test_config_errors_name_the_field(changes, field):
    config = RolloutConfig(**changes)
    with pytest.raises(ValueError, match=field):
        config.validate()


def test_rollout_config_imports_no_torch():
    import subprocess
    import sys

    code = "import megatron_rl.rollout.config, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_shared_buffer_roundtrip_is_exact_for_mixed_dtypes():
    from megatron_rl.rollout.weights.buckets import shared_update, tensors_update

    gen = torch.Generator().manual_seed(0)
    bucket = [
        ("a", torch.randn(3, 5, generator=gen)),
        ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("c", torch.arange(11, dtype=torch.int64).view(11, 1)),
        ("d", torch.randn(2, 3, 4, generator=gen).double()),
    ]
    update = shared_update(bucket)
    assert update["buffer"].is_shared()
    assert all(offset % 64 == 0 for offset in update["offsets"])
    from megatron_rl.rollout.weights.cpu_backend import CpuTransferUpdateInfo

    unpacked = CpuTransferUpdateInfo(**update).weights()
    assert [n for n, _ in unpacked] == ["a", "b", "c", "d"]
    for (_, ref), (_, got) in zip(bucket, unpacked):
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref)
    direct = CpuTransferUpdateInfo(**tensors_update(bucket)).weights()
    assert all(
        got is not ref and got.data_ptr() == ref.data_ptr()
        for (_, ref), (_, got) in zip(bucket, direct)
    )  # no copy in-process


def test_cpu_engine_workers_get_a_core_each(tiny_hf_dirs, monkeypatch):
    from megatron_rl.rollout.engine import vllm_engine as engine
    from megatron_rl.rollout.pool import GeneratorPool

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 6, 7})
    assert engine.cpu_worker_binding(2) == "0,1,2,3|4,6,7"
    assert engine.cpu_worker_binding(3) == "0,1,2|3,4|6,7"
    with pytest.raises(ValueError, match="rollout.tensor_parallel 8: .* may use 7"):
        GeneratorPool(tiny_hf_dirs["tiny-llama"], RolloutConfig(tensor_parallel=8))
    with pytest.raises(ValueError, match="rollout.gpu_ids need GPUs"):
        GeneratorPool(tiny_hf_dirs["tiny-llama"], RolloutConfig(gpu_ids=[0]))


def test_pushes_do_not_print_the_rotary_embeddings_expected_reload_warning():
    """vLLM's layerwise reload warns for every layer without weights in an update; rotary
    embeddings never have any (their cache comes from the config): quiet for them alone."""
    import logging

    from vllm.model_executor.model_loader.reload import layerwise

    from megatron_rl.rollout.engine.vllm_engine import _quiet_expected_reload_warnings

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    layerwise.logger.addHandler(handler)
    try:
        _quiet_expected_reload_warnings()
        _quiet_expected_reload_warnings()  # once per engine: one filter
        for layer in ("RotaryEmbedding", "ParallelLMHead"):
            layerwise.logger.warning("%s: Failed to load weights", layer)
    finally:
        layerwise.logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["ParallelLMHead: Failed to load weights"]


def test_rollout_never_imports_launch():
    """``launch`` builds on ``rollout``, never the reverse (issue 13): every import under
    megatron_rl/rollout, lazy ones inside functions included."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "megatron_rl" / "rollout"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                parts = [node.module] if node.module else []
                if node.level:  # relative to this file's package
                    package = ["megatron_rl", "rollout", *path.relative_to(root).parts[:-1]]
                    parts = package[: len(package) - node.level + 1] + parts
                base = ".".join(parts)
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(n == "megatron_rl.launch" or n.startswith("megatron_rl.launch.") for n in names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.timeout(300)  # ~20 s here
def test_an_in_process_engine_starts_after_the_trainers_process_group_is_made_anew(tiny_hf_dirs):
    """vLLM 0.32 keeps its world group, made over the default process group, after its last
    engine closes. A training run ends by destroying that group (``destroy_distributed``); the
    next in-process engine then failed at start-up ("not initialized in the world group map",
    CI on two workers, where test order differs). It must start, and generate as before."""
    import torch.distributed as dist

    from megatron_rl.platform import ParallelConfig, init_distributed
    from megatron_rl.platform.parallel import destroy_distributed
    from megatron_rl.rollout.engine.vllm_engine import VLLMEngine

    hf_dir = tiny_hf_dirs["tiny-llama"]
    config = RolloutConfig(max_tokens=6, dtype="float32", stop_token_ids=[])

    def greedy_tokens() -> list[int]:
        engine = VLLMEngine(hf_dir, config)
        try:
            engine.add("r", [5, 6, 7, 8], 6, temperature=0.0, top_p=1.0, stop_token_ids=[])
            tokens, done = [], False
            while not done:
                for delta in engine.step():
                    tokens += delta.token_ids
                    done = delta.finished
        finally:
            engine.close()
        return tokens

    first = greedy_tokens()
    init_distributed(ParallelConfig())
    destroy_distributed()  # a run ends
    init_distributed(ParallelConfig())  # the next one begins
    assert greedy_tokens() == first
    assert len(first) == 6
    assert dist.is_initialized()  # closing the engine kept the trainer's group


LAUNCHER_THEN_WAIT = """
import sys, time
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.messages import RunnerSettings
from megatron_rl.rollout.pool.launchers import ProcessLauncher
launcher = ProcessLauncher("unused", RolloutConfig(placement="subprocess"), RunnerSettings(()))
print("LOG_DIR", launcher.log_dir, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)  # one interpreter importing the launcher (~10 s here)
def test_engine_log_directories_of_killed_trainers_are_removed_by_the_next_launcher(
    tmp_path, monkeypatch
):
    """A SIGKILLed trainer never closes its launcher: its megatron_rl_engines_* directory
    stayed in the temporary directory for good. The next launcher removes it, and keeps
    the directory of a launcher that still lives (another job on the node)."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from megatron_rl.platform import LAUNCHER_VARS
    from megatron_rl.rollout.messages import RunnerSettings
    from megatron_rl.rollout.pool.launchers import ProcessLauncher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    killed = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_THEN_WAIT],
        stdout=subprocess.PIPE,
        text=True,
        env={**env, "TMPDIR": str(tmp_path)},
    )
    try:
        while not (line := killed.stdout.readline()).startswith("LOG_DIR"):
            assert line, "the launcher process ended early"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    left = line.split(maxsplit=1)[1].strip()
    assert os.path.isdir(left) and left.startswith(str(tmp_path))

    config, settings = RolloutConfig(placement="subprocess"), RunnerSettings(())
    live = ProcessLauncher("unused", config, settings)
    assert not os.path.exists(left)  # removed when this launcher started
    following = ProcessLauncher("unused", config, settings)
    assert os.path.isdir(live.log_dir)  # alive: kept
    following.close()
    live.close()
    assert not list(tmp_path.glob("megatron_rl_engines_*"))


CALL = 5  # a tool-call format's stop id
PROBLEM = "an episode's problem"
OBSERVATION = (80, 81, 82)  # a tool's output, tokenized once


class ScriptedEpisodes:
    """``EpisodeSteps`` on a real thread pool: every call's observation is ``OBSERVATION``;
    ``gate`` holds the tool calls until set (so that the test can push weights meanwhile)."""

    stop_token_ids = (CALL,)
    stop_strings = ()

    def __init__(self, max_turns: int, end_after: int | None = None) -> None:
        import concurrent.futures

        self.max_turns = max_turns
        self.end_after = end_after  # the environment ends the episode at this call
        self.gate = threading.Event()
        self.turns: list[list[int]] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(2)

    def tool_step(self, spec, sample, turn_ids):
        self.turns.append(list(turn_ids))
        if turn_ids[-1] != CALL:
            return None
        calls = len(self.turns)

        def run():
            self.gate.wait(5)
            return None if calls == self.end_after else list(OBSERVATION)

        return self.pool.submit(run)

    def end(self, spec):
        return [("ok", 0.0)] * sum(t[-1] == CALL for t in self.turns)


def calls_tool(prompt, pos):
    """Every sequence calls the tool at absolute positions 6 and 12 (after 3 and 2 model
    tokens of its turns from prompt [1, 2, 3]) and stops at 19."""
    return {6: CALL, 12: CALL, 19: STOP}.get(pos, counting(prompt, pos))


def recording(engine):
    """Wrap ``engine.step`` to record every token the engine produced, per request."""
    produced = collections.defaultdict(list)
    step = engine.step

    def wrapped():
        deltas = step()
        for d in deltas:
            produced[d.request_id] += d.token_ids
        return deltas

    engine.step = wrapped
    return produced


def make_episode_runner(script, episodes, settings=None, routing=None):
    events = queue.Queue()
    engine = FakeEngine(script, routing=routing)
    runner = EngineRunner(0, engine, settings or RunnerSettings((STOP,)), events, episodes)
    return runner, engine, events


def run_episodes(runner, engine, events):
    """Step until no request generates and no episode waits on its tool; the samples."""
    while runner._tools or engine.has_work():
        runner.step()
    return drain(events)


def test_episode_continues_from_ids_with_tool_tokens_masked_and_model_versions_across_a_push():
    from megatron_rl.rollout.samples import TOOL_VERSION

    episodes = ScriptedEpisodes(max_turns=4)
    runner, engine, events = make_episode_runner(calls_tool, episodes)
    produced = recording(engine)
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=30, problem=PROBLEM))
    other = [4] * 20  # past the script's calls: no call
    runner.submit(spec(other, budget=None, max_tokens=8, index=1))
    for _ in range(4):  # turn 1 of the episode ends on CALL; its tool is held
        runner.step()
    assert len(runner._tools) == 1 and engine.has_work()  # the other request goes on meanwhile
    for _ in range(10):
        runner.step()
    (plain,) = drain(events)  # served while the tool call was pending
    assert plain.prompt_index == 1 and len(plain) == 8 and len(runner._tools) == 1
    weights = queue.Queue()
    weights.put("bucket")
    weights.put(None)
    runner.push(1, "keep", weights.get)  # a push between the turns
    episodes.gate.set()
    (sample,) = run_episodes(runner, engine, events)
    # token-in / token-out: what the engine produced and was given is what the sample holds
    requests = [a for a in engine.added if a[1][:3] == [1, 2, 3]]
    assert [len(r[1]) for r in requests] == [3, 3 + 4 + 3, 3 + 4 + 3 + 3 + 3]
    turns = [produced[r[0]] for r in requests]
    assert turns == [[13, 14, 15, CALL], [20, 21, CALL], [26, 27, 28, STOP]]
    assert episodes.turns == turns[:2]  # the turns that ended on a call went to the tool
    expected = turns[0] + list(OBSERVATION) + turns[1] + list(OBSERVATION) + turns[2]
    assert sample.response_ids == expected
    assert requests[1][1] == [1, 2, 3] + expected[:7]  # resubmitted from all ids so far
    assert requests[2][1] == [1, 2, 3] + expected[:13]
    assert [r[2] for r in requests] == [30, 30 - 7, 30 - 13]  # the budget counts tool tokens
    assert sample.mask == [True] * 4 + [False] * 3 + [True] * 3 + [False] * 3 + [True] * 4
    assert sample.logprobs == [-0.25 if m else 0.0 for m in sample.mask]
    tool = TOOL_VERSION
    assert sample.versions == [0] * 4 + [tool] * 3 + [1] * 3 + [tool] * 3 + [1] * 4
    assert (sample.oldest_version, sample.newest_version) == (0, 1)
    assert sample.finish_reason == "stop"
    assert sample.tools == [("ok", 0.0)] * 2  # the episode's calls, handed over at its end


def test_a_request_without_a_problem_is_single_turn_on_an_engine_that_runs_episodes():
    # validation of a single-turn run, probes, parity: the tool's stop id is not theirs
    episodes = ScriptedEpisodes(max_turns=4)
    episodes.gate.set()
    runner, engine, events = make_episode_runner(calls_tool, episodes)
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=30))
    (sample,) = run_episodes(runner, engine, events)
    assert engine.active == {} and len(engine.added) == 1  # one request, no resubmission
    assert sample.response_ids == [calls_tool(None, p) for p in range(3, 20)]
    assert CALL in sample.response_ids and episodes.turns == [] and sample.tools == []
    assert sample.mask == [True] * 17 and sample.finish_reason == "stop"


def test_episode_ends_at_max_turns_at_the_budget_and_when_the_environment_says_so():
    # max_turns=2: the second CALL ends the episode (no third turn)
    episodes = ScriptedEpisodes(max_turns=2)
    episodes.gate.set()
    runner, engine, events = make_episode_runner(calls_tool, episodes)
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=30, problem=PROBLEM))
    (sample,) = run_episodes(runner, engine, events)
    assert sample.response_ids == [13, 14, 15, CALL, *OBSERVATION, 20, 21, CALL]
    assert sample.finish_reason == "stop" and len(engine.added) == 2

    # a budget of 6: the observation runs past it, the episode is cut at 6 tokens
    runner, engine, events = make_episode_runner(calls_tool, episodes)
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=6, problem=PROBLEM))
    (sample,) = run_episodes(runner, engine, events)
    assert sample.response_ids == [13, 14, 15, CALL, 80, 81]
    assert sample.mask == [True] * 4 + [False] * 2 and sample.finish_reason == "length"
    assert len(engine.added) == 1

    # the environment ends the episode at its first call: the observation is not shown
    ends = ScriptedEpisodes(max_turns=4, end_after=1)
    ends.gate.set()
    runner, engine, events = make_episode_runner(calls_tool, ends)
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=30, problem=PROBLEM))
    (sample,) = run_episodes(runner, engine, events)
    assert sample.response_ids == [13, 14, 15, CALL] and sample.finish_reason == "stop"


@pytest.mark.parametrize("kv_on_push, salts", [("keep", ["v0", "v0"]), ("recompute", ["v0", "v1"])])
def test_an_episode_turn_after_a_push_keeps_its_prefix_cache_salt_while_pushes_keep_kv(
    kv_on_push, salts
):
    """The second turn's request is the first's ids plus the tool's: with kv_on_push keep
    (in-flight requests keep the old weights' KV) it keeps the first turn's salt and hits
    its cached context; a new salt would prefill the whole context again after every push.
    With recompute, the new weights' salt (what a recompute would give)."""
    episodes = ScriptedEpisodes(max_turns=2)
    runner, engine, events = make_episode_runner(calls_tool, episodes)
    seen = []
    add = engine.add

    def recording(request_id, prompt_ids, *args, cache_salt=None, **kwargs):
        seen.append(cache_salt)
        add(request_id, prompt_ids, *args, cache_salt=cache_salt, **kwargs)

    engine.add = recording
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=30, problem=PROBLEM))
    for _ in range(4):  # the first turn ends on CALL; its tool is held
        runner.step()
    weights = queue.Queue()
    weights.put("bucket")
    weights.put(None)
    runner.push(1, kv_on_push, weights.get)
    episodes.gate.set()
    while runner._tools or engine.has_work():
        runner.step()
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=2, index=1))  # a new request
    runner.step()
    assert seen == [*salts, "v1"]


def test_a_tool_call_in_the_answer_phase_after_an_interruption_ends_the_episode():
    """After a forced interruption the model must answer within answer_budget: a call there
    is not run (the tool's output would come on top of the answer budget, and past the
    episode's budget a cut would take the model's last tokens with it)."""
    episodes = ScriptedEpisodes(max_turns=4)
    episodes.gate.set()
    runner, engine, events = make_episode_runner(
        lambda prompt, pos: CALL if pos == 10 else counting(prompt, pos),
        episodes,
        RunnerSettings((STOP,), TEXT, CLOSE, answer_budget=5),
    )
    # thinking: positions 3, 4, 5 (budget 3), the text at 6-8, the answer from position 9
    runner.submit(spec([1, 2, 3], budget=3, max_tokens=30, problem=PROBLEM))
    (sample,) = run_episodes(runner, engine, events)
    assert sample.interrupted and episodes.turns == [] and sample.tools == []
    assert sample.response_ids == [13, 14, 15, *TEXT, 19, CALL]
    assert sample.finish_reason == "stop" and len(engine.added) == 2


def test_episode_routing_is_each_turns_request_and_the_tools_tokens_are_the_next_turns():
    """Routing replay per token of an episode: the rows of a model turn are those its request
    routed them with; the tool's tokens were first processed by the next turn's request (its
    prefill), whose rows the sample takes from there on."""
    episodes = ScriptedEpisodes(max_turns=4)
    episodes.gate.set()
    runner, engine, events = make_episode_runner(
        calls_tool, episodes, routing=lambda r, p: 100 * r + p
    )
    runner.submit(spec([1, 2, 3], budget=None, max_tokens=30, problem=PROBLEM))
    (sample,) = run_episodes(runner, engine, events)
    # requests 0, 1, 2: turn 1 ends at position 6 (CALL), the tool's 3 tokens at 7-9, turn 2
    # ends at 12, the tool at 13-15, turn 3 ends at 19 (STOP). Request r processed its prompt
    # and all but its last token.
    sequence = len(sample.prompt_ids) + len(sample)
    assert sequence == 20 and sample.routed_experts.shape == (sequence - 1, 2, 1)
    expected = list(range(6)) + [100 + p for p in range(6, 12)] + [200 + p for p in range(12, 19)]
    assert sample.routed_experts[:, 1, 0].tolist() == expected


def test_check_parity_nccl_without_gpus_names_its_options_not_a_recipe_key(capsys, monkeypatch):
    """`check-parity --transport nccl` on a machine without GPUs failed on rollout.gpu_ids, a
    key the user never set; it now says what the option needs, in the options' terms."""
    import megatron_rl.platform.device as device
    from megatron_rl.cli import main

    monkeypatch.setattr(device, "local_device_count", lambda: None)
    assert main(["check-parity", "/nonexistent", "--transport", "nccl", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--transport nccl pushes the weights GPU to GPU: it needs 3 GPUs" in err
    assert "this machine has no GPU(s)" in err and "--transport host" in err
    assert "rollout.gpu_ids" not in err and "Traceback" not in err
    monkeypatch.setattr(device, "local_device_count", lambda: 2)  # 2 GPUs: 3 needed
    assert main(["check-parity", "/nonexistent", "--transport", "nccl", "--tp", "2"]) == 2
    assert "this machine has 2 GPU(s)" in capsys.readouterr().err
    assert main(["check-parity", "/nonexistent", "--tp", "0"]) == 2
    assert "--tp and --ep must be >= 1, got 0, 1" in capsys.readouterr().err
