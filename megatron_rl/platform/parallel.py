"""torch.distributed and megatron-core parallel state for the trainer."""

from __future__ import annotations

import datetime
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.platform import collectives
from megatron_rl.platform.config import ParallelConfig
from megatron_rl.platform.device import get_platform

logger = logging.getLogger(__name__)


def init_distributed(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Initialise torch.distributed (from the usual env vars, or a 1-process group) and
    megatron-core parallel state (TP, PP, EP, CP; DP is the rest), then seed every RNG.

    Raises ``ValueError`` when the world size does not divide into the requested sizes.
    """
    from megatron.core import parallel_state, tensor_parallel

    platform = get_platform()
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
        if platform.is_gpu:
            from megatron_rl.platform.launcher import local_rank

            torch.cuda.set_device(local_rank())  # LOCAL_RANK, or SLURM_LOCALID under srun
        if "WORLD_SIZE" in os.environ:  # torchrun, srun wrappers, run_local_ranks: env://
            dist.init_process_group(backend=platform.backend, timeout=timeout)
        else:
            # A lone process: a private rendezvous. Nothing goes into os.environ, where child
            # processes (a trainer started by a test, an sbatch job) would inherit the port.
            # Port 0: the OS picks the store's port as it binds (no pick-then-bind race).
            store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timeout)
            dist.init_process_group(
                backend=platform.backend, store=store, rank=0, world_size=1, timeout=timeout
            )
        collectives.init_control_group(parallel.timeout_minutes)
    world = dist.get_world_size()
    model_parallel = parallel.model_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not divisible by tensor x pipeline x context "
            f"= {parallel.tensor} x {parallel.pipeline} x {parallel.context}"
        )
    if (world // (parallel.pipeline * parallel.context)) % parallel.expert and parallel.expert > 1:
        raise ValueError(f"world size {world} does not fit expert parallel size {parallel.expert}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor,
        distributed_timeout_minutes=parallel.timeout_minutes,
        create_gloo_process_groups=platform.is_gpu,  # on CPU the default groups are gloo
    )
    set_seed(seed)
    # megatron's RNG tracker (dropout / init inside TP regions) keys off the model-parallel rank.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    logger.info(
        "rank %d/%d: tp=%d pp=%d ep=%d cp=%d dp=%d",
        dist.get_rank(),
        world,
        parallel.tensor,
        parallel.pipeline,
        parallel.expert,
        parallel.context,
        parallel_state.get_data_parallel_world_size(),
    )


def destroy_distributed() -> None:
    """Tear down megatron parallel state and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        collectives.reset_control_group()
        dist.destroy_process_group()


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local_ranks(fn, world_size: int, *args) -> list:
    """Run ``fn(*args)`` on ``world_size`` local processes that form one process group and
    return their (picklable) results by rank.

    For single-node tools and tests (CPU: gloo). Each child gets RANK / WORLD_SIZE /
    LOCAL_RANK / MASTER_ADDR / MASTER_PORT; ``fn`` then calls :func:`init_distributed`.
    Under torchrun / srun (WORLD_SIZE already set) or with one rank, ``fn`` runs in-process
    (and the list holds its one result). ``fn`` must be importable (module level); an
    exception in any rank is raised here with that rank's traceback.

    On CPU the ranks are forked from a fork server that has imported torch and megatron-core
    once (:data:`RANK_PRELOAD`): a spawned rank spends 10-15 s importing them, every time.
    They run with this process's environment as of the call, as spawned ones would. On GPU
    they are spawned: no process that might have touched CUDA is forked.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1 or "WORLD_SIZE" in os.environ:
        return [fn(*args)]
    import multiprocessing
    import pickle
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    method = "spawn" if get_platform().is_gpu else "forkserver"
    if method == "forkserver":
        multiprocessing.get_context(method).set_forkserver_preload(RANK_PRELOAD)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="megatron_rl_ranks_") as out_dir:
        for attempt in range(1, _RENDEZVOUS_ATTEMPTS + 1):
            try:
                mp.start_processes(
                    _rank_entry,
                    args=(fn, world_size, free_port(), out_dir, args, env),
                    nprocs=world_size,
                    start_method=method,
                )
                break
            except mp.ProcessRaisedException as exc:
                # The port was free when picked, but another process (a parallel test
                # worker, another job) bound it before rank 0's store listened on it.
                if attempt == _RENDEZVOUS_ATTEMPTS or not _port_taken(exc):
                    raise
                logger.warning("rendezvous port taken before rank 0 listened; new port (%s)", exc)
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results


_RENDEZVOUS_ATTEMPTS = 3


def _port_taken(exc: BaseException) -> bool:
    """Whether a rank failed because its rendezvous port was in use (c10d's TCPStore server:
    "... failed to listen on any local network address ... EADDRINUSE")."""
    return "EADDRINUSE" in str(exc)


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The env:// rendezvous variables of local rank ``rank`` (what torchrun would set)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


# What the fork server of run_local_ranks imports before it forks ranks (no threads started).
RANK_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron_rl.platform.parallel"]


def _rank_entry(rank: int, fn, world_size: int, port: int, out_dir: str, args, env) -> None:
    import pickle
    from pathlib import Path

    os.environ.clear()
    os.environ.update({**env, **rank_environment(rank, world_size, port)})
    torch.set_num_threads(1)  # the ranks share this machine's cores
    result = fn(*args)
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def exit_with_parent(poll_seconds: float = 1.0) -> None:
    """End this (helper) process when the process that started it is gone (SIGKILL, OOM
    kill): nobody would stop it, and it would keep its memory (and GPUs)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
