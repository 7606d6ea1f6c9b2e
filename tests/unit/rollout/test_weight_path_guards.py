"""GPU-only branches of the weight path, run on CPU up to the CUDA call against the real
library objects: vLLM's NCCL update-info dataclass and packing, the trainer's control
collectives, and a push whose engine dies or fails (the trainer must raise, never hang)."""

from __future__ import annotations

import ast
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.platform import LAUNCHER_VARS
from megatron_rl.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[3]
MIXED_BUCKET = [
    ("model.embed_tokens.weight", torch.randn(5, 7).to(torch.bfloat16)),
    ("model.layers.0.mlp.experts.0.weight", torch.randn(4, 3)),
    ("model.norm.weight", torch.ones(3, dtype=torch.float32)),
    ("lm_head.weight", torch.zeros(0, 4)),
]


def test_every_nccl_header_is_accepted_by_vllms_engine():
    """vLLM's NCCL engine builds its update info with ``**header``: an extra key (we sent
    ``transport``) is a TypeError on every engine."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    from megatron_rl.rollout.weights.nccl import bucket_header

    engine = NCCLWeightTransferEngine.__new__(NCCLWeightTransferEngine)  # no GPU group
    header = bucket_header(MIXED_BUCKET)
    info = engine.parse_update_info(header)  # vLLM's own validation
    assert isinstance(info, NCCLWeightTransferUpdateInfo)
    assert info.names == [n for n, _ in MIXED_BUCKET]
    assert info.dtype_names == ["bfloat16", "float32", "float32", "float32"]
    assert [getattr(torch, d) for d in info.dtype_names] == [t.dtype for _, t in MIXED_BUCKET]


def test_nccl_sender_moves_every_tensor_to_its_device_before_packing():
    """modelopt's exporter hands back host tensors next to CUDA ones; vLLM packs with one
    ``torch.cat`` on the sender's device. Run vLLM's real packing with the sender's
    per-tensor hook, on the meta device standing in for CUDA."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from megatron_rl.rollout.weights.nccl import NcclSender

    sender = NcclSender("127.0.0.1", 1, 2, 2**20, device=torch.device("meta"))
    moved = []

    def hook(item):
        tensor = sender.on_device(item)
        moved.append(tensor.device)
        return tensor

    chunk = pack_tensors(iter(MIXED_BUCKET), hook, 2**20)
    assert moved == [torch.device("meta")] * len(MIXED_BUCKET)
    assert chunk.packed_tensor.device == torch.device("meta")
    assert chunk.packed_tensor.numel() == sum(t.numel() * t.element_size() for _, t in MIXED_BUCKET)


def test_auto_weight_transport_is_nccl_on_gpus_for_engines_with_gpus_of_their_own(monkeypatch):
    """``weight_transport: auto`` (the default) follows the platform layer's one decision,
    mocked where it is made (``get_platform``)."""
    from megatron_rl.platform import Platform, device

    cases = [  # recipe keys, then the transport on a GPU machine and on a CPU one
        ({"placement": "subprocess"}, "nccl", "host"),
        ({"placement": "remote"}, "nccl", "host"),
        ({"placement": "in_process"}, "host", "host"),  # the engine shares the trainer's GPU
        ({"placement": "subprocess", "colocate": True}, "host", "host"),
        ({"placement": "subprocess", "weight_transport": "host"}, "host", "host"),
        ({"placement": "remote", "weight_transport": "nccl"}, "nccl", "nccl"),
    ]
    assert RolloutConfig().weight_transport == "auto"
    for column, platform in enumerate(
        [Platform("cuda", "nccl", False), Platform("cpu", "gloo", False)]
    ):
        monkeypatch.setattr(device, "get_platform", lambda p=platform: p)
        for keys, *expected in cases:
            config = RolloutConfig(**keys)
            config.validate()
            resolved = config.resolved()
            assert resolved.weight_transport == expected[column], (platform.device, keys)
            assert resolved.resolved() == resolved and config.weight_transport == keys.get(
                "weight_transport", "auto"
            )  # the caller's config is left as it was


def test_an_nccl_push_packs_each_header_once_and_vllms_consumers_decode_the_broadcast(
    monkeypatch,
):
    """The pool's NCCL push on CPU up to the NCCL calls, with two engines: each bucket's
    header (vLLM's update info) is made once and reaches both engines, which parse it and
    receive with vLLM's own NCCL engine and packed consumer, while the pool broadcasts the
    tensors once with vLLM's packed producer. Stand-ins: the NCCL communicators (a broadcast
    hands every receiver a copy of what rank 0 sent) and the CUDA device index."""
    import queue
    from types import SimpleNamespace

    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_NUM_BUFFERS

    from megatron_rl.platform import get_platform
    from megatron_rl.rollout.messages import Pushed, Ready
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights.nccl import NcclSender
    from megatron_rl.rollout.weights.senders import TRANSPORTS, Transport

    get_platform()  # on CPU: the torch.cuda stream stand-ins every run has
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    chunk_bytes = 64  # several broadcasts per bucket: both ends must cut them alike
    inboxes: list[queue.Queue] = [queue.Queue(), queue.Queue()]
    sent: list[torch.Tensor] = []
    received: dict[int, tuple[list, list]] = {}
    finished = threading.Event()

    class Wire:  # rank 0's communicator
        def broadcast(self, tensor, src):
            sent.append(tensor.clone())
            for inbox in inboxes:
                inbox.put(tensor.clone())

    class Receiver:  # an engine worker's communicator
        def __init__(self, inbox):
            self.inbox = inbox

        def broadcast(self, tensor, src):
            tensor.copy_(self.inbox.get(timeout=30))

    def engine(index, commands, weights, events):
        worker = NCCLWeightTransferEngine.__new__(NCCLWeightTransferEngine)
        worker.model_update_group, worker.device = Receiver(inboxes[index]), torch.device("cpu")
        worker.packed, worker.packed_buffer_size_bytes = True, chunk_bytes
        worker.packed_num_buffers = DEFAULT_PACKED_NUM_BUFFERS
        headers, loaded = received.setdefault(index, ([], []))
        worker.model = SimpleNamespace(load_weights=lambda ws: loaded.extend(ws))
        version = commands.get(timeout=30).version  # the Push command
        while (header := weights.get(timeout=30)) is not None:
            headers.append(header)
            worker.receive_weights(worker.parse_update_info(header))  # vLLM's validation
        events.put(Pushed(index, version, 0.0, len(loaded), 0, None))
        finished.wait(60)

    events: queue.Queue = queue.Queue()

    def start(count):
        handles = []
        for index in range(count):
            commands, weights = queue.Queue(), queue.Queue(2)
            args = (index, commands, weights, events)
            worker = threading.Thread(target=engine, args=args, daemon=True)
            worker.start()
            events.put(Ready(index, 64))
            handles.append(
                SimpleNamespace(
                    index=index,
                    send=commands.put,
                    put_weights=weights.put,
                    is_alive=worker.is_alive,
                )
            )
        return handles

    engines = SimpleNamespace(events=events, restartable=False, start=start)

    def open_group(config, hf_config, handles, wait_joined):  # the group those two formed
        sender = NcclSender("127.0.0.1", 1, 3, chunk_bytes, device=torch.device("cpu"))
        sender.group = Wire()
        return sender

    nccl = Transport("nccl", TRANSPORTS["nccl"].backend, False, open_group)
    config = RolloutConfig(engines=2, placement="subprocess", push_timeout_seconds=60)
    hf = SimpleNamespace(vocab_size=100, eos_token_id=2)
    # the group is formed of both engines once they are up: this push re-forms nothing
    pool = GeneratorPool("unused", config, launcher=engines, transport=nccl, text_config=hf)
    try:
        stats = pool.push_weights(iter([MIXED_BUCKET[:2], MIXED_BUCKET[2:]]))
    finally:
        finished.set()
    assert stats.version == pool.version == 1 and stats.buckets == 2
    (headers0, loaded0), (headers1, loaded1) = received[0], received[1]
    assert len(headers0) == 2 and all(a is b for a, b in zip(headers0, headers1))  # packed once
    for loaded in (loaded0, loaded1):
        assert [name for name, _ in loaded] == [name for name, _ in MIXED_BUCKET]
        for (_, got), (_, want) in zip(loaded, MIXED_BUCKET):
            assert got.dtype == want.dtype and torch.equal(got, want)
    # the tensors crossed the wire once, in several packed broadcasts, not once per engine
    assert len(sent) > 2
    assert sum(t.numel() for t in sent) == sum(
        t.numel() * t.element_size() for _, t in MIXED_BUCKET
    )


COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list", "barrier",
    "monitored_barrier",
}  # fmt: skip


def test_no_direct_collectives_outside_platform():
    """A collective on a tensor a module built itself lands on the NCCL default group on GPU
    (CPU tensors: 'No backend type associated with device type cpu'): every collective goes
    through ``megatron_rl.platform.collectives``, which picks the group and the device."""
    offenders = []
    for path in sorted((ROOT / "megatron_rl").rglob("*.py")):
        if "platform" in path.relative_to(ROOT / "megatron_rl").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES
                and isinstance(node.func.value, (ast.Name, ast.Attribute))
                and ast.unparse(node.func.value) in ("dist", "torch.distributed")
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_control_collectives_use_a_gloo_twin_of_an_nccl_world(monkeypatch):
    """What the helpers pick on a GPU world, checked with the real torch.distributed calls
    patched at the boundary: host tensors go to the gloo twin, data to the NCCL device."""
    import torch.distributed as dist

    from megatron_rl.platform import collectives

    twin = object()
    calls = []
    monkeypatch.setattr(collectives, "_WORLD_GLOO", twin)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, op=None, group=None: calls.append((t.device, group))
    )
    monkeypatch.setattr(collectives, "group_device", lambda group=None: torch.device("meta"))
    assert collectives.any_rank(False) is False
    assert calls[-1] == (torch.device("cpu"), twin)  # a host flag on the gloo twin
    with pytest.raises(NotImplementedError):  # meta stands in for CUDA: no data to copy back
        collectives.all_reduce(torch.ones(3), group="dp")
    assert calls[-1] == (torch.device("meta"), "dp")  # data on the group's device
    with pytest.raises(ValueError, match="gloo"):
        collectives.control_group("an nccl group")


@pytest.fixture
def engine_process(tiny_hf_dirs):
    from megatron_rl.rollout.pool import GeneratorPool

    config = RolloutConfig(
        placement="subprocess", max_tokens=8, dtype="float32", push_timeout_seconds=60
    )
    pool = GeneratorPool(tiny_hf_dirs["tiny-llama"], config)
    yield pool
    pool.close()


def _buckets_then(action, count: int = 40):
    """Weight buckets; ``action`` runs after the first one is handed out (mid-push)."""
    for i in range(count):
        yield [(f"model.layers.{i}.x", torch.zeros(4096))]
        if i == 0:
            action()


@pytest.mark.timeout(600)  # two engine starts
def test_an_engine_killed_mid_push_is_restarted_and_reweighed(engine_process, tiny_hf_dirs):
    """Elastic engines: the push goes on without the dead engine (noticed at once, not at
    the deadline); the restarted engine takes no request before the trainer re-sent the
    current weights (``reweigh``), then generates with that version."""
    from safetensors.torch import load_file

    pool = engine_process
    pid = pool.engine_handles()[0].pid
    start = time.monotonic()
    stats = pool.push_weights(_buckets_then(lambda: os.kill(pid, signal.SIGKILL)))
    assert time.monotonic() - start < 30
    assert stats.version == pool.version == 1 and pool.restarts == 1
    assert pool.engine_handles()[0].pid != pid
    deadline = time.monotonic() + 180
    while not pool.needs_weights():  # the new engine process starts
        assert time.monotonic() < deadline, "the restarted engine never became ready"
        pool.poll(timeout=0.0)
        time.sleep(0.2)
    weights = load_file(str(Path(tiny_hf_dirs["tiny-llama"]) / "model.safetensors"))
    reweighed = pool.reweigh(iter([list(weights.items())]))
    assert reweighed.version == 1 and not pool.needs_weights()
    samples = pool.generate([[1, 2, 3]], samples_per_prompt=2)
    assert len(samples) == 2 and all(set(s.versions) == {1} for s in samples)


@pytest.mark.timeout(300)
def test_an_engine_failing_during_an_nccl_push_raises_instead_of_hanging(tiny_hf_dirs):
    """The NCCL producer blocks until every engine received the broadcast; an engine that
    fails to take the header never will. The pool watches the engines meanwhile."""
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights.nccl import NcclSender
    from megatron_rl.rollout.weights.senders import TRANSPORTS, Transport

    released = threading.Event()

    class StuckSender(NcclSender):  # vLLM's producer waiting in synchronize() for a receiver
        def send(self, bucket):
            released.wait(120)

        def close(self):
            released.set()

    def open_stuck(config, hf_config, engines, wait_joined):
        return StuckSender("127.0.0.1", 1, 2, 2**20, device=torch.device("meta"))

    # the host transport's engines, which get NCCL headers (NcclSender.pack) that their CPU
    # backend cannot load
    host = TRANSPORTS["host"]
    stuck = Transport(host.name, host.backend, host.joins_at_build, open_stuck)
    config = RolloutConfig(
        placement="subprocess", max_tokens=8, dtype="float32", push_timeout_seconds=60
    )
    pool = GeneratorPool(tiny_hf_dirs["tiny-llama"], config, transport=stuck)
    handle = pool.engine_handles()[0]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="vLLM engine 0 failed"), pool:
        pool.push_weights(iter([MIXED_BUCKET]))
    assert time.monotonic() - start < 60
    # the closing pool ended the push the failed engine waited in: it stopped by itself
    # (it used to wait until the pool gave up on it after 30 s and terminated it)
    assert not handle.is_alive() and handle.exitcode == 0, handle.exitcode


def test_a_push_that_makes_no_progress_times_out():
    """An engine alive but stuck: the deadline (rollout.push_timeout_seconds) raises."""
    from megatron_rl.rollout.pool.pusher import Deadline, WeightPusher
    from megatron_rl.rollout.weights.senders import TRANSPORTS

    config = RolloutConfig(push_timeout_seconds=1)
    closed = []
    pusher = WeightPusher(
        config,
        TRANSPORTS["nccl"],
        None,
        pump=lambda timeout: time.sleep(0.05),  # the engines: alive, saying nothing
        is_current=lambda engine: True,
        closed=lambda: bool(closed),
        close=lambda: closed.append(True),
    )
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="push_timeout_seconds"):
        pusher.watched(lambda: time.sleep(30), Deadline(1), "NCCL broadcast")
    assert time.monotonic() - start < 5


def _registered_after_vllm_plugins() -> bool:
    """In a fresh process: does vLLM's own plugin loading register our CPU backend?"""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    assert "megatron_rl_cpu" not in WeightTransferEngineFactory._registry
    load_general_plugins()  # what every vLLM worker process runs at start
    return "megatron_rl_cpu" in WeightTransferEngineFactory._registry


def test_check_parity_scores_samples_on_the_models_device(megatron_single_rank, monkeypatch):
    """Finding 9: check-parity builds its inputs on the model's device. The real megatron
    model, moved to the meta device standing in for CUDA, runs the forward, the vocab-parallel
    log-softmax and the comparison there; the first thing to fail is the copy of the deltas
    back to the host, which CUDA allows (inputs built on the CPU failed in the forward)."""
    import megatron_rl.models.logprobs as logprobs
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig
    from megatron_rl.rollout.parity import logprob_deltas
    from megatron_rl.rollout.samples import Sample

    model = build_model(ModelConfig(preset="tiny-llama"), ParallelConfig()).eval().to("meta")
    # RoPE's inv_freq is a plain attribute, which .to() leaves behind; on GPU megatron makes
    # it on the CUDA device (or moves it there at the first forward).
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to("meta")
    scored = []
    real = logprobs.token_logprobs

    def recorded(model, tokens, temperature=1.0):
        out = real(model, tokens, temperature)
        scored.append((tokens.device, out.device, tuple(out.shape)))
        return out

    monkeypatch.setattr(logprobs, "token_logprobs", recorded)
    sample = Sample(0, 0, [3, 4, 5], [6, 7, 8], [-1.0, -2.0, -0.5], [1, 1, 1], [True] * 3)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        logprob_deltas(model, [sample])
    meta = torch.device("meta")
    assert scored == [(meta, meta, (1, 5))]  # log-probs of all 6 tokens' successors


def test_ranks_wait_for_the_engines_beyond_the_worlds_timeout_then_fail_naming_rank_0(
    tmp_path,
):
    """Finding 5: rank 0 starts the engines while the other ranks wait at the start-up
    barrier. A wait longer than the world's own timeout (here 1 s, NCCL's 30 min in a run)
    passes; a rank 0 that never arrives fails the others within
    rollout.startup_timeout_minutes, naming rank 0 and the key (it used to wait under the
    world's timeout: monitored_barrier's own timeout binds rank 0 only)."""
    from support.mp_workers import startup_barrier_worker

    from megatron_rl.platform import run_local_ranks

    wait_min = 0.1  # 6 s
    ranks = run_local_ranks(startup_barrier_worker, 2, str(tmp_path), 1.0, 2.5, wait_min)
    (late0, _), (late1, absent1) = ranks
    assert late0 == ("passed", pytest.approx(2.5, abs=1.0))
    assert late1[0] == "passed" and late1[1] > 2.0  # longer than the world's timeout
    message, seconds = absent1
    assert "rank 1: not every rank reached the barrier within " in message, message
    assert "rollout.startup_timeout_minutes (0.1 min)" in message and "rank 0" in message
    assert 5.0 < seconds < 30.0  # the start-up timeout, not a hang
    assert ranks[0][1][0] == "absent"


@pytest.mark.timeout(180)
def test_a_spawned_vllm_process_resolves_the_cpu_backend():
    """The backend is registered through vLLM's ``vllm.general_plugins`` entry point, so a
    spawned (not forked) worker, which never ran our engine code, finds it."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_registered_after_vllm_plugins) is True


def test_engine_gpus_come_after_the_trainers_and_never_overlap_by_accident():
    from megatron_rl.rollout.config import engine_gpus

    cfg = RolloutConfig(placement="subprocess", engines=2, tensor_parallel=1)
    assert engine_gpus(cfg, trainer_gpus=2, gpus_per_node=4) == [2, 3]  # not GPU 0
    tp2 = RolloutConfig(placement="subprocess", engines=1, tensor_parallel=2)
    assert engine_gpus(tp2, trainer_gpus=1, gpus_per_node=4) == [1, 2]
    with pytest.raises(ValueError, match="do not fit beside the 3 trainer GPU.*placement: remote"):
        engine_gpus(cfg, trainer_gpus=3, gpus_per_node=4)
    clash = RolloutConfig(placement="subprocess", gpu_ids=[1, 2], engines=2)
    with pytest.raises(ValueError, match=r"rollout.gpu_ids \[1, 2\] include GPU\(s\) \[1\]"):
        engine_gpus(clash, trainer_gpus=2, gpus_per_node=4)
    shared = RolloutConfig(placement="subprocess", gpu_ids=[1, 2], engines=2, colocate=True)
    assert engine_gpus(shared, trainer_gpus=2, gpus_per_node=4) == [1, 2]
    together = RolloutConfig(placement="subprocess", engines=1, colocate=True)
    assert engine_gpus(together, trainer_gpus=1, gpus_per_node=1) == [0]


@pytest.mark.timeout(300)
def test_gpu_check_smoke_mode_prints_every_section():
    """tools/gpu_check.py, prepared for the lent H200, runs here at tiny sizes."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for section in ("[collectives]", "[train slice]", "[packing]", "[fp32 head]"):
        assert section in proc.stdout, proc.stdout


@pytest.mark.timeout(180)
def test_ranks_wait_for_a_validation_pass_beyond_the_worlds_timeout_then_fail_naming_the_key(
    tmp_path,
):
    """Issue 27, 2.1: rank 0 validates (generation, then scoring) for longer than the
    world's own timeout (here 1.5 s; parallel.timeout_minutes, 30, in a run) while the other
    ranks wait for it. They used to wait in a broadcast on the world's group and failed at
    its timeout, and left before the scoring; now they wait for the whole pass under
    validation.timeout_minutes, and a rank 0 that never answers fails them naming it."""
    from support.mp_workers import validation_wait_worker

    from megatron_rl.platform import run_local_ranks

    wait_min, slow = 0.1, 2.5  # 6 s; generation 2.5 s + scoring 2.5 s, each > 1.5 s
    (rank0, rank1) = run_local_ranks(validation_wait_worker, 2, str(tmp_path), 1.5, slow, wait_min)
    assert rank0 == [("passed", pytest.approx(2 * slow, abs=1.5), 1.0)], rank0
    (outcome, seconds, rate), absent = rank1
    assert outcome == "passed" and seconds > 2 * slow - 0.5, rank1  # the whole pass
    assert rate != rate  # NaN off the main rank
    message, seconds, _ = absent
    assert message.startswith("TimeoutError: rank 1: no answer from rank 0 within ")
    assert "validation.timeout_minutes (0.1 min)" in message, message
    assert 5.0 < seconds < 30.0  # the validation timeout, not a hang
