"""Asynchronous checkpoints (checkpoint.async_save): the save returns while megatron's forked
writer still writes, the checkpoint counts only once finalized, a crash or a signal while it
is in flight leaves the previous checkpoint, and pruning waits for the new one."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint import adam_state, assert_same, make_trainer, train_step, weights

from megatron_rl.platform import ParallelConfig
from megatron_rl.trainer.state import CheckpointManager

TESTS = Path(__file__).resolve().parent  # where test_checkpoint.py is (the script imports it)


@pytest.fixture
def trainer(megatron_single_rank):
    return make_trainer(ParallelConfig())


def gate_writer(monkeypatch, gate: Path, timeout: float = 120.0) -> None:
    """megatron's writer (it runs in the process forked for an async save, or in this one
    for a synchronous save) waits until the file ``gate`` exists."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    write = FileSystemWriterAsync.write_preloaded_data_multiproc

    def gated(*args, **kwargs):
        deadline = time.monotonic() + timeout
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return write(*args, **kwargs)

    monkeypatch.setattr(
        FileSystemWriterAsync, "write_preloaded_data_multiproc", staticmethod(gated)
    )


def test_an_async_save_returns_before_its_data_is_written_and_loads_back_bit_equal(
    trainer, tmp_path, monkeypatch
):
    """The save returns while the writer waits (nothing of the model's tensors on disk, no
    step directory); training changes the parameters meanwhile; the finalized checkpoint
    verifies against its manifest and holds the weights and Adam moments of the save's step,
    not the later ones."""
    model, ddp, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    train_step(ddp, optimizer)
    first = manager.save(1, model, {"step": 1}, optimizer=optimizer, async_save=False)
    train_step(ddp, optimizer, seed=1)
    saved, saved_adam = weights(model), adam_state(optimizer)
    gate = tmp_path / "gate"
    gate_writer(monkeypatch, gate)

    completed = []  # on_complete: what needs the checkpoint on disk (an HF export)
    started = time.perf_counter()
    path = manager.save(2, model, {"step": 2}, optimizer=optimizer, on_complete=completed.append)
    returned = time.perf_counter() - started
    tmp = path.with_name(path.name + ".tmp")
    assert manager.in_flight == 2 and not path.exists() and tmp.is_dir()
    assert not list(tmp.rglob("*.distcp")), "tensors were written before the save returned"
    train_step(ddp, optimizer, seed=2)  # the next step changes the live parameters
    assert any(not torch.equal(saved[k], v) for k, v in weights(model).items())
    assert manager.finalize() is None  # the writer still waits: nothing completes
    assert manager.latest() == first and manager.in_flight == 2 and completed == []

    gate.touch()
    assert manager.finalize(blocking=True) == path
    assert completed == [path] and (path / "meta.json").is_file()
    assert manager.in_flight is None and not tmp.exists()
    assert manager.damage(path) is None  # complete and verified against its manifest
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name
    assert manager.latest() == path
    loaded = CheckpointManager(tmp_path).load(model, optimizer=optimizer)
    assert loaded.step == 2 and loaded.extra == {"step": 2}
    assert_same(weights(model), saved)
    for got, want in zip(adam_state(optimizer), saved_adam, strict=True):
        assert torch.equal(got, want)
    print(f"async save returned after {returned:.2f} s with the writer held")


def test_pruning_keeps_the_last_complete_checkpoint_until_the_new_one_is_complete(
    trainer, tmp_path, monkeypatch
):
    """keep_last=1: while step 2 is written, step 1 stays complete and is `latest`
    (keep_last complete ones plus the one in flight); once step 2 is complete, step 1 goes."""
    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=1, async_save=True)
    first = manager.save(1, model, optimizer=optimizer)
    assert manager.finalize(blocking=True) == first
    gate = tmp_path / "gate"
    gate_writer(monkeypatch, gate)
    second = manager.save(2, model, optimizer=optimizer)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", first.name, second.name + ".tmp"]
    assert manager.latest() == first and manager.is_complete(first)
    assert manager.finalize() is None
    assert manager.is_complete(first)
    gate.touch()
    assert manager.finalize(blocking=True) == second
    assert sorted(p.name for p in root.iterdir()) == ["latest", second.name]


def test_an_async_write_that_runs_out_of_space_fails_at_finalize_and_keeps_the_previous(
    trainer, tmp_path, monkeypatch
):
    """ENOSPC in the forked writer surfaces when the save is finalized: said in words, its
    .tmp removed, the previous checkpoint complete and latest; the next save works."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=1, async_save=True)
    first = manager.save(1, model, optimizer=optimizer, async_save=False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(filesystem_async, "_write_item", full)  # inherited by the writers
    completed = []
    manager.save(2, model, optimizer=optimizer, on_complete=completed.append)
    with pytest.raises(OSError, match="No space left on device while writing checkpoint") as info:
        manager.finalize(blocking=True)
    assert info.value.errno == errno.ENOSPC and first.name in str(info.value)
    assert manager.in_flight is None and completed == []  # a failed save never completes
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", first.name]
    assert manager.latest() == first
    monkeypatch.undo()
    assert manager.save(3, model, optimizer=optimizer).name == "step_00000003"
    assert manager.finalize(blocking=True) == manager.latest()


# A trainer-like process: checkpoint 1 complete, then checkpoint 2 in flight with its writer
# held until RUN/gate exists. "kill": it waits to be killed; "signal": a SIGTERM sets a flag
# (as the loop's handler does), then the writer is let go and the signal's save is made
# synchronously, as the loop does.
IN_FLIGHT = """
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_checkpoint import make_trainer, train_step, weights
from test_async_checkpoint import gate_writer
import torch
from megatron_rl.platform import ParallelConfig, init_distributed
from megatron_rl.trainer.state import CheckpointManager

class Patch:  # pytest's monkeypatch, outside pytest
    def setattr(self, obj, name, value):
        setattr(obj, name, value)

got = []
if __name__ == "__main__":
    run, mode = Path(sys.argv[1]), sys.argv[2]
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    init_distributed(ParallelConfig())
    model, ddp, optimizer = make_trainer(ParallelConfig())
    manager = CheckpointManager(run, keep_last=3, async_save=True)
    train_step(ddp, optimizer)
    manager.save(1, model, {"step": 1}, optimizer=optimizer)
    manager.finalize(blocking=True)
    torch.save(weights(model), run / "weights_1.pt")
    gate_writer(Patch(), run / "gate", timeout=600)
    train_step(ddp, optimizer, seed=1)
    torch.save(weights(model), run / "weights_2.pt")
    manager.save(2, model, {"step": 2}, optimizer=optimizer)
    print("IN_FLIGHT", flush=True)
    while not got:
        time.sleep(0.05)
    (run / "gate").touch()
    train_step(ddp, optimizer, seed=2)
    manager.save(3, model, {"step": 3}, optimizer=optimizer, async_save=False)
    print("SAVED_ON_SIGNAL", flush=True)
"""


def _start(tmp_path: Path, mode: str) -> subprocess.Popen:
    from megatron_rl.platform import LAUNCHER_VARS

    script = tmp_path / "trainer.py"
    script.write_text(IN_FLIGHT)
    run = tmp_path / "run"
    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run), mode, str(TESTS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own group, as a job's processes under srun
    )
    while (line := proc.stdout.readline()) and not line.startswith("IN_FLIGHT"):
        pass
    if not line:
        proc.wait(timeout=60)
        pytest.fail(proc.stderr.read()[-3000:])
    return proc


def _group(pgid: int) -> list[str]:
    return subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()


def _end_group(proc: subprocess.Popen) -> None:
    """Whatever this test started and left (its own session's group), so that a failure
    leaves no writer behind; then the trainer's pipes."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=30)


def _wait_group_gone(pgid: int, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.timeout(240)  # ~20 s alone, ~55 s on a loaded 2-core machine
def test_a_trainer_killed_while_an_async_save_is_in_flight_resumes_from_the_previous(
    tmp_path, megatron_single_rank
):
    """SIGKILL of the trainer with checkpoint 2 in flight: its writer dies with it (no
    process outlives the trainer), checkpoint 1 stays complete and `latest`, it loads back
    bit-equal, and the next save in that directory completes and clears the .tmp."""
    proc = _start(tmp_path, "kill")
    try:
        assert len(_group(proc.pid)) >= 2  # the trainer and the writer of checkpoint 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert _wait_group_gone(proc.pid, 10) == []  # the writer did not outlive it
    finally:
        _end_group(proc)
    run = tmp_path / "run"
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [
        "latest",
        "step_00000001",
        "step_00000002.tmp",
    ]
    assert (root / "latest").read_text().strip() == "step_00000001"
    manager = CheckpointManager(run, keep_last=3)
    assert manager.latest() == root / "step_00000001"

    model, ddp, optimizer = make_trainer(ParallelConfig(), seed=5)
    loaded = manager.load(model, optimizer=optimizer)
    assert loaded.step == 1 and loaded.extra == {"step": 1}
    assert_same(weights(model), torch.load(run / "weights_1.pt"))
    train_step(ddp, optimizer, seed=1)  # the resumed run redoes step 2 (same batch)
    assert_same(weights(model), torch.load(run / "weights_2.pt"))
    resumed = CheckpointManager(run, keep_last=3, async_save=True)
    resumed.save(2, model, {"step": 2}, optimizer=optimizer)
    assert resumed.finalize(blocking=True) == root / "step_00000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]


@pytest.mark.timeout(240)  # ~20 s alone, ~55 s on a loaded 2-core machine
def test_a_sigterm_to_the_process_group_with_an_async_save_in_flight_completes_both(tmp_path):
    """Preemption signals every process of the job, the async writer included. The save in
    flight survives it and completes (megatron's Manager-held results queue would have died:
    BrokenPipeError), then the signal's synchronous save; nothing is left running."""
    proc = _start(tmp_path, "signal")
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        left = _wait_group_gone(proc.pid, 10)
    finally:
        _end_group(proc)
    assert proc.returncode == 0 and "SAVED_ON_SIGNAL" in out, err[-3000:]
    assert left == []
    run = tmp_path / "run"
    root = run / "checkpoints"
    names = ["step_00000001", "step_00000002", "step_00000003"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", *names]
    manager = CheckpointManager(run, keep_last=3)
    assert [p.name for p in manager.checkpoints()] == names  # all verify
    assert manager.latest() == root / "step_00000003"
    import torch.distributed as dist

    if not dist.is_initialized():
        from conftest import ensure_megatron_single_rank

        ensure_megatron_single_rank()
    model, _, _ = make_trainer(ParallelConfig(), seed=5)
    manager.load(model, root / "step_00000002", restore_rng=False)
    assert_same(weights(model), torch.load(run / "weights_2.pt"))


def _two_rank_worker(run_dir: str, tensor: int) -> dict:
    """Two ranks (TP=2, or DP=2: rank 1 a replica with nothing of the model to write); rank
    1's writer is slow; both ranks poll finalize() once per step."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from megatron_rl.platform import destroy_distributed, init_distributed

    parallel = ParallelConfig(tensor=tensor)
    init_distributed(parallel, seed=5)
    rank = torch.distributed.get_rank()
    model, ddp, optimizer = make_trainer(parallel)
    train_step(ddp, optimizer)
    if rank == 1:
        write = FileSystemWriterAsync.write_preloaded_data_multiproc

        def slow(*args, **kwargs):
            time.sleep(3.0)
            return write(*args, **kwargs)

        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(slow)
    manager = CheckpointManager(run_dir, keep_last=1, async_save=True)
    saved = weights(model)
    path = manager.save(1, model, {"step": 1}, optimizer=optimizer)
    polls = 0
    while manager.finalize() is None:  # as the loop: a step, then one poll
        train_step(ddp, optimizer, seed=polls + 1)
        polls += 1
    assert manager.damage(path) is None
    fresh, _, fresh_optimizer = make_trainer(parallel, seed=9)
    loaded = CheckpointManager(run_dir).load(fresh, optimizer=fresh_optimizer)
    assert loaded.step == 1
    assert_same(weights(fresh), saved)  # this rank's TP shard, as of the save
    destroy_distributed()
    return {"polls": polls}


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~25 s alone, ~70 s on a loaded 2-core machine
@pytest.mark.parametrize("tensor", [2, 1], ids=["tp2", "dp2"])
def test_two_ranks_complete_an_async_save_together_while_training(tmp_path, tensor):
    """The finalization is collective: with one rank's writer 3 s slower, both ranks keep
    stepping and complete the save at the same poll (a rank that finalized alone would hang
    in megatron's gather or ours), and each rank's shard loads back as of the save."""
    from megatron_rl.platform import run_local_ranks

    results = run_local_ranks(_two_rank_worker, 2, str(tmp_path), tensor)
    assert results[0] == results[1] and results[0]["polls"] >= 1, results


@pytest.mark.gpu
def test_an_async_save_of_cuda_tensors_holds_the_values_of_its_step(megatron_single_rank, tmp_path):
    """On a GPU the parameters and Adam moments are CUDA tensors: megatron's async save
    stages them to host memory before it returns (its writer is a forked process, which
    cannot read them), so the step after the save, which changes them on the device, must
    not reach the checkpoint. Run by tools/gpu_check.sh on the lent H200 (no Transformer
    Engine there: local layer specs)."""
    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.trainer.optim import build_optimizer, wrap_model

    torch.manual_seed(0)
    config = ModelConfig(preset="tiny-llama", dtype="float32", layer_spec="local")
    model = build_model(config, ParallelConfig())
    ddp = wrap_model(model)
    optimizer = build_optimizer(ddp, OptimizerConfig(lr=1e-2, warmup_steps=0)).optimizer
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    train_step(ddp, optimizer)
    saved, saved_adam = weights(model), adam_state(optimizer)
    path = manager.save(1, model, {"step": 1}, optimizer=optimizer)
    train_step(ddp, optimizer, seed=1)  # changes the CUDA parameters while the writer runs
    assert any(not torch.equal(saved[k], v) for k, v in weights(model).items())
    assert manager.finalize(blocking=True) == path
    assert manager.damage(path) is None
    loaded = CheckpointManager(tmp_path).load(model, optimizer=optimizer)
    assert loaded.step == 1 and loaded.extra == {"step": 1}
    assert_same(weights(model), saved)
    for got, want in zip(adam_state(optimizer), saved_adam, strict=True):
        assert torch.equal(got, want)


def test_the_write_results_of_a_save_lie_in_its_tmp_not_the_temporary_directory(
    trainer, tmp_path, monkeypatch
):
    """A trainer killed after its writer finished but before it read the results left
    megatron_rl_write_results_*.pkl in the temporary directory, for good. The results file
    is in the checkpoint's .tmp (removed with it), and gone once the save completes."""
    import tempfile

    model, _, optimizer = trainer
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    manager = CheckpointManager(tmp_path / "run", keep_last=2, async_save=True)
    path = manager.save(1, model, optimizer=optimizer)
    tmp = path.with_name(path.name + ".tmp")
    deadline = time.monotonic() + 60
    # the writer puts its results when it is done: the moment a killed trainer leaves them
    while not (found := list(tmp_path.rglob("*write_results_*.pkl"))):
        assert time.monotonic() < deadline, "the writer never wrote its results"
        time.sleep(0.02)
    assert not list(temp.iterdir()), list(temp.iterdir())
    assert all(tmp in p.parents for p in found), found
    assert manager.finalize(blocking=True) == path
    assert not list(tmp_path.rglob("*write_results_*"))


def test_an_abandoned_save_removes_its_partial_directory(trainer, tmp_path, monkeypatch):
    """The run fails while a save is in flight (its forked writer ran out of space, and
    the next metrics record found the disk full first): its writer is stopped and its
    partial .tmp, which holds the space, removed; the complete checkpoint stays."""
    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    first = manager.save(1, model, optimizer=optimizer, async_save=False)
    gate_writer(monkeypatch, tmp_path / "gate")  # the writer never starts writing
    path = manager.save(2, model, optimizer=optimizer)
    tmp = path.with_name(path.name + ".tmp")
    assert tmp.is_dir() and manager.in_flight == 2
    manager.abandon()
    assert not tmp.exists() and manager.in_flight is None
    assert CheckpointManager(tmp_path).latest() == first


def test_a_save_whose_write_is_done_is_completed_not_abandoned(trainer, tmp_path):
    """The run fails (or a second Ctrl-C stops it) after its async save's write was done but
    before a finalize published it: on one rank the save is completed, not removed (before:
    the complete .tmp was deleted and the run resumed from the checkpoint before)."""
    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2, async_save=True)
    manager.save(1, model, optimizer=optimizer, async_save=False)
    path = manager.save(2, model, {"step": 2}, optimizer=optimizer)
    writer = manager._calls.async_calls[0].async_caller.process
    writer.join(timeout=120)  # the write is done
    assert writer.exitcode == 0 and manager.in_flight == 2
    manager.abandon()
    assert manager.in_flight is None and not path.with_name(path.name + ".tmp").exists()
    assert CheckpointManager(tmp_path).latest() == path
    assert CheckpointManager(tmp_path).load(model).extra == {"step": 2}
