"""GPU weight path: the trainer's sender broadcasts buckets to every engine over NCCL.

vLLM's own ``nccl`` weight-transfer backend runs on the engine side (selected by
``weight_transfer_config={"backend": "nccl"}``): each worker joins one NCCL group whose rank 0
is the trainer's sender, and ``update_weights`` receives the announced tensors by broadcast
and loads them through vLLM's layerwise reload. The trainer side uses vLLM's rendezvous
(``nccl_common.trainer_init``) and packed broadcast producer, so both ends agree on the wire.

Per push, for every bucket the pool announces the bucket's names / dtypes / shapes to every
engine (its runner calls ``update_weights`` with them, which blocks in the NCCL receive), then
broadcasts the tensors once; all engines receive the same broadcast. An engine generates
until the header arrives; requests in flight stay in vLLM's scheduler meanwhile, as on the
CPU path.

Engines must own GPUs other than the sender's (NCCL has one rank per device), so this path
needs ``placement`` subprocess or remote. Selected by ``rollout.weight_transport: nccl``, and
by the default ``auto`` on GPU machines for such placements (``RolloutConfig.resolved``).
Unverified so far: it needs two GPUs, and the machines this project has tested on had at
most one (see the rollout issue's notes).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import torch

from megatron_rl.conversion.weight_stream import WeightBucket

logger = logging.getLogger(__name__)

BACKEND = "nccl"  # vLLM's registered backend name


def group_layout(engines: int, tensor_parallel: int) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the transfer group: the sender is rank 0,
    engine ``i``'s TP workers take ranks ``offset[i] .. offset[i] + tp - 1``."""
    offsets = [1 + i * tensor_parallel for i in range(engines)]
    return 1 + engines * tensor_parallel, offsets


def worker_payload(
    address: str, port: int, rank_offset: int, world_size: int, bucket_bytes: int
) -> dict[str, Any]:
    """The ``init_weight_transfer_engine`` payload of one engine (vLLM's worker init info)."""
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_payload,
    )

    info = NCCLWeightTransferInitInfo(
        master_address=address,
        master_port=port,
        rank_offset=rank_offset,
        world_size=world_size,
        packed=True,
        packed_buffer_size_bytes=bucket_bytes,
    )
    return worker_init_payload(info)


def bucket_header(bucket: WeightBucket) -> dict[str, Any]:
    """The update info that announces a bucket: exactly the fields of vLLM's
    ``NCCLWeightTransferUpdateInfo`` (the engine builds it with ``**header``: any other key
    is a ``TypeError`` there)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    info = NCCLWeightTransferUpdateInfo(
        names=[name for name, _ in bucket],
        dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
    )
    return asdict(info)


class NcclSender:
    """The trainer end of the transfer group (rank 0), a
    :class:`~megatron_rl.rollout.buckets.WeightSender`: every engine gets a bucket's header
    (``pack``), then its tensors by one broadcast (``send``). ``connect`` blocks until every
    engine worker has joined: start the engines' side first."""

    blocking = True  # the broadcast returns when every engine has received it

    def __init__(
        self,
        address: str,
        port: int,
        world_size: int,
        bucket_bytes: int,
        device: torch.device | None = None,
    ) -> None:
        from megatron_rl.platform import get_platform

        self.address, self.port, self.world_size = address, port, world_size
        self.bucket_bytes = bucket_bytes
        self.device = device or get_platform().torch_device()
        self.group = None

    def connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init(
            {
                "master_address": self.address,
                "master_port": self.port,
                "world_size": self.world_size,
            }
        )
        logger.info("NCCL weight transfer group ready (%d ranks)", self.world_size)

    def on_device(self, item: tuple[str, torch.Tensor]) -> torch.Tensor:
        """A bucket tensor on the sender's device, where vLLM packs and broadcasts it (the
        stream mixes host tensors, as modelopt's exporter returns, with CUDA ones)."""
        return item[1].to(self.device, non_blocking=True)

    def pack(self, bucket: WeightBucket) -> dict[str, Any]:
        """The bucket's header, which every engine gets through its weights queue."""
        return bucket_header(bucket)

    def send(self, bucket: WeightBucket) -> None:
        """Broadcast the bucket's tensors in the order ``bucket_header`` announced. Blocks
        until every engine received them: the pool runs it under a watchdog."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        assert self.group is not None, "connect() first"
        packed_nccl_broadcast_producer(
            iterator=iter(bucket),
            group=self.group,
            src=0,
            post_iter_func=self.on_device,
            buffer_size_bytes=self.bucket_bytes,
        )

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
