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

Expert-parallel engines (``rollout.expert_parallel``) get each routed expert only on the GPU
that holds it (vLLM's placement, :mod:`megatron_rl.rollout.weights.experts`). A broadcast hands every
member of a group the same bytes, so there is a group per EP rank ``r``: the sender and worker
``r`` of every engine (``expert_group_layout``). Dense tensors still go once to the group of
all workers; each rank's experts go to its group only. The sender emits every byte once either
way (its link bounds a push as before); each engine GPU receives ``dense + its experts``
instead of the whole model. The engines run vLLM's ``nccl`` backend with two changes
(:class:`ExpertParallelNcclEngine`, registered as ``megatron_rl_nccl_ep``): a worker also
joins its EP rank's group, and receives its experts there.

A group's ranks are fixed: after an engine dies, the pool forms the group anew of the engines
its next push goes to (``WeightPusher.form``), on fresh ports; every worker first leaves its
old group (vLLM's ``shutdown_weight_transfer_engine``, which aborts the communicator).

Engines must own GPUs other than the sender's (NCCL has one rank per device), so this path
needs ``placement`` subprocess or remote. Selected by ``rollout.weight_transport: nccl``, and
by the default ``auto`` on GPU machines for such placements (``RolloutConfig.resolved``).
Unverified so far: it needs two GPUs, and the machines this project has tested on had at
most one (see the rollout issue's notes).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.nccl_common import (
    NCCLWeightTransferInitInfo,
    stateless_init_process_group,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from megatron_rl.conversion.weight_stream import WeightBucket
from megatron_rl.rollout.weights.buckets import bucket_ready
from megatron_rl.rollout.weights.cpu_backend import NCCL_EP_BACKEND
from megatron_rl.rollout.weights.experts import (
    ExpertPlacement,
    model_rank_experts,
    own_part,
    split_experts,
)

logger = logging.getLogger(__name__)

BACKEND = "nccl"  # vLLM's registered backend name
EP_BACKEND = NCCL_EP_BACKEND  # for expert-parallel engines (see above)


def engine_backend(expert_parallel: bool) -> str:
    """The engines' weight-transfer backend for ``weight_transport: nccl``."""
    return EP_BACKEND if expert_parallel else BACKEND


def group_layout(engines: int, tensor_parallel: int) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the transfer group: the sender is rank 0,
    engine ``i``'s TP workers take ranks ``offset[i] .. offset[i] + tp - 1``."""
    offsets = [1 + i * tensor_parallel for i in range(engines)]
    return 1 + engines * tensor_parallel, offsets


def expert_group_layout(engines: int) -> tuple[int, list[int]]:
    """(world size, rank of each engine's worker) of one EP rank's group: the sender is rank
    0, engine ``i``'s worker of that EP rank is rank ``1 + i``."""
    return 1 + engines, [1 + i for i in range(engines)]


def worker_payload(
    address: str, port: int, rank_offset: int, world_size: int, bucket_bytes: int
) -> dict[str, Any]:
    """The ``init_weight_transfer_engine`` payload of one engine (vLLM's worker init info)."""
    from vllm.distributed.weight_transfer.nccl_common import worker_init_payload

    info = NCCLWeightTransferInitInfo(
        master_address=address,
        master_port=port,
        rank_offset=rank_offset,
        world_size=world_size,
        packed=True,
        packed_buffer_size_bytes=bucket_bytes,
    )
    return worker_init_payload(info)


def worker_payloads(
    address: str,
    port: int,
    expert_ports: Sequence[int],
    engines: int,
    tensor_parallel: int,
    bucket_bytes: int,
) -> list[dict[str, Any]]:
    """Every engine's ``init_weight_transfer_engine`` payload: vLLM's worker init info for the
    group of all workers (on ``port``); with ``expert_ports`` (one per EP rank) also each EP
    rank's group, as ``ep_groups`` (:class:`ExpertParallelInitInfo`: there ``rank_offset``
    is the worker's rank itself, one worker per engine)."""
    world, offsets = group_layout(engines, tensor_parallel)
    payloads = [worker_payload(address, port, offset, world, bucket_bytes) for offset in offsets]
    if expert_ports:
        assert len(expert_ports) == tensor_parallel, "an engine's EP size is its TP size"
        ep_world, ranks = expert_group_layout(engines)
        for payload, rank in zip(payloads, ranks):
            payload["ep_groups"] = [
                worker_payload(address, p, rank, ep_world, bucket_bytes) for p in expert_ports
            ]
    return payloads


def bucket_header(bucket: WeightBucket) -> dict[str, Any]:
    """The update info that announces a bucket: exactly the fields of vLLM's
    ``NCCLWeightTransferUpdateInfo`` (the engine builds it with ``**header``: any other key
    is a ``TypeError`` there)."""
    info = NCCLWeightTransferUpdateInfo(
        names=[name for name, _ in bucket],
        dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
    )
    return asdict(info)


def expert_parallel_header(bucket: WeightBucket, placement: ExpertPlacement) -> dict[str, Any]:
    """The update info of a bucket for expert-parallel engines
    (:class:`ExpertParallelUpdateInfo`): its dense tensors at the top (vLLM's fields), and
    each EP rank's experts, per expert, in ``ep_ranks``."""
    dense, experts = split_experts(bucket, placement)
    info = ExpertParallelUpdateInfo(
        **bucket_header(dense),
        ep_ranks=[bucket_header(part) for part in experts],
        ep_experts=[list(r) for r in placement.ranks],
    )
    return asdict(info)


@dataclass(kw_only=True)
class ExpertParallelInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's worker init info (the group of all workers) with ``ep_groups[r]``: the init info
    of EP rank r's group, where ``rank_offset`` is the worker's rank."""

    ep_groups: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        for group in self.ep_groups:
            NCCLWeightTransferInitInfo(**group)  # vLLM's validation


@dataclass
class ExpertParallelUpdateInfo(NCCLWeightTransferUpdateInfo):
    """vLLM's update info of the dense tensors (broadcast to every worker), with
    ``ep_ranks[r]`` the update info of EP rank r's experts (broadcast in its group) and the
    placement they were split for (``ep_experts``)."""

    ep_ranks: list[dict[str, Any]] = field(default_factory=list)
    ep_experts: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.ep_ranks) != len(self.ep_experts):
            raise ValueError(f"{len(self.ep_ranks)} EP parts for {len(self.ep_experts)} ranks")
        for part in self.ep_ranks:
            NCCLWeightTransferUpdateInfo(**part)


class ExpertParallelNcclEngine(NCCLWeightTransferEngine):
    """vLLM's ``nccl`` backend on a worker of an expert-parallel engine: it joins the group
    of all workers (vLLM's code) and its EP rank's group, receives the dense tensors in the
    first and its experts in the second (vLLM's packed consumer and loaders in both). The
    EP rank and experts are read from the worker's MoE layers and checked against the
    sender's split (``own_part``)."""

    init_info_cls = ExpertParallelInitInfo
    update_info_cls = ExpertParallelUpdateInfo

    expert_group = None

    def init_transfer_engine(self, init_info: ExpertParallelInitInfo) -> None:
        super().init_transfer_engine(init_info)
        held = model_rank_experts(self.model)
        if held is None or held[0] >= len(init_info.ep_groups):
            raise ValueError(f"EP rank and experts {held}: no group of {init_info.ep_groups}")
        group = NCCLWeightTransferInitInfo(**init_info.ep_groups[held[0]])
        self.expert_group = stateless_init_process_group(
            group.master_address,
            group.master_port,
            group.rank_offset,
            group.world_size,
            torch.accelerator.current_device_index(),
        )

    def receive_weights(self, update_info: ExpertParallelUpdateInfo) -> None:
        super().receive_weights(update_info)  # the dense tensors (its vLLM fields)
        split = {"ep_ranks": update_info.ep_ranks, "ep_experts": update_info.ep_experts}
        mine = NCCLWeightTransferUpdateInfo(**own_part(split, self.model))
        every_worker, self.model_update_group = self.model_update_group, self.expert_group
        try:
            super().receive_weights(mine)
        finally:
            self.model_update_group = every_worker

    def shutdown(self) -> None:
        super().shutdown()
        if self.expert_group is not None:
            self.expert_group.destroy()
            self.expert_group = None


class NcclSender:
    """The trainer end of the transfer groups (rank 0 of each), a
    :class:`~megatron_rl.rollout.weights.buckets.WeightSender`: every engine gets a bucket's header
    (``pack``), then its tensors by broadcast (``send``): one broadcast to every worker, or
    for expert-parallel engines (``experts``) the dense tensors to every worker and each EP
    rank's experts in its own group (on ``expert_ports[r]``). ``connect`` blocks until every
    engine worker has joined: start the engines' side first."""

    blocking = True  # the broadcast returns when every engine has received it

    def __init__(
        self,
        address: str,
        port: int,
        world_size: int,
        bucket_bytes: int,
        device: torch.device | None = None,
        experts: ExpertPlacement | None = None,
        expert_ports: Sequence[int] = (),
    ) -> None:
        from megatron_rl.platform import get_platform

        if (experts is None) != (not expert_ports) or (
            experts is not None and len(expert_ports) != experts.ep_size
        ):
            raise ValueError(f"expert ports {list(expert_ports)} for EP placement {experts}")
        self.address, self.port, self.world_size = address, port, world_size
        self.bucket_bytes = bucket_bytes
        self.device = device or get_platform().torch_device()
        self.experts, self.expert_ports = experts, list(expert_ports)
        self.group = None
        self.expert_groups: list[Any] = []

    def connect(self) -> None:
        """Join the engines' groups. Runs on the pool's helper thread, like :meth:`send`."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        from megatron_rl import platform

        # The pool calls this on a helper thread, whose current CUDA device is 0, not this
        # rank's: the communicator would be made on GPU 0 (issue 27, 2.7).
        platform.set_thread_device(self.device)
        self.group = trainer_init(
            {
                "master_address": self.address,
                "master_port": self.port,
                "world_size": self.world_size,
            }
        )
        if self.experts is not None:  # in EP rank order, as each worker joins its own
            world, _ = expert_group_layout((self.world_size - 1) // self.experts.ep_size)
            for port in self.expert_ports:
                rendezvous = {"master_address": self.address, "master_port": port}
                self.expert_groups.append(trainer_init({**rendezvous, "world_size": world}))
        logger.info(
            "NCCL weight transfer group ready (%d ranks, %d expert groups)",
            self.world_size,
            len(self.expert_groups),
        )

    def on_device(self, item: tuple[str, torch.Tensor], ready: Any = None) -> torch.Tensor:
        """A bucket tensor on the sender's device, where vLLM packs and broadcasts it. The
        stream's tensors are already there (``weight_stream`` keeps them on the trainer's
        device): then this is the tensor itself, no copy.

        vLLM calls this inside its side stream's context (``packed_nccl_broadcast_producer``
        packs and broadcasts on streams of its own, which do not wait on any other), right
        before it reads the tensor there (``torch.cat`` into the packed buffer): that stream
        first waits for ``ready``, the event recorded after the bucket's gathers and copies
        on the stream that built it; and the tensor is marked as used by it
        (``record_stream``), so its memory is not reused before the packing has read it,
        even if the bucket is dropped early (a push that timed out)."""
        from megatron_rl import platform

        platform.wait_event(ready)
        tensor = item[1].to(self.device, non_blocking=True)
        platform.keep_for_stream(tensor)
        return tensor

    def pack(self, bucket: WeightBucket) -> dict[str, Any]:
        """The bucket's header, which every engine gets through its weights queue."""
        if self.experts is None:
            return bucket_header(bucket)
        return expert_parallel_header(bucket, self.experts)

    def groups(self, bucket: WeightBucket) -> list[tuple[Any, WeightBucket]]:
        """(group, the tensors broadcast in it) for ``bucket``, in the order the engines
        receive them (the order of the ``pack`` header)."""
        if self.experts is None:
            return [(self.group, bucket)]
        dense, experts = split_experts(bucket, self.experts)
        return [(self.group, dense), *zip(self.expert_groups, experts)]

    def send(self, bucket: WeightBucket) -> None:
        """Broadcast the bucket's tensors in the order ``pack`` announced. Blocks until every
        engine received them: the pool runs it under a watchdog."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        from megatron_rl import platform

        assert self.group is not None, "connect() first"
        # On a helper thread too: PyNccl asserts the current device is the communicator's.
        platform.set_thread_device(self.device)
        # The event after the bucket's work on the stream that built it (the prefetch
        # thread's); a plain bucket was built on this thread's current stream.
        ready = bucket_ready(bucket)
        if ready is None:
            ready = platform.record_event()
        for group, tensors in self.groups(bucket):
            packed_nccl_broadcast_producer(
                iterator=iter(tensors),
                group=group,
                src=0,
                post_iter_func=functools.partial(self.on_device, ready=ready),
                buffer_size_bytes=self.bucket_bytes,
            )

    def close(self) -> None:
        for group in [self.group, *self.expert_groups]:
            if group is not None:
                group.destroy()
        self.group, self.expert_groups = None, []
