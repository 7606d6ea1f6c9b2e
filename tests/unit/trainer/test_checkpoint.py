"""Run checkpoints: round trip of model / optimizer / loop state, atomicity under a crash
mid-save, pruning, and RNG state restoration."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from megatron_rl.config.sections import OptimizerConfig
from megatron_rl.models.logprobs import logits_to_logprobs
from megatron_rl.platform import ParallelConfig
from megatron_rl.trainer import state as state_mod
from megatron_rl.trainer.optim import build_optimizer, wrap_model
from megatron_rl.trainer.state import CheckpointManager
from megatron_rl.trainer.warm_start import SFTBatch


@pytest.fixture
def trainer(megatron_single_rank):
    """(model, DDP wrapper, megatron AdamW) of the tiny model, as the trainer holds them."""
    return make_trainer(ParallelConfig())


def make_trainer(parallel, seed: int = 0):
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model

    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="tiny-llama", dtype="float32"), parallel)
    ddp = wrap_model(model)
    return model, ddp, build_optimizer(ddp, OptimizerConfig(lr=1e-2, warmup_steps=0)).optimizer


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra" not in k}


def train_step(ddp, optimizer, seed: int = 0) -> None:
    """One AdamW step on a next-token loss over random tokens (the same on every rank)."""
    from megatron_rl.trainer.step import forward_backward

    tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(seed))

    def loss_fn(mb, logits):
        loss = -logits_to_logprobs(logits, mb.tokens).mean()
        return loss, loss.detach().reshape(1), torch.zeros(0)

    forward_backward(ddp, optimizer, [SFTBatch(tokens, tokens[:, 1:] >= 0)], loss_fn, 1)
    optimizer.step()


def adam_state(optimizer) -> list[torch.Tensor]:
    """exp_avg and exp_avg_sq of every parameter, in the optimizer's order."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [
        st[key].clone()
        for opt in inner
        for group in opt.param_groups
        for p in group["params"]
        for st in [opt.state[p]]
        for key in ("exp_avg", "exp_avg_sq")
    ]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_round_trip_restores_model_optimizer_and_loop_state(trainer, tmp_path):
    model, ddp, optimizer = trainer
    train_step(ddp, optimizer)
    saved, saved_moments = weights(model), adam_state(optimizer)
    extra = {
        "sampler": {"epoch": 1, "position": 7},
        "metrics_position": 12,
        "clock": {"gpu_hours": 0.5},
    }
    manager = CheckpointManager(tmp_path, keep_last=2)
    path = manager.save(5, model, extra, optimizer=optimizer)
    assert path.name == "step_00000005" and manager.latest() == path
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == path.name
    # The model part is a regular model checkpoint (convertible to HF as it is).
    assert (path / "model" / "hf_config" / "config.json").is_file()

    train_step(ddp, optimizer, seed=1)  # move away from the saved state
    assert not torch.equal(next(iter(weights(model).values())), next(iter(saved.values())))
    loaded = CheckpointManager(tmp_path).load(model, optimizer=optimizer)
    assert loaded.step == 5 and loaded.extra == extra
    assert_same(weights(model), saved)
    moments = adam_state(optimizer)
    assert len(moments) == len(saved_moments) > 0
    for a, b in zip(moments, saved_moments):
        assert torch.equal(a, b)


def test_checkpoint_before_the_first_optimizer_step_resumes(trainer, tmp_path):
    """A run checkpointed before AdamW ever stepped (every update so far had no token with
    loss) resumes, and its first step equals a fresh optimizer's."""
    model, ddp, optimizer = trainer
    start = weights(model)
    manager = CheckpointManager(tmp_path)
    manager.save(1, model, {}, optimizer=optimizer)
    manager.load(model, optimizer=optimizer)
    train_step(ddp, optimizer)
    resumed = weights(model)
    fresh_model, fresh_ddp, fresh = make_trainer(ParallelConfig(), seed=7)
    fresh_model.load_state_dict(start, strict=False)
    train_step(fresh_ddp, fresh)
    assert_same(resumed, weights(fresh_model))


def test_crash_mid_save_leaves_the_previous_checkpoint(trainer, tmp_path, monkeypatch):
    model, ddp, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=3)
    train_step(ddp, optimizer)
    good = weights(model)
    first = manager.save(1, model, {"step": 1}, optimizer=optimizer)
    train_step(ddp, optimizer, seed=1)

    def crash(payload, path):  # the model is written, the state file is not
        raise RuntimeError("killed mid-save")

    monkeypatch.setattr(state_mod, "_write_state", crash)
    with pytest.raises(RuntimeError, match="killed"):
        manager.save(2, model, {"step": 2}, optimizer=optimizer)
    assert (tmp_path / "checkpoints" / "step_00000002.tmp" / "model" / "model").is_dir()
    assert manager.latest() == first and manager.checkpoints() == [first]
    loaded = manager.load(model)
    assert loaded.step == 1 and loaded.extra == {"step": 1}
    assert_same(weights(model), good)

    # The next save succeeds and clears the debris of the failed one.
    monkeypatch.undo()
    second = manager.save(2, model, {"step": 2}, optimizer=optimizer)
    assert manager.latest() == second
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_only_complete_checkpoints_count(trainer, tmp_path):
    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=5)
    one = manager.save(1, model, optimizer=optimizer)
    two = manager.save(2, model, optimizer=optimizer)
    # Crash after the rename but before the pointer was replaced: the newest complete
    # checkpoint wins over a stale pointer.
    (tmp_path / "checkpoints" / "latest").write_text(one.name + "\n")
    assert manager.latest() == two
    # A directory that lost a rank's state file is not complete and not chosen.
    (two / "state" / "rng_00000.pt").unlink()
    assert manager.latest() == one
    import shutil

    shutil.rmtree(one / "optimizer")  # nor one that lost its optimizer state
    assert manager.latest() is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        manager.load(model, two, optimizer=optimizer)


def test_keep_last_prunes_older_checkpoints(trainer, tmp_path):
    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        manager.save(step, model, optimizer=optimizer)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000020", "step_00000030"]
    assert CheckpointManager(tmp_path).load(None).step == 30  # without a model: state only
    assert CheckpointManager(tmp_path / "nothing").load(model) is None


def test_rng_states_round_trip(trainer, tmp_path):
    model = trainer[0]
    manager = CheckpointManager(tmp_path)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    manager.save(1, model)

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


def _save_worker(run_dir: str, tensor: int) -> None:
    """One AdamW step, a checkpoint, a second step; saves the weights after the second step."""
    from megatron_rl.platform import destroy_distributed, init_distributed

    parallel = ParallelConfig(tensor=tensor)
    init_distributed(parallel, seed=5)
    model, ddp, optimizer = make_trainer(parallel)
    train_step(ddp, optimizer)
    CheckpointManager(run_dir, keep_last=1).save(3, model, {"world": tensor}, optimizer=optimizer)
    train_step(ddp, optimizer, seed=1)
    _save_hf_weights(model, f"{run_dir}/after_tp{tensor}.pt")
    destroy_distributed()


def _resume_worker(run_dir: str, tensor: int) -> None:
    """Load the checkpoint into a fresh trainer of another layout, take the second step."""
    from megatron_rl.platform import destroy_distributed, init_distributed

    parallel = ParallelConfig(tensor=tensor)
    init_distributed(parallel, seed=5)
    model, ddp, optimizer = make_trainer(parallel, seed=99)
    loaded = CheckpointManager(run_dir).load(model, optimizer=optimizer)
    assert loaded.step == 3 and loaded.extra == {"world": 3 - tensor}  # rank 0's loop state
    train_step(ddp, optimizer, seed=1)
    _save_hf_weights(model, f"{run_dir}/resumed_tp{tensor}.pt")
    # Negative control: the same weights with fresh AdamW moments step elsewhere.
    model, ddp, optimizer = make_trainer(parallel, seed=98)
    CheckpointManager(run_dir).load(model)
    train_step(ddp, optimizer, seed=1)
    _save_hf_weights(model, f"{run_dir}/no_moments_tp{tensor}.pt")
    destroy_distributed()


def _save_hf_weights(model, path: str) -> None:
    """Full HF-named tensors (TP shards gathered), written by rank 0."""
    from megatron_rl.conversion.weight_stream import iter_hf_weights

    full = {name: t.clone() for bucket in iter_hf_weights(model) for name, t in bucket}
    if torch.distributed.get_rank() == 0:
        torch.save(full, path)


@pytest.mark.slow
def test_resume_in_another_layout_continues_the_same_run(tmp_path):
    """Model and optimizer state reshard: a TP=2 checkpoint resumed on one rank (and a
    one-rank checkpoint on TP=2) takes the same next AdamW step as the uninterrupted run."""
    import shutil

    from megatron_rl.platform import run_local_ranks

    for saver, resumer in ((2, 1), (1, 2)):
        run_dir = tmp_path / f"tp{saver}"
        run_local_ranks(_save_worker, saver, str(run_dir), saver)
        meta = (CheckpointManager(run_dir).latest() / "meta.json").read_text()
        assert f'"world_size": {saver}' in meta
        run_local_ranks(_resume_worker, resumer, str(run_dir), resumer)
        after = torch.load(run_dir / f"after_tp{saver}.pt")
        resumed = torch.load(run_dir / f"resumed_tp{resumer}.pt")
        no_moments = torch.load(run_dir / f"no_moments_tp{resumer}.pt")
        assert after.keys() == resumed.keys()
        for name in after:  # float rounding differs between layouts; AdamW steps are 1e-2
            assert torch.allclose(after[name], resumed[name], atol=1e-5, rtol=0), name
        assert max(float((after[k] - no_moments[k]).abs().max()) for k in after) > 1e-3
        shutil.rmtree(run_dir / "checkpoints")


SAVE_ON_SIGNAL = """
import os, signal, sys, time
from megatron_rl.conversion import checkpoint
from megatron_rl.models import ModelConfig, preset_hf_config
from megatron_rl.platform import ParallelConfig, init_distributed
from megatron_rl.models.provider import build_model
got = []
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    init_distributed(ParallelConfig())
    model = build_model(ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig())
    checkpoint.save_model(model, sys.argv[1] + "/first", preset_hf_config("tiny-llama"))
    print("SAVED_ONCE", flush=True)
    while not got:
        time.sleep(0.05)
    checkpoint.save_model(model, sys.argv[1] + "/on_signal", preset_hf_config("tiny-llama"))
    print("SAVED_ON_SIGNAL", flush=True)
"""


@pytest.mark.timeout(180)  # ~15 s
def test_a_save_on_sigterm_to_the_whole_process_group_completes(tmp_path):
    """Preemption signals every process of the job. megatron-core 0.16.1's writer kept its
    results queue in a Manager process started at the first save, in the trainer's group:
    the group's SIGTERM killed it, and the save the signal asked for failed (BrokenPipeError)
    leaving a .tmp. The save must complete, and no helper process of it may remain."""
    import os
    import signal
    import subprocess
    import sys

    from megatron_rl.platform import LAUNCHER_VARS

    script = tmp_path / "saver.py"
    script.write_text(SAVE_ON_SIGNAL)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own group: the signal reaches it and its helpers only
    )
    try:
        while (line := proc.stdout.readline()) and not line.startswith("SAVED_ONCE"):
            pass
        assert line, proc.stderr.read()[-3000:]
        helpers = subprocess.run(
            ["pgrep", "-g", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert helpers == [str(proc.pid)]  # no process of the save outlives it
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "SAVED_ON_SIGNAL" in out, err[-3000:]
    assert (tmp_path / "on_signal" / "model" / ".metadata").is_file()
    assert not list(tmp_path.glob("*.tmp"))


def _truncate(path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


@pytest.mark.parametrize(
    "damage",
    [
        "truncated shard",
        "missing .metadata",
        "truncated loop state",
        "missing meta.json",
        "lost manifest",
        "lost manifest, format 2, truncated shard",
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(
    trainer, tmp_path, damage, caplog
):
    """Resume must not stop at a damaged newest checkpoint (it ended in 'does not fit the
    model' tracebacks) nor skip one silently: the newest intact one is used, with a warning
    naming the damaged one, and loading the damaged one says it is damaged."""
    model, ddp, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=3)
    train_step(ddp, optimizer)
    good = weights(model)
    first = manager.save(1, model, {"step": 1}, optimizer=optimizer)
    train_step(ddp, optimizer, seed=1)
    second = manager.save(2, model, {"step": 2}, optimizer=optimizer)
    if damage == "truncated shard":
        shards = sorted((second / "model" / "model").glob("*.distcp"))
        assert shards
        _truncate(max(shards, key=lambda p: p.stat().st_size))
    elif damage == "missing .metadata":
        (second / "optimizer" / ".metadata").unlink()
    elif damage == "truncated loop state":
        _truncate(second / "state" / "loop.pt")
    elif damage == "missing meta.json":
        (second / "meta.json").unlink()
    else:  # no manifest: not verified (it was trusted as one written before manifests)
        (second / "manifest.json").unlink()
        if damage.endswith("truncated shard"):  # format 2: checked by the shards' own metadata
            meta = json.loads((second / "meta.json").read_text())
            (second / "meta.json").write_text(json.dumps({**meta, "format": 2}))
            shard = max((second / "optimizer").glob("*.distcp"), key=lambda p: p.stat().st_size)
            _truncate(shard)

    fresh = CheckpointManager(tmp_path, keep_last=3)
    with caplog.at_level("WARNING"):
        assert fresh.latest() == first
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(second.name in m and "damaged" in m for m in warned), warned
    loaded = fresh.load(model, optimizer=optimizer)
    assert loaded.step == 1 and loaded.extra == {"step": 1}
    assert_same(weights(model), good)
    with pytest.raises(ValueError, match="damaged"):
        fresh.load(model, second, optimizer=optimizer)


def test_a_checkpoint_written_before_manifests_is_read_by_its_own_metadata(trainer, tmp_path):
    """Format 2 (before manifests): no manifest.json, and intact by its shards' metadata."""
    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=3)
    path = manager.save(1, model, {"step": 1}, optimizer=optimizer)
    (path / "manifest.json").unlink()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == 3
    (path / "meta.json").write_text(json.dumps({**meta, "format": 2}))
    assert CheckpointManager(tmp_path).latest() == path
    _truncate(path / "model" / "model" / ".metadata")
    assert ".metadata is unreadable" in CheckpointManager(tmp_path).damage(path)


def test_no_space_for_a_checkpoint_is_said_before_writing(trainer, tmp_path, monkeypatch):
    """Free space below the previous checkpoint's size: the save is refused in words
    (ENOSPC) before anything is written; the complete checkpoints stay."""
    import errno

    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2)
    first = manager.save(1, model, optimizer=optimizer)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    monkeypatch.setattr(state_mod, "_free_bytes", lambda path: size // 2)
    with pytest.raises(OSError, match="No space left for checkpoint step_00000002") as info:
        manager.save(2, model, optimizer=optimizer)
    assert info.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        first.name,
    ]
    monkeypatch.setattr(state_mod, "_free_bytes", lambda path: 10 * size)
    assert manager.save(2, model, optimizer=optimizer).name == "step_00000002"


@pytest.mark.parametrize("where", ["loop state", "tensor writer"])
def test_a_save_that_runs_out_of_space_says_so_and_removes_its_tmp(
    trainer, tmp_path, monkeypatch, where
):
    """ENOSPC in the middle of a save (in our state file, or in megatron's forked tensor
    writer, which re-raises it wrapped): the error says "No space left on device", the
    partial .tmp that kept the disk full is removed, the previous checkpoint is intact."""
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2)
    first = manager.save(1, model, optimizer=optimizer)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "loop state":
        monkeypatch.setattr(state_mod, "_write_state", full)
    else:  # runs in the writer's forked child, which inherits the patch
        monkeypatch.setattr(filesystem_async, "_write_item", full)
    with pytest.raises(OSError, match="No space left on device while writing checkpoint") as info:
        manager.save(2, model, optimizer=optimizer)
    assert info.value.errno == errno.ENOSPC and "step_00000001" in str(info.value)
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    assert manager.latest() == first


IOSTREAM_ERROR = "basic_ios::clear: iostream error"  # torch.save's error on a full disk


def _torch_save_on_a_full_disk(monkeypatch, free_after: int) -> None:
    """The disk has room when the save starts; torch.save (megatron's common.pt, our loop
    state) writes part of its file, the disk fills (``free_after`` bytes left) and torch
    fails as it does then: a RuntimeError that does not say why."""
    disk = {"free": 10**15}

    def full(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04" + b"\0" * 100)
        disk["free"] = free_after
        raise RuntimeError(IOSTREAM_ERROR)

    monkeypatch.setattr(state_mod, "_free_bytes", lambda path: disk["free"])
    monkeypatch.setattr(torch, "save", full)


def test_a_full_disk_that_torch_reports_as_an_iostream_error_is_named(
    trainer, tmp_path, monkeypatch
):
    """The disk fills while torch writes common.pt: the save ended in the bare RuntimeError
    and left its partial .tmp. The free space is checked again: the error names the disk,
    the bytes needed (the previous checkpoint's size) and those free; the .tmp is gone."""
    import errno

    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2)
    first = manager.save(1, model, optimizer=optimizer)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    _torch_save_on_a_full_disk(monkeypatch, free_after=4096)
    with pytest.raises(OSError) as info:
        manager.save(2, model, optimizer=optimizer)
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC and "No space left on device" in message
    assert f"it needs about {size} bytes (the size of step_00000001), 4096 bytes" in message
    assert "file system" in message and "mounted at /" in message and IOSTREAM_ERROR in message
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    assert manager.latest() == first


def test_an_iostream_error_with_space_left_is_not_called_a_full_disk(
    trainer, tmp_path, monkeypatch
):
    model, _, optimizer = trainer
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, model, optimizer=optimizer)
    _torch_save_on_a_full_disk(monkeypatch, free_after=10**12)  # room left: another fault
    with pytest.raises(RuntimeError, match=IOSTREAM_ERROR):
        manager.save(2, model, optimizer=optimizer)


def _tmpfs(path, size: str) -> bool:
    import subprocess

    path.mkdir()
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_a_first_checkpoint_on_a_real_full_disk_is_named(trainer, tmp_path):
    """A real full disk (a 4 KiB tmpfs; needs the right to mount, e.g. root): torch's
    common.pt write fails with the bare iostream error; the save names the disk."""
    import errno
    import subprocess

    disk = tmp_path / "disk"
    if not _tmpfs(disk, "4k"):
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        model, _, optimizer = trainer
        manager = CheckpointManager(disk, keep_last=2)
        with pytest.raises(OSError) as info:
            manager.save(1, model, optimizer=optimizer)
        message = str(info.value)
        assert info.value.errno == errno.ENOSPC, message
        assert f"the tmpfs file system tmpfs mounted at {disk}" in message
        assert "it needs more than the" in message
        assert not list((disk / "checkpoints").glob("*.tmp"))
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_resume_with_changed_optimizer_settings_trains_with_them(trainer, tmp_path):
    """A resume with ``--allow-changes optimizer.lr=...`` (weight decay, betas, eps too):
    the resumed updates use the new settings. Before, megatron's scheduler took max_lr and
    weight decay from the checkpoint and torch's param groups kept the saved betas and eps:
    steps 5-6 trained at lr 1e-4 while config.yaml said 1e-3. Reference: AdamW's update
    by hand in float64 from the loaded moments."""
    from megatron_rl.trainer.step import forward_backward

    model, ddp, _ = trainer
    old = OptimizerConfig(lr=1e-4, warmup_steps=2, weight_decay=0.01, grad_clip=0.0)
    optim = build_optimizer(ddp, old)
    for seed in range(4):
        train_step(ddp, optim.optimizer, seed)
        optim.scheduler.step(increment=1)
    manager = CheckpointManager(tmp_path)
    manager.save(4, model, {"scheduler": optim.state_dict()}, optimizer=optim.optimizer)

    new = OptimizerConfig(
        lr=1e-3, warmup_steps=2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6, grad_clip=0.0
    )
    resumed = build_optimizer(ddp, new)
    loaded = manager.load(model, optimizer=resumed.optimizer)
    resumed.load_state_dict(loaded.extra["scheduler"])
    assert resumed.scheduler.num_steps == 4  # the schedule's step is the checkpoint's
    groups = resumed.optimizer.param_groups
    assert {g["lr"] for g in groups} == {1e-3}
    assert {g["weight_decay"] for g in groups if g.get("wd_mult", 1.0) == 1.0} == {0.1}
    assert {tuple(g["betas"]) for g in groups} == {(0.8, 0.99)}
    assert {g["eps"] for g in groups} == {1e-6}

    # step 5: one decayed weight moves as AdamW with the new settings moves it
    inner = [o.optimizer for o in getattr(resumed.optimizer, "chained_optimizers", [optim])]
    opt, group = next(
        (o, g) for o in inner for g in o.param_groups if g["weight_decay"] > 0 and g["params"]
    )
    p = max(group["params"], key=lambda t: t.numel())
    tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(9))

    def loss_fn(mb, logits):
        loss = -logits_to_logprobs(logits, mb.tokens).mean()
        return loss, loss.detach().reshape(1), torch.zeros(0)

    forward_backward(ddp, resumed.optimizer, [SFTBatch(tokens, tokens[:, 1:] >= 0)], loss_fn, 1)
    before = p.detach().double().clone()
    grad = p.main_grad.detach().double().clone()
    state = opt.state[p]
    m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()
    t = float(state["step"]) + 1
    (b1, b2), eps, lr, wd = (0.8, 0.99), 1e-6, 1e-3, 0.1
    m, v = b1 * m + (1 - b1) * grad, b2 * v + (1 - b2) * grad**2
    denom = (v / (1 - b2**t)).sqrt() + eps
    expected = before * (1 - lr * wd) - lr * (m / (1 - b1**t)) / denom
    resumed.optimizer.step()
    moved = p.detach().double() - before  # ~1e-3 (lr); float32 parameters: a few ulps' error
    torch.testing.assert_close(moved, expected - before, rtol=1e-4, atol=3e-8)
