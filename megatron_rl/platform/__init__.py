"""Platform layer: CPU (gloo) vs GPU (nccl), distributed + megatron parallel state.

This package is the only place in megatron_rl that asks whether CUDA exists.
"""

from megatron_rl.platform.config import ParallelConfig
from megatron_rl.platform.device import Platform, get_platform
from megatron_rl.platform.parallel import (
    destroy_distributed,
    init_distributed,
    run_local_ranks,
    set_seed,
)

__all__ = [
    "ParallelConfig",
    "Platform",
    "destroy_distributed",
    "get_platform",
    "init_distributed",
    "run_local_ranks",
    "set_seed",
]
