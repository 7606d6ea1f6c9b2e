"""The collectives megatron_rl calls itself, on the right group and device.

On GPU the default process group and megatron's groups are NCCL, which takes CUDA tensors
only ("No backend type associated with device type cpu"), and a one-rank run hides the
mistake because the collectives return early. So no module outside ``platform/`` calls a
``torch.distributed`` collective directly (a test checks it); they call these helpers:

- *control* collectives (flags, counts, Python objects, barriers) run on a gloo group: the
  gloo twin of the world made by :func:`init_control_group` (or megatron's ``*_gloo``
  groups), the group itself on CPU, where every group is gloo;
- *data* collectives (weight shards, loss sums) run on the group's own backend, with the
  tensors moved to that backend's device and the results handed back where they came from.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_WORLD_GLOO: Any = None  # gloo twin of the default group (GPU runs only)


def init_control_group(timeout_minutes: float) -> None:
    """Make the gloo twin of the default group (every rank calls this once, after
    ``init_process_group``; on a gloo world it is the world itself)."""
    global _WORLD_GLOO
    if dist.get_backend() == "gloo":
        _WORLD_GLOO = None
        return
    _WORLD_GLOO = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes)
    )


def reset_control_group() -> None:
    """Forget the gloo twin (the default group is being destroyed)."""
    global _WORLD_GLOO
    _WORLD_GLOO = None


def _active(group) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def control_group(group=None):
    """The gloo group for control collectives over ``group`` (None: the world)."""
    if group is None or group is dist.group.WORLD:
        if dist.get_backend() == "gloo":
            return None
        if _WORLD_GLOO is None:
            raise RuntimeError("init_control_group() was not called after init_process_group")
        return _WORLD_GLOO
    if dist.get_backend(group) == "gloo":
        return group
    raise ValueError(
        "control collectives need a gloo group: pass megatron's *_gloo twin of this group"
    )


def group_device(group=None) -> torch.device:
    """Where ``group``'s backend takes tensors: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- control ------------------------------------------------------------------------------------
def any_rank(flag: bool, group=None) -> bool:
    """True on every rank of ``group`` if ``flag`` is True on any."""
    if not _active(group):
        return flag
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control_group(group))
    return bool(value.item())


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (pickled, over gloo)."""
    if not _active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=control_group(group))
    return box[0]


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in rank order, on every rank (pickled, over gloo)."""
    if not _active(group):
        return [obj]
    objects: list[Any] = [None] * dist.get_world_size(control_group(group))
    dist.all_gather_object(objects, obj, group=control_group(group))
    return objects


def barrier(group=None, timeout_minutes: float | None = None, timeout_key: str = "") -> None:
    """Wait for every rank of ``group`` on the gloo control group. With a timeout, a rank
    that does not arrive in time is named in the error (``monitored_barrier``): a
    :class:`TimeoutError` that names ``timeout_key`` (the setting to raise).

    Rank 0 coordinates that barrier: the others wait for it under ``group``'s own timeout,
    not ``timeout_minutes``. For a wait longer than the world's timeout (rank 0 starting the
    engines) pass a group made by :func:`timed_group` with the same timeout.
    """
    if not _active(group):
        return
    control = control_group(group)
    if timeout_minutes is None:
        dist.barrier(group=control)
        return
    timeout = datetime.timedelta(minutes=timeout_minutes)
    try:
        dist.monitored_barrier(group=control, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        raise TimeoutError(
            f"rank {dist.get_rank()}: not every rank reached the barrier within "
            f"{timeout_key or 'its timeout'} ({timeout_minutes:g} min): {err}"
        ) from err


def timed_group(timeout_minutes: float, ranks: list[int] | None = None):
    """A gloo group over the world (or over ``ranks`` only) whose every wait (the ranks' side
    of :func:`barrier` included) is bounded by ``timeout_minutes`` instead of the world's
    timeout. Every rank calls this, members or not, at the same point, while all are still in
    step (None on a one-rank world)."""
    if not _active(None):
        return None
    timeout = datetime.timedelta(minutes=timeout_minutes)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)


class RankZeroWait:
    """The other ranks' wait for a value that rank 0 takes long to make (a batch generated
    by the engines, a validation pass, a probe), bounded by a setting of its own.

    The world's control group times out after ``parallel.timeout_minutes`` (30), shorter
    than a validation pass at paper pace (hours): a broadcast from rank 0 on it failed the
    other ranks while rank 0 was still working. This one runs on a :func:`timed_group` with
    ``timeout_minutes``, so a rank 0 that is slow is waited for, and one that hangs still
    fails the others, with an error naming ``timeout_key``. Every rank builds it, at the
    same point, while all are still in step.
    """

    def __init__(self, timeout_minutes: float, timeout_key: str) -> None:
        self.timeout_minutes = timeout_minutes
        self.timeout_key = timeout_key
        self.group = timed_group(timeout_minutes)

    def broadcast_object(self, obj: Any) -> Any:
        """``obj`` of rank 0 on every rank (see :func:`broadcast_object`)."""
        if self.group is None:
            return obj
        try:
            return broadcast_object(obj, src=0, group=self.group)
        except RuntimeError as err:
            raise TimeoutError(
                f"rank {dist.get_rank()}: no answer from rank 0 within {self.timeout_key} "
                f"({self.timeout_minutes:g} min), or rank 0 failed: {err}"
            ) from err


def world_store() -> Any:
    """The default group's rendezvous store (c10d's TCPStore, served by rank 0's process): a
    key-value place every rank reaches outside any collective, so a rank can tell the others
    something while they are blocked in one. None on a one-rank world."""
    if not _active(None):
        return None
    from torch.distributed import distributed_c10d

    # torch 2.13 has no public accessor for the store init_process_group rendezvoused on.
    return distributed_c10d._get_default_store()


def send_object(obj: Any, dst: int, group) -> None:
    dist.send_object_list([obj], dst=dst, group=group)


def recv_object(src: int, group) -> Any:
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


# -- data ---------------------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """``tensor`` reduced over ``group`` (on the group's device), back on ``tensor``'s device."""
    if not _active(group):
        return tensor
    work = tensor.to(group_device(group))
    dist.all_reduce(work, op=op, group=group)
    return work.to(tensor.device)


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape), on ``tensor``'s device."""
    if not _active(group):
        return [tensor]
    work = tensor.to(group_device(group))
    out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, work, group=group)
    return [t.to(tensor.device) for t in out]


def gather_to_first(tensor: torch.Tensor, group) -> list[torch.Tensor] | None:
    """``tensor`` of every rank of ``group`` on its first rank (None elsewhere), on the
    group's device."""
    first = dist.get_global_rank(group, 0)
    work = tensor.detach().contiguous().to(group_device(group))
    if dist.get_rank() == first:
        out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
        dist.gather(work, out, dst=first, group=group)
        return out
    dist.gather(work, None, dst=first, group=group)
    return None


def send_tensor(tensor: torch.Tensor, dst: int, group) -> None:
    dist.send(tensor.detach().contiguous().to(group_device(group)), dst=dst, group=group)


def recv_tensor(shape, dtype: torch.dtype, src: int, group) -> torch.Tensor:
    """A tensor sent by ``src``, on the group's device."""
    tensor = torch.empty(shape, dtype=dtype, device=group_device(group))
    dist.recv(tensor, src=src, group=group)
    return tensor


def all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """Equal chunks of ``tensor`` (first dimension split by the group's size) exchanged
    between the ranks of ``group``, on the group's device."""
    work = tensor.contiguous().to(group_device(group))
    if not _active(group):
        return work
    out = torch.empty_like(work)
    dist.all_to_all_single(out, work, group=group)
    return out
