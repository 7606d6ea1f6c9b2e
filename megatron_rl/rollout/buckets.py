"""Buckets of HF-named tensors as update infos of the ``megatron_rl_cpu`` weight transport.

The trainer side of :mod:`megatron_rl.rollout.transport` (this module does not import vLLM):
a bucket is handed over as the tensors themselves (engine in the same process) or copied
into one flat shared-memory buffer (engine in another process).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.conversion.weight_stream import WeightBucket

_ALIGN = 64  # byte alignment of tensors inside a flat buffer


def tensors_update(bucket: WeightBucket) -> dict[str, Any]:
    """Update info that hands the bucket's own tensors over (engine in this process)."""
    return {"names": [n for n, _ in bucket], "tensors": [t.detach() for _, t in bucket]}


def shared_update(bucket: WeightBucket) -> dict[str, Any]:
    """Update info with the bucket copied into one shared-memory buffer (any process).

    The buffer travels through ``torch.multiprocessing`` queues as a file descriptor; its
    memory is freed when the last engine drops it.
    """
    offsets, total = [], 0
    for _, tensor in bucket:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(total, 1)))
    for (_, tensor), view in zip(
        bucket,
        unpack_views(
            buffer,
            [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [list(t.shape) for _, t in bucket],
            offsets,
        ),
    ):
        view.copy_(tensor.detach())
    return {
        "names": [n for n, _ in bucket],
        "buffer": buffer,
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "offsets": offsets,
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
