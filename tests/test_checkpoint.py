"""Run checkpoints: round trip of model / optimizer / loop state, atomicity under a crash
mid-save, pruning, and RNG state restoration."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from megatron_rl.trainer import state as state_mod
from megatron_rl.trainer.state import CheckpointManager


@pytest.fixture(scope="module")
def model(megatron_single_rank_module):
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    return build_model(ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig())


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra" not in k}


def train_step(model, optimizer) -> None:
    """One AdamW step on a simple loss, so weights and optimizer state change."""
    optimizer.zero_grad()
    loss = sum((p.float() ** 2).mean() for p in model.parameters())
    loss.backward()
    optimizer.step()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_round_trip_restores_model_optimizer_and_loop_state(model, tmp_path):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer)
    saved = weights(model)
    opt_state = copy.deepcopy(optimizer.state_dict())  # AdamW updates its state in place
    extra = {
        "sampler": {"epoch": 1, "position": 7},
        "metrics_position": 12,
        "clock": {"gpu_hours": 0.5},
    }
    manager = CheckpointManager(tmp_path, keep_last=2)
    path = manager.save(5, model, opt_state, extra)
    assert path.name == "step_00000005" and manager.latest() == path
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name
    # The model part is a regular model checkpoint (convertible to HF as it is).
    assert (path / "model" / "hf_config" / "config.json").is_file()

    train_step(model, optimizer)  # move away from the saved state
    assert not torch.equal(next(iter(weights(model).values())), next(iter(saved.values())))
    loaded = CheckpointManager(tmp_path).load(model)
    assert loaded.step == 5 and loaded.extra == extra
    assert_same(weights(model), saved)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(loaded.optimizer_state)
    for key in ("exp_avg", "exp_avg_sq"):
        for idx, st in opt_state["state"].items():
            assert torch.equal(fresh.state_dict()["state"][idx][key], st[key])


def test_crash_mid_save_leaves_the_previous_checkpoint(model, tmp_path, monkeypatch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(tmp_path, keep_last=3)
    train_step(model, optimizer)
    good = weights(model)
    first = manager.save(1, model, optimizer.state_dict(), {"step": 1})
    train_step(model, optimizer)

    def crash(payload, path):  # the model is written, the state file is not
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(state_mod, "_write_state", crash)
    with pytest.raises(RuntimeError, match="killed"):
        manager.save(2, model, optimizer.state_dict(), {"step": 2})
    assert (tmp_path / "checkpoints" / "step_00000002.tmp" / "model" / "model").is_dir()
    assert manager.latest() == first and manager.checkpoints() == [first]
    loaded = manager.load(model)
    assert loaded.step == 1 and loaded.extra == {"step": 1}
    assert_same(weights(model), good)

    # The next save succeeds and clears the debris of the failed one.
    monkeypatch.undo()
    second = manager.save(2, model, optimizer.state_dict(), {"step": 2})
    assert manager.latest() == second
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_only_complete_checkpoints_count(model, tmp_path):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(tmp_path, keep_last=5)
    one = manager.save(1, model, optimizer.state_dict())
    two = manager.save(2, model, optimizer.state_dict())
    # Crash after the rename but before the pointer was replaced: the newest complete
    # checkpoint wins over a stale pointer.
    (tmp_path / "checkpoints" / "latest").write_text(one.name + "\n")
    assert manager.latest() == two
    # A directory that lost a rank's state file is not complete and not chosen.
    (two / "state" / "rank_00000.pt").unlink()
    assert manager.latest() == one
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        manager.load(model, two)


def test_keep_last_prunes_older_checkpoints(model, tmp_path):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        manager.save(step, model, optimizer.state_dict())
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000020", "step_00000030"]
    assert CheckpointManager(tmp_path).load(None).step == 30  # without a model: state only
    assert CheckpointManager(tmp_path / "nothing").load(model) is None


def test_rng_states_round_trip(model, tmp_path):
    manager = CheckpointManager(tmp_path)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    manager.save(1, model, None)

    def draw():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():  # megatron's model-parallel stream (dropout)
            tracked = torch.rand(3).tolist()
        return (
            [random.random() for _ in range(3)],
            np.random.rand(3).tolist(),
            torch.rand(3).tolist(),
            np.random.normal(),  # exercises numpy's cached-gaussian state
            tracked,
        )

    expected = draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert draw() != expected
    manager.load(model)
    assert draw() == expected
    # restore_rng=False leaves the current streams alone.
    torch.manual_seed(7)
    reference = torch.rand(2)
    torch.manual_seed(7)
    manager.load(model, restore_rng=False)
    assert torch.equal(torch.rand(2), reference)


def _two_rank_worker(run_dir: str) -> None:
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed

    parallel = ParallelConfig(tensor=2)
    init_distributed(parallel, seed=5)
    rank = torch.distributed.get_rank()
    model = build_model(ModelConfig(preset="tiny-llama", dtype="float32"), parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer)
    saved = weights(model)
    manager = CheckpointManager(run_dir, keep_last=1)
    manager.save(3, model, copy.deepcopy(optimizer.state_dict()), {"rank": rank})
    train_step(model, optimizer)
    loaded = manager.load(model)
    assert loaded.extra == {"rank": rank}  # each rank gets its own state back
    assert_same(weights(model), saved)  # each rank gets its own TP shard back
    torch.distributed.barrier()
    destroy_distributed()


@pytest.mark.slow
def test_two_ranks_save_and_load_collectively(tmp_path):
    """TP=2 over two gloo processes: one checkpoint, one state file per rank."""
    import json

    from megatron_rl.platform import run_local_ranks

    run_local_ranks(_two_rank_worker, 2, str(tmp_path))
    path = CheckpointManager(tmp_path).latest()
    assert path.name == "step_00000003"
    assert json.loads((path / "meta.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (path / "state").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    with pytest.raises(ValueError, match="saved by 2 ranks"):
        CheckpointManager(tmp_path).load(None)  # this process is a world of one
