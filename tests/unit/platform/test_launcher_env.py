"""Where a process sits on its node, from torchrun's or srun's variables (issue 27, 2.8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# The environment of trainer task 5 of `srun --nodes 2 --ntasks 8` (4 tasks per node), as
# the sbatch wrapper leaves it: RANK / WORLD_SIZE / LOCAL_RANK from Slurm, no torchrun.
SRUN_TASK_5 = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_TASKS_PER_NODE": "4(x2)",
}
LAUNCH_VARS = (
    *SRUN_TASK_5,
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
)


def test_engines_started_by_an_srun_trainer_take_gpus_apart_from_its_ranks(monkeypatch):
    """Subprocess engines of a trainer started by srun (4 trainer ranks on each 8-GPU node)
    go on GPUs 4..7: the trainer read torchrun's LOCAL_WORLD_SIZE only, counted 1 trainer
    GPU and put the engines on GPUs 1..4, three of them held by its own ranks."""
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.trainer import loop

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in SRUN_TASK_5.items():
        monkeypatch.setenv(name, value)
    started = []

    def make_pool(hf_dir, rollout, **kw):  # in place of GeneratorPool: what it is handed
        started.append(rollout.gpu_ids)

    rollout = RolloutConfig(placement="subprocess", engines=4, tensor_parallel=1)
    config = SimpleNamespace(
        rollout=rollout,
        model=SimpleNamespace(dtype="bfloat16"),
        algorithm=SimpleNamespace(routing_replay=False),
        cluster=SimpleNamespace(gpus_per_node=8),
        reward=None,
    )
    run = SimpleNamespace(config=config, tokenizer=None, hf_dir="/hf")
    loop.start_generators(run, 0, make_pool=make_pool, on_gpu=True)
    trainer_gpus = set(range(4))  # LOCAL_RANK 0..3 of this node
    assert started == [[4, 5, 6, 7]]
    assert not trainer_gpus & set(started[0])


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "6", "SLURM_LOCALID": "0"}, 3),  # torchrun
        (SRUN_TASK_5, 4),
        # uneven step: 2 nodes x 3 tasks, then 1; the task on the last node
        (
            {
                "WORLD_SIZE": "7",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "2",
                "SLURM_STEP_TASKS_PER_NODE": "3(x2),1",
            },
            1,
        ),
        (
            {
                "WORLD_SIZE": "7",
                "SLURM_LOCALID": "2",
                "SLURM_NODEID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "3(x2),1",
                "SLURM_TASKS_PER_NODE": "8(x3)",
            },
            3,
        ),
        # no step layout: the job's, then --ntasks-per-node
        ({"WORLD_SIZE": "4", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x2)"}, 2),
        ({"WORLD_SIZE": "8", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4"}, 4),
        # a lone process in an allocation of 4 tasks per node forms a world of 1
        ({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4"}, 1),
        ({"WORLD_SIZE": "2", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4"}, 2),
        ({}, 1),
    ],
)
def test_local_world_size_from_torchrun_or_slurm(env, expected):
    from megatron_rl.platform import local_world_size

    assert local_world_size(env) == expected


def test_local_rank_from_torchrun_or_slurm_and_bad_tasks_per_node():
    from megatron_rl.platform import local_rank, local_world_size
    from megatron_rl.platform.launcher import expand_tasks_per_node

    assert local_rank({"LOCAL_RANK": "2", "SLURM_LOCALID": "3"}) == 2
    assert local_rank({"SLURM_LOCALID": "3"}) == 3
    assert local_rank({}) == 0
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match=r"tasks per node '4x2'.*'4\(x2\)'"):
        local_world_size({"WORLD_SIZE": "8", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4x2"})
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE='4' lists 1 node.*is 1"):
        local_world_size(
            {
                "WORLD_SIZE": "8",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "4",
            }
        )
