"""What the launcher (torchrun or srun) tells a process about its place on its node.

torchrun sets ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; srun sets neither, but its tasks get
``SLURM_LOCALID`` and the tasks per node of their step. A trainer started by srun that read
only torchrun's ``LOCAL_WORLD_SIZE`` counted one trainer GPU per node, and its subprocess
engines took the GPUs of the other trainer ranks (issue 27, 2.8). No torch import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# Slurm's compressed tasks-per-node lists, one entry per node of the step or job:
# "4", "4(x2)", "2(x3),1".
_TASKS_ENTRY = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(value: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``-style ``"2(x3),1"`` as ``[2, 2, 2, 1]`` (tasks of each node).
    Raises ``ValueError`` naming the value when it is not in that format."""
    counts: list[int] = []
    for entry in value.split(","):
        match = _TASKS_ENTRY.match(entry.strip())
        if match is None:
            raise ValueError(
                f"tasks per node {value!r}: expected Slurm's format like '4', '4(x2)' or '2(x3),1'"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun, our srun wrapper), else
    ``SLURM_LOCALID`` (a bare srun task), else 0."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(name, "") != "":
            return int(env[name])
    return 0


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of processes of this launch on this node (each holds one GPU).

    ``LOCAL_WORLD_SIZE`` (torchrun); else, in an srun task (``SLURM_LOCALID`` set), this
    node's entry of ``SLURM_STEP_TASKS_PER_NODE`` (the step's own layout), of
    ``SLURM_TASKS_PER_NODE`` (the job's), or ``SLURM_NTASKS_PER_NODE``, the node picked by
    ``SLURM_NODEID``; never more than ``WORLD_SIZE``; else 1 (a lone process, which has no
    ``WORLD_SIZE``).
    """
    env = os.environ if environ is None else environ
    if env.get("LOCAL_WORLD_SIZE", "") != "":
        return int(env["LOCAL_WORLD_SIZE"])
    if env.get("SLURM_LOCALID", "") == "" or env.get("WORLD_SIZE", "") == "":
        return 1  # not an srun task, or one that forms a world of its own
    count = None
    node = int(env.get("SLURM_NODEID", "0") or 0)
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name, "") != "":
            counts = expand_tasks_per_node(env[name])
            if node >= len(counts):
                raise ValueError(
                    f"{name}={env[name]!r} lists {len(counts)} node(s); SLURM_NODEID is {node}"
                )
            count = counts[node]
            break
    if count is None and env.get("SLURM_NTASKS_PER_NODE", "") != "":
        count = int(env["SLURM_NTASKS_PER_NODE"])
    if count is None:
        return 1
    # A task of this node has SLURM_LOCALID below the count; the world holds at most its size.
    return min(max(count, local_rank(env) + 1), int(env["WORLD_SIZE"]))


def lone_process_problem(
    parallel, trainer_gpus: int, command: str, environ: Mapping[str, str] | None = None
) -> str | None:
    """Why a recipe that needs several trainer ranks cannot run in this lone process (no
    launcher's ``WORLD_SIZE``), with how to launch it; None when it can. ``parallel``: the
    recipe's ``parallel`` section; ``trainer_gpus``: ``cluster.trainer_gpus``."""
    env = os.environ if environ is None else environ
    if env.get("WORLD_SIZE", "") != "":
        return None
    needed = max(parallel.model_parallel_size, parallel.expert)
    if needed <= 1:
        return None
    ranks = trainer_gpus if trainer_gpus % needed == 0 else needed
    return (
        f"this recipe needs {ranks} trainer ranks (parallel.tensor x pipeline x context = "
        f"{parallel.tensor} x {parallel.pipeline} x {parallel.context}, parallel.expert "
        f"{parallel.expert}, cluster.trainer_gpus {trainer_gpus}) and this is one process: "
        f"start it on every rank, as `megatron-rl launch` jobs do (srun), or with torchrun: "
        f"`python -m torch.distributed.run --standalone --nproc-per-node {ranks} "
        f"-m megatron_rl.cli {command} ...`"
    )
