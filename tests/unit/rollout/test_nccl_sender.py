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
