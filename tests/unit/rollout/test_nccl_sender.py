"""The trainer's NCCL weight sender on the pool's helper threads (issue 27, 2.7)."""

from __future__ import annotations

import threading

import torch


def test_the_nccl_sender_makes_its_device_current_on_the_helper_thread(monkeypatch):
    """The pool runs ``connect`` and ``send`` on helper threads (``WeightPusher.watched``),
    whose current CUDA device is 0 whatever the main thread set; vLLM's communicator is
    made on the current device and PyNccl asserts tensors are on it. The sender makes its
    own device (the main thread's cuda:LOCAL_RANK, here 3) current in that thread first.
    Stand-ins: the platform hook (records a per-thread current device, CUDA's semantics),
    vLLM's rendezvous and packed producer (record the device current when called)."""
    import vllm.distributed.weight_transfer.nccl_common as nccl_common
    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    import megatron_rl.platform.device as platform_device
    from megatron_rl.rollout.weights.nccl import NcclSender

    current = threading.local()  # each thread starts on device 0, as CUDA's threads do
    made_current = []

    def set_thread_device(device: torch.device) -> None:
        made_current.append((threading.current_thread().name, device))
        current.device = device

    def current_device() -> torch.device:
        return getattr(current, "device", torch.device("cuda", 0))

    calls = []

    def trainer_init(info, rank=0):
        calls.append(("connect", threading.current_thread().name, current_device()))
        return object()

    def producer(iterator, group, src, post_iter_func, buffer_size_bytes):
        calls.append(("send", threading.current_thread().name, current_device()))
        list(iterator)

    monkeypatch.setattr(platform_device, "set_thread_device", set_thread_device, raising=False)
    monkeypatch.setattr(nccl_common, "trainer_init", trainer_init)
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", producer)
    rank_device = torch.device("cuda", 3)  # the main thread's cuda:LOCAL_RANK
    sender = NcclSender("127.0.0.1", 29500, 3, 2**20, device=rank_device)
    bucket = [("w", torch.zeros(2))]
    for name, fn in (
        ("connect-thread", sender.connect),
        ("send-thread", lambda: sender.send(bucket)),
    ):
        worker = threading.Thread(target=fn, name=name)
        worker.start()
        worker.join()
    assert calls == [
        ("connect", "connect-thread", rank_device),
        ("send", "send-thread", rank_device),
    ]
    assert made_current == [("connect-thread", rank_device), ("send-thread", rank_device)]


def test_set_thread_device_is_a_no_op_for_the_cpu():
    from megatron_rl.platform import set_thread_device

    set_thread_device(torch.device("cpu"))  # no CUDA call on a CPU machine


class _Stream:
    """A CUDA stream as the device sees it: the operations queued on it, in order."""

    def __init__(self, name: str) -> None:
        self.name, self.ops = name, []

    def wait_event(self, event: _Event) -> None:
        self.ops.append(("wait", event))

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return self.name


class _Event:
    """A CUDA event: the position in its stream's queue where it was recorded."""

    def record(self, stream: _Stream) -> None:
        self.stream, self.position = stream, len(stream.ops)


def _fake_cuda(monkeypatch):
    """CUDA's stream semantics on CPU, by thread: every thread starts on the device's default
    stream; ``torch.cuda.stream(s)`` makes ``s`` current in the block. The platform layer is
    told it runs on a GPU; vLLM's packed producer runs unchanged on these streams."""
    import contextlib

    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    import megatron_rl.platform.device as platform_device

    default = _Stream("default")
    local = threading.local()
    side_streams = []

    def current_stream(*args, **kwargs):
        return getattr(local, "stream", default)

    @contextlib.contextmanager
    def use(stream):
        before = current_stream()
        local.stream = stream
        try:
            yield
        finally:
            local.stream = before

    def new_stream(*args, **kwargs):
        side_streams.append(_Stream(f"side{len(side_streams)}"))
        return side_streams[-1]

    platform = platform_device.Platform("cuda", "nccl", False)
    monkeypatch.setattr(platform_device, "get_platform", lambda: platform)
    monkeypatch.setattr(platform_device, "set_thread_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    packed_tensor._get_streams.cache_clear()  # vLLM caches its side streams per device
    return current_stream


def test_vllms_side_streams_wait_for_the_prefetched_buckets_work(monkeypatch):
    """The prefetch thread builds each bucket on its current stream (the device's default:
    the TP/EP gathers, slicing, ``.contiguous()``, expert transposes); vLLM's
    ``packed_nccl_broadcast_producer`` (the real one) packs (``torch.cat``) and broadcasts it
    on side streams of its own, which wait on no other stream. Before a side stream reads a
    tensor, it must have waited on an event recorded on the builder's stream after that
    tensor's work, and the tensor must be marked as used by the side stream
    (``record_stream``), so that its memory is not reused while the packing is queued."""
    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    from megatron_rl.rollout.weights.nccl import NcclSender
    from megatron_rl.rollout.weights.push import prefetched

    current_stream = _fake_cuda(monkeypatch)
    made: dict[int, tuple[_Stream, int, str]] = {}  # data_ptr -> (stream, position, name)
    recorded: set[tuple[int, str]] = set()  # (data_ptr, stream) of record_stream
    reads: list[tuple[str, str]] = []  # (name, side stream) of every packed tensor
    broadcasts: list[str] = []

    def build(bucket: int, count: int):
        """The bucket's device work, enqueued on the building thread's current stream."""
        out = []
        for i in range(count):
            stream = current_stream()
            tensor = torch.full((4,), float(10 * bucket + i))
            name = f"b{bucket}.t{i}"
            stream.ops.append(("produce", name))
            made[tensor.data_ptr()] = (stream, len(stream.ops) - 1, name)
            out.append((name, tensor))
        return out

    def buckets():
        for b in range(3):
            yield build(b, 3)

    def ordered_before_read(tensor: torch.Tensor) -> str:
        """The producer's work on ``tensor`` is ordered before the current stream's next op."""
        stream = current_stream()
        producer, position, name = made[tensor.data_ptr()]
        assert stream is not producer, "vLLM packs on its side streams"
        waited = [
            op[1]
            for op in stream.ops
            if op[0] == "wait" and op[1].stream is producer and op[1].position > position
        ]
        assert waited, f"{stream} reads {name} without waiting for the stream that made it"
        assert (tensor.data_ptr(), stream.name) in recorded, f"{name}: no record_stream"
        return name

    cat = torch.cat

    def packing_cat(tensors, dim=0):
        if current_stream().name.startswith("side"):
            reads.extend((ordered_before_read(t), current_stream().name) for t in tensors)
        return cat(tensors, dim=dim)

    class Group:
        def broadcast(self, tensor, src):
            assert current_stream().name.startswith("side")
            broadcasts.append(current_stream().name)

    monkeypatch.setattr(torch, "cat", packing_cat)
    monkeypatch.setattr(
        torch.Tensor,
        "record_stream",
        lambda self, stream: recorded.add((self.data_ptr(), stream.name)),
    )
    sender = NcclSender("127.0.0.1", 29500, 2, 16, device=torch.device("cpu"))
    sender.group = Group()
    sent, errors = [], []

    def send(bucket) -> None:
        try:
            sender.send(bucket)
        except BaseException as err:  # noqa: BLE001 - asserted on the test's thread
            errors.append(err)

    try:
        for bucket in prefetched(buckets()):
            worker = threading.Thread(target=send, args=(bucket,), name="weight-send")
            worker.start()  # as the pool does: on a helper thread
            worker.join()
            assert not errors, errors[0]
            sent.append([name for name, _ in bucket])
    finally:
        packed_tensor._get_streams.cache_clear()  # no fake stream outlives the test
    assert sent == [[f"b{b}.t{i}" for i in range(3)] for b in range(3)]
    # every tensor was packed (read) on a side stream, after its wait; then broadcast there
    assert sorted(name for name, _ in reads) == sorted(n for names in sent for n in names)
    assert len(broadcasts) >= 3 and {s for _, s in reads} <= set(broadcasts)


def test_stream_ordering_is_a_no_op_on_the_cpu():
    """On CPU nothing runs asynchronously: no event, no wait, no ``record_stream`` (which a
    CPU tensor would refuse)."""
    from megatron_rl import platform

    assert platform.record_event() is None
    platform.wait_event(None)
    platform.keep_for_stream(torch.zeros(2))
