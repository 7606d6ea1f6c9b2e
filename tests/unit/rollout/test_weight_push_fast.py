"""The weight push's hot path (issue 31, 2): the export stays on the trainer's device (no
host copy), is set up once per model, host buffers are reused push after push, and the next
bucket is built while the current one is sent, with at most two buckets alive."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.conversion.weight_stream import iter_hf_weights
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.weights.buckets import HostSender, unpack_views
from megatron_rl.rollout.weights.push import push_megatron_weights


def _model(hf_dir: str):
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), ParallelConfig())
    load_hf_weights(model, hf_dir, torch.float32)
    return model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_export_of_a_model_on_a_device_never_leaves_it(
    tiny_hf_dirs, megatron_single_rank, name, dtype
):
    """A model whose parameters live on the ``meta`` device stands in for one on a GPU:
    every op of the export (q/k/v and gate/up slicing, Llama-4 expert stacking, casts) works
    on meta tensors, a copy to the host does not ("Cannot copy out of meta tensor"). Every
    bucket tensor must come out on meta, contiguous, with the names and shapes (and the
    body's dtype, FP32 head kept) of the same model's export on the host."""
    model = _model(tiny_hf_dirs[name])
    with torch.no_grad():
        host = [(n, t.shape, t.dtype) for b in iter_hf_weights(model, 2**18, dtype) for n, t in b]
        model.to("meta")
        buckets = list(iter_hf_weights(model, 2**18, dtype))
    tensors = [t for bucket in buckets for _, t in bucket]
    assert len(buckets) > 1
    assert {t.device.type for t in tensors} == {"meta"}
    assert all(t.is_contiguous() for t in tensors)
    assert [(n, t.shape, t.dtype) for b in buckets for n, t in b] == host


def test_the_device_path_packs_the_export_without_a_host_copy(tiny_hf_dirs, megatron_single_rank):
    """The NCCL sender's per-tensor hook leaves tensors already on its device alone (no
    second copy before vLLM's packed broadcast), and vLLM's real packing of a meta-device
    export yields a meta buffer: the whole device path, from shards to the broadcast buffer,
    stays on the device."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from megatron_rl.rollout.weights.nccl import NcclSender

    model = _model(tiny_hf_dirs["tiny-llama4"]).to("meta")
    sender = NcclSender("127.0.0.1", 1, 2, 2**30, device=torch.device("meta"))
    with torch.no_grad():
        bucket = [item for b in iter_hf_weights(model, 2**30) for item in b]
    assert all(sender.on_device(item) is item[1] for item in bucket)  # no copy
    chunk = pack_tensors(iter(bucket), sender.on_device, 2**30)
    assert chunk.packed_tensor.device.type == "meta"
    assert chunk.packed_tensor.numel() == sum(t.numel() * t.element_size() for _, t in bucket)


def test_the_exporter_is_set_up_once_per_model(tiny_hf_dirs, megatron_single_rank, monkeypatch):
    """modelopt's exporter (and the HF config it reads from a directory) is made by the
    first stream of a model only; later streams reuse it and still see the current weights."""
    from modelopt.torch.export.unified_export_megatron import GPTModelExporter

    made = []
    init = GPTModelExporter.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(GPTModelExporter, "__init__", counting)
    model = _model(tiny_hf_dirs["tiny-llama"])
    with torch.no_grad():
        first = {n: t.clone() for b in iter_hf_weights(model) for n, t in b}
        model.decoder.final_layernorm.weight.add_(1.0)
        second = {n: t.clone() for b in iter_hf_weights(model) for n, t in b}
    assert len(made) == 1
    assert torch.equal(second["model.norm.weight"], first["model.norm.weight"] + 1.0)
    assert torch.equal(second["lm_head.weight"], first["lm_head.weight"])


def _bucket(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [
        ("a.weight", torch.full((3, 5), scale)),
        ("b.weight", torch.arange(7, dtype=torch.bfloat16) * scale),
    ]


def test_the_subprocess_host_path_reuses_its_shared_buffers_across_pushes():
    """Two pushes of the same bucket layout go through the same shared-memory storage (no
    new buffer, no new page faults), carrying each push's values; a layout that the latest
    push did not use is freed when the next push begins."""
    sender = HostSender("subprocess")
    first = sender.pack(_bucket(1.0))
    pointer = first["buffer"].data_ptr()
    assert first["buffer"].is_shared()
    second = sender.pack(_bucket(2.0))
    assert second["buffer"].data_ptr() == pointer
    views = unpack_views(
        second["buffer"], second["dtype_names"], second["shapes"], second["offsets"]
    )
    assert torch.equal(views[0], torch.full((3, 5), 2.0))
    assert torch.equal(views[1], torch.arange(7, dtype=torch.bfloat16) * 2.0)
    assert sender.buffers.allocations == 1
    # later pushes have another layout (another bucket size): the old buffer goes
    for _ in range(3):
        sender.pack(_bucket(1.0)[:1])
    assert sender.buffers.allocations == 2
    assert len(sender.buffers._buffers) == 1


class _Recorder:
    """A stream of ``count`` buckets that records when each is built and given up."""

    def __init__(self, count: int, build_seconds: float = 0.0) -> None:
        self.count, self.build_seconds = count, build_seconds
        self.started = [threading.Event() for _ in range(count)]
        self.built = 0
        self.given_up = 0
        self.most_alive = 0
        self.threads: set[str] = set()

    def stream(self):
        for index in range(self.count):
            self.started[index].set()
            self.threads.add(threading.current_thread().name)
            time.sleep(self.build_seconds)
            self.built += 1
            self.most_alive = max(self.most_alive, self.built - self.given_up)
            yield [(f"t{index}", torch.full((2,), float(index)))]


def test_prefetch_builds_the_next_bucket_while_the_current_one_is_sent_with_two_alive():
    from megatron_rl.rollout.weights.push import prefetched

    recorder = _Recorder(6, build_seconds=0.01)
    order = []
    for index, bucket in enumerate(prefetched(recorder.stream())):
        order.append(bucket[0][0])
        if index + 1 < recorder.count:  # overlap: bucket n+1 is begun while n is held
            assert recorder.started[index + 1].wait(5.0), f"bucket {index + 1} not begun"
        time.sleep(0.02)  # "sending": the helper could run ahead if it were not bounded
        assert recorder.built - recorder.given_up <= 2
        recorder.given_up += 1
    assert order == [f"t{i}" for i in range(6)]
    assert recorder.most_alive == 2  # the bound is reached and never exceeded
    assert recorder.threads == {"weight-prefetch"}


def test_prefetch_raises_the_streams_error_and_stops_when_closed():
    from megatron_rl.rollout.weights.push import prefetched

    def failing():
        yield [("t0", torch.zeros(1))]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        list(prefetched(failing()))
    recorder = _Recorder(100)
    buckets = prefetched(recorder.stream())
    next(buckets)
    buckets.close()
    deadline = time.monotonic() + 5.0
    while any(t.name == "weight-prefetch" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the prefetch helper did not stop"
        time.sleep(0.01)
    assert recorder.built <= 2


class _Pool:
    """The pool's side of a push: takes each bucket, then "sends" it (a short wait)."""

    config = RolloutConfig(weight_bucket_mb=3)

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        self.overlapped = []

    def push_weights(self, buckets, between=None):
        for index, _ in enumerate(buckets):
            nxt = index + 1
            self.overlapped.append(nxt >= self.recorder.count or self.recorder.started[nxt].wait(5))
            self.recorder.given_up += 1
        return "stats"


def test_push_megatron_weights_overlaps_building_and_sending(monkeypatch):
    recorder = _Recorder(4)
    seen = {}

    def stream(model, bucket_bytes, dtype=None):
        seen["bucket_bytes"] = bucket_bytes
        return recorder.stream()

    monkeypatch.setattr("megatron_rl.rollout.weights.push.iter_hf_weights", stream)
    pool = _Pool(recorder)
    assert push_megatron_weights(pool, model=None) == "stats"
    assert pool.overlapped == [True] * 4
    assert seen["bucket_bytes"] == 3 * 2**20  # the pool's rollout.weight_bucket_mb
    assert recorder.most_alive <= 2


def test_bucket_size_defaults_by_platform_and_bad_values_name_the_key(tmp_path):
    unset = RolloutConfig()
    assert unset.weight_bucket_mb is None
    assert unset.weight_bucket_bytes_on(gpu=True) == 1024 * 2**20
    assert unset.weight_bucket_bytes_on(gpu=False) == 256 * 2**20
    assert unset.weight_bucket_bytes == 256 * 2**20  # this machine has no GPU
    assert RolloutConfig(weight_bucket_mb=64).weight_bucket_bytes_on(gpu=True) == 64 * 2**20
    from pathlib import Path

    tiny = Path(__file__).resolve().parents[3] / "recipes" / "tiny_cpu.yaml"
    assert load_run_config(tiny, ["rollout.weight_bucket_mb=512"]).rollout.weight_bucket_mb == 512
    for bad in ("0", "-4", "1.5", "big"):
        with pytest.raises(ConfigError) as err:
            load_run_config(tiny, [f"rollout.weight_bucket_mb={bad}"])
        assert "rollout.weight_bucket_mb" in str(err.value), str(err.value)


@pytest.mark.gpu
def test_on_a_gpu_the_export_stays_on_the_device_and_host_buffers_are_pinned(tiny_hf_dirs):
    """The real device path: a CUDA model's export is CUDA tensors (no host copy); the host
    path's buffers are pinned (shared ones registered with CUDA) and carry the values."""
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, host_buffer, init_distributed

    init_distributed(ParallelConfig())
    hf_dir = tiny_hf_dirs["tiny-llama"]
    config = ModelConfig(hf_path=hf_dir, dtype="float32", layer_spec="local")
    model = build_model(config, ParallelConfig())
    load_hf_weights(model, hf_dir, torch.float32)
    with torch.no_grad():
        bucket = [item for b in iter_hf_weights(model, 2**30) for item in b]
    assert {t.device.type for _, t in bucket} == {"cuda"}
    assert host_buffer(1024).is_pinned() and host_buffer(1024, shared=True).is_pinned()
    update = HostSender("subprocess").pack(bucket)
    views = unpack_views(
        update["buffer"], update["dtype_names"], update["shapes"], update["offsets"]
    )
    assert all(torch.equal(v, t.cpu()) for v, (_, t) in zip(views, bucket))
