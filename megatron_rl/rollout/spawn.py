"""Run a function on N local processes joined in one torch.distributed (gloo / nccl) world.

Used by ``megatron-rl check-parity --tp/--ep`` and by the tests, so that a multi-rank Megatron
trainer can be exercised from one shell without a launcher.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rl.platform.parallel import free_port, rank_environment

__all__ = ["free_port", "run_ranks"]


def _entry(rank: int, fn: Callable, world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(rank_environment(rank, world, port))
    import torch

    # the ranks share this machine's cores: one intra-op thread each
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    result = fn(rank, world, *args)
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes and return
    their (picklable) results by rank. The env vars RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT are set, so ``megatron_rl.platform.init_distributed`` forms the world.

    ``fn`` must be importable (a module-level function). An exception in any rank is raised
    here, with that rank's traceback.
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="megatron_rl_ranks_") as out_dir:
        mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, args),
            nprocs=world_size,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results
