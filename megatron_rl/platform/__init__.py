"""Platform layer: CPU (gloo) vs GPU (nccl), distributed + megatron parallel state.

This package is the only place in megatron_rl that asks whether CUDA exists. Names are
loaded lazily so that ``ParallelConfig`` (part of the torch-free config schema) does not pull
in torch.
"""

from __future__ import annotations

from megatron_rl.lazy import lazy_exports

_EXPORTS = {
    "LAUNCHER_VARS": "megatron_rl.platform.config",
    "ParallelConfig": "megatron_rl.platform.config",
    "FusedKernels": "megatron_rl.platform.kernels",
    "current_stream": "megatron_rl.platform.device",
    "Platform": "megatron_rl.platform.device",
    "get_platform": "megatron_rl.platform.device",
    "HANG_EXIT_CODE": "megatron_rl.platform.watchdog",
    "destroy_distributed": "megatron_rl.platform.parallel",
    "exit_with_parent": "megatron_rl.platform.parallel",
    "free_port": "megatron_rl.platform.parallel",
    "host_buffer": "megatron_rl.platform.device",
    "init_distributed": "megatron_rl.platform.parallel",
    "keep_for_stream": "megatron_rl.platform.device",
    "local_device_count": "megatron_rl.platform.device",
    "local_rank": "megatron_rl.platform.launcher",
    "local_world_size": "megatron_rl.platform.launcher",
    "record_event": "megatron_rl.platform.device",
    "run_local_ranks": "megatron_rl.platform.parallel",
    "set_seed": "megatron_rl.platform.parallel",
    "set_thread_device": "megatron_rl.platform.device",
    "wait_event": "megatron_rl.platform.device",
}

__all__ = sorted(_EXPORTS)


__getattr__, _ = lazy_exports(globals(), _EXPORTS, cache=False)
