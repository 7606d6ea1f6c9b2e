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
    (subprocess) or one set of byte chunks streamed to every engine task (remote)."""

    blocking = False

    def __init__(self, placement: str, experts: ExpertPlacement | None = None) -> None:
        packers = {"in_process": tensors_update, "subprocess": shared_update, "remote": flat_update}
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
        pass


def tensors_update(bucket: WeightBucket) -> dict[str, Any]:
    """Update info that hands the bucket's own tensors over (engine in this process)."""
    return {"names": [n for n, _ in bucket], "tensors": [t.detach() for _, t in bucket]}


def shared_update(bucket: WeightBucket) -> dict[str, Any]:
    """Update info with the bucket copied into one shared-memory buffer (any process).

    The buffer travels through ``torch.multiprocessing`` queues as a file descriptor; its
    memory is freed when the last engine drops it.
    """
    layout = _layout([t for _, t in bucket])
    storage = torch.UntypedStorage._new_shared(max(layout["total"], 1))
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    views = unpack_views(buffer, layout["dtype_names"], layout["shapes"], layout["offsets"])
    for (_, tensor), view in zip(bucket, views):
        view.copy_(tensor.detach())
    return {
        "names": [n for n, _ in bucket],
        "buffer": buffer,
        "dtype_names": layout["dtype_names"],
        "shapes": layout["shapes"],
        "offsets": layout["offsets"],
    }


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


def flat_update(bucket: WeightBucket | dict[str, Any]) -> FlatBucket:
    """A bucket, or an update info of another form, flattened for a byte stream (the tensors
    are brought to the host once, here, whatever the number of receivers)."""
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
    tensors = [t.detach().to("cpu").contiguous() for t in tensors]
    chunks = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors if t.numel()]
    return FlatBucket({"names": names, **_layout(tensors)}, chunks)
