"""The collectives check: bus bandwidth of the trainer layout's collectives (all-reduce over
the tensor- and data-parallel groups, all-to-all over the expert group, send/recv between
pipeline stages) against a floor for the interconnect the group spans."""

from __future__ import annotations

import socket
import time
import zlib

import torch

from megatron_rl.preflight.context import Outcome, PreflightContext

# Bus-bandwidth floors (GB/s) per interconnect. Assumptions of ours, not measured here: about
# a third of what nccl-tests reaches on healthy systems (H100/H200 NVLink 4: ~360-480 GB/s
# all-reduce bus bandwidth in a node; GB200 NVL72 MNNVL (NVLink 5): ~700+; one 400 Gb/s
# NDR InfiniBand NIC per GPU: ~40-45). A link below its floor is broken or misconfigured
# (NCCL fell back to sockets, a NIC is down, MNNVL is off), not merely slow. gloo (CPU):
# informational, floor 0.
FLOORS_GBPS: dict[str, float] = {"nvlink": 120.0, "mnnvl": 250.0, "infiniband": 15.0, "gloo": 0.0}
GPU_BYTES = 256 * 2**20
CPU_BYTES = 4 * 2**20
ITERATIONS = 5


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus bandwidth factor: algorithm bandwidth x this = bus bandwidth."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op == "all_to_all":
        return (ranks - 1) / ranks
    return 1.0  # send/recv


def interconnect(group, gpu: bool, blackwell: bool) -> str:
    """What the group's traffic crosses: one node's NVLink, an NVL72 rack's MNNVL (Blackwell
    across nodes), or InfiniBand (across nodes otherwise); gloo on a CPU."""
    from megatron_rl.platform import collectives

    if not gpu:
        return "gloo"
    host = zlib.crc32(socket.gethostname().encode())
    hosts = {int(t) for t in collectives.all_gather(torch.tensor([host], dtype=torch.int64), group)}
    if len(hosts) == 1:
        return "nvlink"
    return "mnnvl" if blackwell else "infiniband"


def _timed(fn, iterations: int) -> float:
    from megatron_rl.platform.inventory import synchronize

    fn()  # warm-up: communicator set-up is not bandwidth
    synchronize()
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / iterations


def measure(op: str, group, nbytes: int, device) -> float:
    """Bus bandwidth (GB/s) of ``op`` over ``group`` with a buffer of ``nbytes``."""
    import torch.distributed as dist

    from megatron_rl.platform import collectives

    ranks = dist.get_world_size(group)
    numel = nbytes // 4 // ranks * ranks
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    if op == "all_reduce":
        fn = lambda: collectives.all_reduce(buf, group=group)  # noqa: E731
    elif op == "all_to_all":
        fn = lambda: collectives.all_to_all(buf, group)  # noqa: E731
    else:  # the first two stages of the pipeline: one way
        me = dist.get_rank(group)
        first, second = dist.get_global_rank(group, 0), dist.get_global_rank(group, 1)
        if me == 0:
            fn = lambda: collectives.send_tensor(buf, second, group)  # noqa: E731
        elif me == 1:
            fn = lambda: collectives.recv_tensor(buf.shape, buf.dtype, first, group)  # noqa: E731
        else:
            return float("nan")
    seconds = _timed(fn, ITERATIONS)
    return numel * 4 / seconds / 1e9 * bus_factor(op, ranks)


def layout_groups(config) -> list[tuple[str, str, object]]:
    """(label, op, group) of every collective the trainer layout runs over more than one rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = []
    for label, op, group in (
        ("all_reduce TP", "all_reduce", ps.get_tensor_model_parallel_group()),
        ("all_reduce DP", "all_reduce", ps.get_data_parallel_group()),
        ("all_to_all EP", "all_to_all", ps.get_expert_model_parallel_group()),
        ("send/recv PP", "send_recv", ps.get_pipeline_model_parallel_group()),
    ):
        if dist.get_world_size(group) > 1:
            out.append((label, op, group))
    return out


def check_collectives(ctx: PreflightContext) -> Outcome:
    """Every collective of the layout, its bus bandwidth against its interconnect's floor
    (the slowest rank's figure; one rank: nothing to measure)."""
    import torch.distributed as dist

    from megatron_rl.platform import collectives, get_platform
    from megatron_rl.platform.inventory import device_inventory

    platform = get_platform()
    inv = device_inventory()
    blackwell = inv.capability is not None and inv.capability[0] >= 10
    device = platform.torch_device()
    nbytes = GPU_BYTES if platform.is_gpu else CPU_BYTES
    measured, failed = {}, []
    for label, op, group in layout_groups(ctx.config):
        link = interconnect(group, platform.is_gpu, blackwell)
        gbps = measure(op, group, nbytes, device)
        # the slowest rank's bandwidth (NaN: a rank with no part, e.g. later pipeline stages)
        worst = torch.tensor([gbps if gbps == gbps else float("inf")], dtype=torch.float64)
        worst = -float(collectives.all_reduce(-worst, op=dist.ReduceOp.MAX)[0])
        floor = FLOORS_GBPS[link]
        measured[label] = {"gb_per_s": worst, "interconnect": link, "floor_gb_per_s": floor}
        if worst < floor:
            failed.append(f"{label} over {link}: {worst:.3g} GB/s < floor {floor:g} GB/s")
    if not measured:
        return Outcome(True, "n/a (1 rank)", "bus bandwidth floors per interconnect")
    value = "; ".join(
        f"{k} {v['gb_per_s']:.3g} GB/s ({v['interconnect']})" for k, v in measured.items()
    )
    limit = "; ".join(
        f"{v['interconnect']} >= {v['floor_gb_per_s']:g}"
        + (" (informational)" if v["floor_gb_per_s"] == 0 else "")
        for v in measured.values()
    )
    message = ""
    if failed:
        message = (
            "; ".join(failed) + ". Check NCCL_DEBUG=INFO's transport lines (NET/Socket instead of "
            "IB or NVLS: the NICs / IMEX channel), NCCL_IB_HCA and that the trainer's nodes "
            "share a rack (--segment)."
        )
    return Outcome(not failed, value, limit, message, measured)
