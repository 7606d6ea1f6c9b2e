"""HF exports during training (trainer/hf_export.py): a background process converts complete
checkpoints into RUN_DIR/hf/step_N, equal to an offline `megatron-rl convert mcore-to-hf`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.platform import LAUNCHER_VARS
from megatron_rl.trainer.hf_export import HFExporter, readme_line
from megatron_rl.trainer.state import CheckpointManager

ROOT = Path(__file__).resolve().parents[3]


def _checkpoint(run_dir: Path, preset: str, step: int, keep_last: int = 3) -> Path:
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    torch.manual_seed(step)
    model = build_model(ModelConfig(preset=preset, dtype="float32"), ParallelConfig())
    source = run_dir.parent / "hf_source"  # the run's tokenizer files go with each checkpoint
    source.mkdir(parents=True, exist_ok=True)
    (source / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    manager = CheckpointManager(run_dir, keep_last=keep_last, hf_source_dir=source)
    return manager.save(step, model, {})


def _tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _offline(checkpoint: Path, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    cmd = [sys.executable, "-m", "megatron_rl.cli", "convert", "mcore-to-hf"]
    proc = subprocess.run([*cmd, str(checkpoint / "model"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)  # two conversions: 20-40 s each here (80 s loaded)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama4"])
def test_background_export_equals_the_offline_conversion(megatron_single_rank, tmp_path, preset):
    run_dir = tmp_path / "run"
    checkpoint = _checkpoint(run_dir, preset, 4, keep_last=1)
    exporter = HFExporter(run_dir, every=2, keep_last=2)
    assert exporter.wants(4) and not exporter.wants(3) and not exporter.wants(0)
    exporter.submit(4, checkpoint, {"gpu_hours": 0.125, "val_pass_rate": 0.5})
    assert exporter.busy  # submit returns while the conversion runs
    # The checkpoint is pruned meanwhile (keep_last 1): the export reads its hard links.
    _checkpoint(run_dir, preset, 6, keep_last=1)
    assert not checkpoint.exists()
    exporter.close(timeout_s=300)
    assert exporter.exported == [4] and exporter.failed == []
    exported = run_dir / "hf" / "step_00000004"
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step_00000004"]
    assert (exported / "README.md").read_text().strip() == (
        "megatron_rl checkpoint, step 4, 0.125 GPU-hours, val pass rate 0.5"
    )
    assert (exported / "config.json").is_file() and (exported / "tokenizer_config.json").is_file()
    mine = _tensors(exported)
    # The same checkpoint converted offline (saved again from the same seed) is equal; step
    # 6's model (another seed), which replaced it meanwhile, would not be.
    again = _checkpoint(tmp_path / "again", preset, 4)
    _offline(again, tmp_path / "offline4")
    reference = _tensors(tmp_path / "offline4")
    assert mine.keys() == reference.keys() and len(mine) > 5
    for key in mine:
        assert torch.equal(mine[key], reference[key]), key


def test_a_failed_export_is_logged_and_the_next_one_runs(tmp_path, caplog):
    run_dir = tmp_path / "run"
    exporter = HFExporter(run_dir, every=1, keep_last=1)
    missing = run_dir / "checkpoints" / "step_00000001"  # no such checkpoint
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.hf_export"):
        exporter.submit(1, missing, {})
        exporter.close(timeout_s=120)
    assert exporter.failed == [1] and exporter.exported == []
    assert "HF export of step 1 failed" in caplog.text and "step_00000001.log" in caplog.text
    assert not (run_dir / "hf" / "step_00000001").exists()
    assert not (run_dir / "hf" / "step_00000001.tmp").exists()


def test_one_export_at_a_time_the_newest_request_waits(tmp_path, monkeypatch):
    started = []

    class Proc:  # a conversion that has not ended until told
        def __init__(self, command, **kwargs):
            self.out = Path(command[-1])
            self.returncode = None
            self.pid = 1
            started.append(int(self.out.name[5:13]))

        def poll(self):
            return self.returncode

        def wait(self, timeout=None):
            self.end()
            return 0

        def end(self):
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text("{}")
            self.returncode = 0

    procs = []
    monkeypatch.setattr(
        "megatron_rl.trainer.hf_export.subprocess.Popen",
        lambda *a, **k: procs.append(Proc(*a, **k)) or procs[-1],
    )
    exporter = HFExporter(tmp_path, every=1, keep_last=2)
    for step in (1, 2, 3):
        exporter.submit(step, tmp_path / "checkpoints" / f"step_{step:08d}", {})
    assert started == [1]  # 2 was superseded by 3 while 1 ran
    procs[0].end()
    exporter.poll()
    assert started == [1, 3] and exporter.exported == [1]
    exporter.submit(4, tmp_path / "checkpoints" / "step_00000004", {})
    exporter.close()
    assert started == [1, 3, 4] and exporter.exported == [1, 3, 4]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step_00000003", "step_00000004"]


def test_leftovers_of_a_killed_export_are_removed_at_start(tmp_path):
    for name in ("step_00000002.tmp", "step_00000002.src", "step_00000001"):
        (tmp_path / "hf" / name).mkdir(parents=True)
    HFExporter(tmp_path, every=1, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step_00000001"]


def test_readme_line():
    assert (
        readme_line(7, {}) == "megatron_rl checkpoint, step 7, GPU-hours unknown, not validated yet"
    )


def test_export_steps_must_be_checkpoint_steps():
    from megatron_rl.config import ConfigError, load_run_config

    recipe = ROOT / "recipes" / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"'checkpoint.export_hf_every': must be a multiple"):
        load_run_config(recipe, ["checkpoint.every_steps=20", "checkpoint.export_hf_every=30"])
    config = load_run_config(recipe, ["checkpoint.every_steps=20", "checkpoint.export_hf_every=40"])
    assert config.checkpoint.export_hf_every == 40


def test_an_export_carries_the_validation_of_its_own_step(tmp_path):
    # An async save completes steps later, perhaps after another validation: the README must
    # still give the pass rate as of the checkpoint's step (CI once caught step 6's on step 3).
    from types import SimpleNamespace

    from megatron_rl.trainer import loop
    from megatron_rl.trainer.compute import ComputeClock

    exporter = HFExporter(tmp_path, every=3, keep_last=2)
    submitted, completions = [], []
    exporter.submit = lambda step, path, notes: submitted.append((step, notes))
    checkpoints = SimpleNamespace(
        save=lambda step, model, extra, optimizer, async_save, on_complete: completions.append(
            on_complete
        )
    )
    run = SimpleNamespace(
        exporter=exporter, clock=ComputeClock(1), checkpoints=checkpoints, model=None
    )
    exporter.val_pass_rate = 0.25  # the validation of step 3
    loop.save_checkpoint(run, 3, SimpleNamespace(optimizer=None), {})
    exporter.val_pass_rate = 0.5  # step 6's, before step 3's save completes
    completions[0](tmp_path / "checkpoints" / "step_00000003")
    assert submitted == [(3, {"gpu_hours": 0.0, "val_pass_rate": 0.25})]


EXPORT_THEN_WAIT = """
import sys, time
from pathlib import Path
from megatron_rl.trainer.hf_export import HFExporter
if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    exporter = HFExporter(run_dir, every=1, keep_last=1)
    exporter.submit(1, run_dir / "checkpoints" / "step_00000001", {})
    print("HELPER_PID", exporter._proc.pid, flush=True)
    time.sleep(600)
"""


def test_the_export_process_ends_with_its_killed_trainer(tmp_path):
    """A SIGKILLed trainer cannot stop its HF export; the export went on writing
    hf/step_N.tmp under PID 1 (the requeued job's clean-up then deleted it under it)."""
    from support.orphans import assert_helper_exits_with_parent

    # the converter takes seconds to import torch before it would fail on the missing
    # checkpoint: it is running when its parent is killed
    assert_helper_exits_with_parent(
        EXPORT_THEN_WAIT, [str(tmp_path / "run")], tmp_path, "the HF export", within=5
    )


class _Conversion:
    """A conversion process that has not ended until told (``end``), or is killed."""

    def __init__(self, command, **kwargs):
        self.model, self.out = Path(command[-2]), Path(command[-1])
        self.returncode, self.pid = None, 1

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.returncode = -9

    def end(self):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text("{}")
        self.returncode = 0


def test_a_stop_leaves_its_exports_to_the_next_run(tmp_path, monkeypatch):
    """A stop on a signal waited 0 s for the running export and killed it (an empty log
    left), and the resumed run never exported the missed steps. Now the stopped exports stay
    pinned with their notes, the next run exports them first, even once the checkpoint is
    pruned, and a checkpoint of an export step newer than every export too."""
    procs: list[_Conversion] = []
    monkeypatch.setattr(
        "megatron_rl.trainer.hf_export.subprocess.Popen",
        lambda *a, **k: procs.append(_Conversion(*a, **k)) or procs[-1],
    )
    checkpoints = {}
    for step in (2, 4, 6):
        model = tmp_path / "checkpoints" / f"step_{step:08d}" / "model"
        model.mkdir(parents=True)
        (model / "weights.bin").write_bytes(bytes([step]) * 8)
        checkpoints[step] = model.parent
    hf = tmp_path / "hf"
    exporter = HFExporter(tmp_path, every=2, keep_last=3)
    exporter.submit(2, checkpoints[2], {"gpu_hours": 0.5, "val_pass_rate": 0.25})
    exporter.submit(4, checkpoints[4], {"gpu_hours": 1.0})  # waits
    exporter.interrupt()  # the stop
    assert procs[0].returncode == -9 and exporter.exported == [] and exporter.failed == []
    assert not (hf / "step_00000002.log").exists() and not (hf / "step_00000002.tmp").exists()
    import shutil

    shutil.rmtree(checkpoints.pop(2))  # pruned by the signal's save

    resumed = HFExporter(tmp_path, every=2, keep_last=3)
    assert resumed.resume(sorted(checkpoints.values())) == [2, 4, 6]
    assert procs[1].model == hf / "step_00000002.src"  # the pinned files of the pruned one
    for _ in range(3):
        procs[-1].end()
        resumed.poll()
    assert [p.model.name for p in procs[1:]] == [f"step_0000000{s}.src" for s in (2, 4, 6)]
    assert resumed.exported == [2, 4, 6] and not resumed.busy
    assert sorted(p.name for p in hf.iterdir()) == [f"step_0000000{s}" for s in (2, 4, 6)]
    readme = (hf / "step_00000002" / "README.md").read_text()
    assert readme.strip() == readme_line(2, {"gpu_hours": 0.5, "val_pass_rate": 0.25})
    # nothing is due any more
    assert HFExporter(tmp_path, every=2, keep_last=3).resume(sorted(checkpoints.values())) == []


def test_the_export_ignores_the_jobs_signals(tmp_path, caplog):
    """SIGTERM and SIGINT to the job's process group (preemption, Ctrl-C) reached the
    converter, which died of them; the trainer decides what happens to an export. Here the
    converter, signalled at once, goes on to its own end (a missing checkpoint: status 2)."""
    import signal
    import time

    exporter = HFExporter(tmp_path, every=1, keep_last=1)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.hf_export"):
        exporter.submit(1, tmp_path / "checkpoints" / "step_00000001", {})
        time.sleep(0.5)  # past its preexec: the converter runs
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(exporter._proc.pid, signum)
        exporter.close(timeout_s=120)
    assert exporter.failed == [1]
    assert "HF export of step 1 failed (status 2 after" in caplog.text  # the CLI's error
