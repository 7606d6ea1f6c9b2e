"""What the preflight asks of the accelerator: versions, device model, FP8 support, peak
memory. Lives in the platform package, the only place that asks about CUDA."""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass

import torch

from megatron_rl.platform.device import get_platform

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInventory:
    """Versions and the device of this process; the CUDA fields are None on a CPU."""

    torch: str
    cuda: str | None
    driver: str | None
    nccl: str | None
    device_name: str | None
    capability: tuple[int, int] | None
    device_count: int

    @property
    def fp8_recipes(self) -> tuple[str, ...]:
        """FP8 recipes Transformer Engine runs on this GPU with this CUDA (empty on a CPU
        and before Ada): ``planning.gpus.fp8_recipes``, the table the recipe's target GPU
        (``cluster.gpu``) is checked against at load."""
        from megatron_rl.planning.gpus import fp8_recipes

        return fp8_recipes(self.capability, self.cuda)


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        logger.warning("nvidia-smi: %s", err)
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def device_inventory() -> DeviceInventory:
    """The versions and device this process runs with."""
    if not get_platform().is_gpu:
        return DeviceInventory(torch.__version__, None, None, None, None, None, 0)
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return DeviceInventory(
        torch.__version__,
        torch.version.cuda,
        _driver_version(),
        nccl,
        torch.cuda.get_device_name(),
        torch.cuda.get_device_capability(),
        torch.cuda.device_count(),
    )


def synchronize() -> None:
    """Wait for the device's queued work (a no-op on a CPU): before reading a timer."""
    if get_platform().is_gpu:
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    if get_platform().is_gpu:
        torch.cuda.reset_peak_memory_stats()


def peak_memory_bytes() -> int | None:
    """Peak bytes the caching allocator reserved on this GPU since the last reset (None on a
    CPU, whose process memory is not comparable with a GPU plan)."""
    if not get_platform().is_gpu:
        return None
    return int(torch.cuda.max_memory_reserved())
