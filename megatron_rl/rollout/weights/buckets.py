"""Buckets of HF-named tensors as update infos of the ``megatron_rl_cpu`` weight transport.

The trainer side of :mod:`megatron_rl.rollout.weights.cpu_backend` (this module does not import vLLM):
a bucket is handed over as the tensors themselves (engine in the same process), copied into
one flat shared-memory buffer (engine in another process), or flattened into raw byte chunks
for a byte stream (remote engine: :mod:`megatron_rl.rollout.wire`). Each form is made once
per bucket and handed to every engine (:class:`HostSender`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_rl.conversion.weight_stream import WeightBucket
from megatron_rl.rollout.weights.experts import (
    ExpertPlacement,
    expert_parallel_update,
    split_bucket,
)

ALIGN = 64  # byte alignment of tensors inside a flat buffer
CPU_BACKEND = "megatron_rl_cpu"  # the vLLM weight-transfer backend of the host transport


class ReadyBucket(list):
    """A bucket built on another thread (:func:`~megatron_rl.rollout.weights.push.prefetched`)
    with ``ready``: the event recorded on that thread's CUDA stream once the bucket was built
    (``platform.record_event``; None on CPU). A sender that reads the tensors on another
    stream makes it wait on ``ready`` first: the gathers, slicing and copies that made them
    may still be queued on the builder's stream."""

    ready: Any = None


def bucket_ready(bucket: WeightBucket) -> Any:
    """The ``ready`` event of a :class:`ReadyBucket`; None for a plain bucket."""
    return getattr(bucket, "ready", None)


class WeightSender(Protocol):
    """The trainer end of a weight transport, chosen once per pool (``rollout.weight_transport``).

    Per bucket, ``pack`` makes what every engine's weights queue gets (once: the same object
    goes to all engines), then ``send`` moves what ``pack`` did not carry (host: nothing;
    NCCL: the tensors, by one broadcast that blocks until every engine received them)."""

    blocking: bool  # whether ``send`` waits on the engines (the pool then watches them)

    def pack(self, bucket: WeightBucket) -> Any: ...

    def send(self, bucket: WeightBucket) -> None: ...

    def close(self) -> None: ...


class HostSender:
    """``weight_transport: host``: the bucket itself goes through the engines' queues, packed
    for the placement: the trainer's tensors (in process), one shared-memory buffer
    (subprocess) or one set of byte chunks streamed to every engine task (remote).

    The shared-memory buffers (and, for device tensors, the host buffers of the byte chunks)
    are the sender's own and reused by every push (:class:`HostBuffers`): a push copies each
    bucket once into memory that is already mapped, instead of allocating, faulting in and
    freeing a new buffer per bucket per push."""

    blocking = False

    def __init__(self, placement: str, experts: ExpertPlacement | None = None) -> None:
        self.buffers = HostBuffers(shared=placement == "subprocess")
        packers = {
            "in_process": tensors_update,
            "subprocess": lambda bucket: shared_update(bucket, self.buffers),
            "remote": lambda bucket: flat_update(bucket, self.buffers),
        }
        self._pack = packers[placement]
        # Expert-parallel engines (rollout.expert_parallel): one part per engine rank, each
        # with only the experts that rank holds. A remote engine's byte stream carries whole
        # buckets (its workers' loaders skip the experts they do not hold).
        self.experts = experts if placement != "remote" else None

    def pack(self, bucket: WeightBucket) -> Any:
        if self.experts is None:
            return self._pack(bucket)
        parts = [self._pack(part) for part in split_bucket(bucket, self.experts)]
        return expert_parallel_update(parts, self.experts)

    def send(self, bucket: WeightBucket) -> None:
        pass

    def close(self) -> None:
        self.buffers.clear()


class HostBuffers:
    """Flat host buffers reused across pushes, one per bucket layout.

    A push streams the same buckets every time (same names, shapes and dtypes, in the same
    order), so the buffer of a bucket is looked up by its layout (:meth:`get`). Reuse is safe
    because pushes do not overlap: a push ends only once every engine has loaded every bucket
    (``Pushed``), and the next push writes a bucket's buffer only after that. Memory: one
    push's worth of buckets (the pushed bytes), kept between pushes. A push is known to begin
    when a layout comes a second time; then the layouts the previous push did not use are
    freed (after a change of bucket size, by the end of the second push). ``shared``: in shared memory (for
    engine processes); pinned on a GPU machine (``platform.host_buffer``)."""

    def __init__(self, shared: bool) -> None:
        self.shared = shared
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._this_push: set[tuple] = set()
        self.allocations = 0  # buffers made so far (the reuse is visible in tests)

    def get(self, layout: dict[str, Any], names: list[str]) -> torch.Tensor:
        """The uint8 buffer of ``layout`` (:func:`_layout`) for the tensors ``names``."""
        key = (tuple(names), tuple(layout["dtype_names"]), tuple(map(tuple, layout["shapes"])))
        if key in self._this_push:  # a new push: drop what the last one did not use
            self._buffers = {k: v for k, v in self._buffers.items() if k in self._this_push}
            self._this_push = set()
        self._this_push.add(key)
        buffer = self._buffers.get(key)
        if buffer is None:
            from megatron_rl.platform import host_buffer

            buffer = self._buffers[key] = host_buffer(layout["total"], shared=self.shared)
            self.allocations += 1
        return buffer

    def clear(self) -> None:
        self._buffers, self._this_push = {}, set()


def tensors_update(bucket: WeightBucket) -> dict[str, Any]:
    """Update info that hands the bucket's own tensors over (engine in this process)."""
    return {"names": [n for n, _ in bucket], "tensors": [t.detach() for _, t in bucket]}


def shared_update(bucket: WeightBucket, buffers: HostBuffers | None = None) -> dict[str, Any]:
    """Update info with the bucket copied into one shared-memory buffer (any process): a new
    one, or ``buffers``' buffer for this bucket's layout (reused push after push).

    The buffer travels through ``torch.multiprocessing`` queues as a file descriptor; a new
    one's memory is freed when the last engine drops it.
    """
    names = [n for n, _ in bucket]
    layout = _layout([t for _, t in bucket])
    if buffers is None:
        from megatron_rl.platform import host_buffer

        buffer = host_buffer(layout["total"], shared=True)
    else:
        buffer = buffers.get(layout, names)
    views = unpack_views(buffer, layout["dtype_names"], layout["shapes"], layout["offsets"])
    for (_, tensor), view in zip(bucket, views):
        view.copy_(tensor.detach(), non_blocking=True)
    _wait_for_copies(bucket)
    return {
        "names": names,
        "buffer": buffer,
        "dtype_names": layout["dtype_names"],
        "shapes": layout["shapes"],
        "offsets": layout["offsets"],
    }


def _wait_for_copies(bucket: WeightBucket) -> None:
    """Device-to-host copies above were asynchronous (pinned buffers): wait before the
    buffer is handed on. Nothing to wait for when every tensor is on the host."""
    devices = {t.device for _, t in bucket if t.device.type not in ("cpu", "meta")}
    for device in devices:
        torch.accelerator.synchronize(device)


def _layout(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Where ``tensors`` go in one flat buffer: ``dtype_names``, ``shapes``, ``offsets``
    (aligned), ``nbytes`` and the buffer's ``total`` bytes."""
    offsets, sizes, total = [], [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        offsets.append(total)
        sizes.append(nbytes)
        total += -(-nbytes // ALIGN) * ALIGN
    return {
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "offsets": offsets,
        "nbytes": sizes,
        "total": total,
    }


def unpack_views(
    buffer: torch.Tensor, dtype_names: list[str], shapes: list[list[int]], offsets: list[int]
) -> list[torch.Tensor]:
    """Tensor views into a flat uint8 ``buffer`` (no copy)."""
    views = []
    for dtype_name, shape, offset in zip(dtype_names, shapes, offsets):
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        views.append(buffer[offset : offset + nbytes].view(dtype).view(shape))
    return views


@dataclass(frozen=True)
class FlatBucket:
    """A bucket as raw bytes for a byte stream: ``chunks`` (the bytes of every non-empty
    tensor, in order: views, no copy) and a ``header`` (``names``, ``dtype_names``,
    ``shapes``; tensor i lands at byte ``offsets[i]`` of a ``total``-byte receive buffer and
    has ``nbytes[i]`` bytes), so that views into that buffer are aligned as in
    :func:`shared_update`."""

    header: dict[str, Any]
    chunks: list[Any]


def flat_update(
    bucket: WeightBucket | dict[str, Any], buffers: HostBuffers | None = None
) -> FlatBucket:
    """A bucket, or an update info of another form, flattened for a byte stream (the tensors
    are brought to the host once, here, whatever the number of receivers). Host tensors are
    sent as they are (views, no copy); device tensors are copied into one host buffer (pinned
    on a GPU machine): a new one, or ``buffers``' buffer for this layout."""
    if isinstance(bucket, dict):
        names = list(bucket["names"])
        if bucket.get("tensors") is not None:
            tensors = list(bucket["tensors"])
        else:
            tensors = unpack_views(
                bucket["buffer"], bucket["dtype_names"], bucket["shapes"], bucket["offsets"]
            )
    else:
        names, tensors = [n for n, _ in bucket], [t for _, t in bucket]
    assert len(tensors) == len(names)
    tensors = [t.detach() for t in tensors]
    layout = _layout(tensors)
    if any(not t.is_cpu for t in tensors):
        if buffers is None:
            from megatron_rl.platform import host_buffer

            buffer = host_buffer(layout["total"])
        else:
            buffer = buffers.get(layout, names)
        views = unpack_views(buffer, layout["dtype_names"], layout["shapes"], layout["offsets"])
        for tensor, view in zip(tensors, views):
            view.copy_(tensor, non_blocking=True)
        _wait_for_copies(list(zip(names, tensors)))
        tensors = views
    tensors = [t.contiguous() for t in tensors]
    chunks = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors if t.numel()]
    return FlatBucket({"names": names, **layout}, chunks)
