"""Memory of the GPUs a plan is checked against: one table, with sources (no torch import).

Capacities are the vendor's HBM per GPU in decimal gigabytes (1 GB = 1e9 bytes), as the
datasheets state them; ``torch.cuda.get_device_properties().total_memory`` reports a little
less (firmware and ECC reservations), which is why plans ask for headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator model.

    Attributes:
        name: short name used on the command line.
        memory_bytes: HBM per GPU.
        source: where the number comes from.
    """

    name: str
    memory_bytes: int
    source: str


GPUS: dict[str, GPU] = {
    # NVIDIA GB200 NVL72 datasheet: "up to 13.4 TB HBM3e" for 72 Blackwell GPUs = 186 GB each
    # (the GB200 superchip: 2 GPUs, 372 GB HBM3e).
    "gb200": GPU("gb200", 186 * GB, "NVIDIA GB200 NVL72 datasheet: 13.4 TB HBM3e / 72 GPUs"),
    # NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e (SXM and NVL).
    "h200": GPU("h200", 141 * GB, "NVIDIA H200 datasheet: 141 GB HBM3e"),
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3.
    "h100": GPU("h100", 80 * GB, "NVIDIA H100 datasheet: 80 GB HBM3 (SXM)"),
}

DEFAULT_GPU = "gb200"  # the production cluster of the recipes (GB200 NVL72, slurm/README.md)

# What no formula here derives: the CUDA context, NCCL communicators (NVLS / MNNVL buffers)
# and, on engines, CUDA graphs. Estimates of ours (a CUDA context is ~0.5-1 GB on Hopper and
# Blackwell; NCCL with NVLS allocates buffers per communicator), not measured on a GB200.
TRAINER_RUNTIME_RESERVE = 4 * GB
ENGINE_RUNTIME_RESERVE = 6 * GB


def get_gpu(name: str) -> GPU:
    """The GPU called ``name``; ValueError naming the known ones otherwise."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[name]
