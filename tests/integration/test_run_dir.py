"""The run directory: one owner (lock), no silent restart over history, config changes on
resume, a run stopped by Ctrl-C (SIGINT to its whole process group) that checkpoints and
resumes, and a finished run that is not trained again."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.config import load_run_config, save_run_config, to_yaml
from megatron_rl.trainer.rundir import RunDirError, check_changes, claim_run_dir, save_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"


def _config(*overrides: str):
    return load_run_config(RECIPE, list(overrides), check_model=False)


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that holds the run directory's lock until killed."""
    code = (
        "import sys, time; from pathlib import Path; from megatron_rl.trainer.rundir import "
        "RunLock; lock = RunLock(Path(sys.argv[1])); print('LOCKED', flush=True); "
        "time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "LOCKED"
    return proc


def test_a_second_run_in_a_locked_run_dir_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = _hold_lock(run_dir)
    try:
        with pytest.raises(RunDirError) as info:
            claim_run_dir(_config(), run_dir)
        message = str(info.value)
        assert f"pid {holder.pid}" in message and socket.gethostname() in message
        assert "in use by another run" in message
    finally:
        holder.kill()
        holder.wait()
    claim = claim_run_dir(_config(), run_dir)  # the holder is gone: the lock is free
    assert f"pid {os.getpid()}" in (run_dir / "run.lock").read_text()
    claim.lock.release()


def test_history_without_a_checkpoint_is_refused_unless_restart(tmp_path):
    """No intact checkpoint but metrics and checkpoint directories: a new run would rewrite
    metrics.jsonl from step 0 and later overwrite the old checkpoints, silently. Refused,
    naming what is there; --restart moves it aside and starts over."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000003.tmp").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000002").mkdir()  # no meta.json: not intact
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n' * 5)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank0.log").write_text("the old run's log\n")
    (run_dir / "logs" / "tiny_cpu-7-trainer.log").write_text("this Slurm job's log\n")
    with pytest.raises(RunDirError) as info:
        claim_run_dir(_config(), run_dir)
    message = str(info.value)
    assert "metrics.jsonl (5 records)" in message
    assert "step_00000002, step_00000003.tmp" in message and "--restart" in message
    assert (run_dir / "metrics.jsonl").is_file()  # nothing touched

    claim = claim_run_dir(_config(), run_dir, restart=True)
    (aside,) = run_dir.glob("previous_*")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' * 5
    assert (aside / "checkpoints" / "step_00000003.tmp").is_dir()
    assert (aside / "logs" / "rank0.log").read_text() == "the old run's log\n"  # and its log
    assert (run_dir / "logs" / "tiny_cpu-7-trainer.log").is_file()  # written by the job
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    claim.lock.release()
    # A fresh directory has no history: no --restart needed.
    claim_run_dir(_config(), tmp_path / "fresh").lock.release()


def test_what_a_run_wrote_before_its_first_checkpoint_is_not_history(tmp_path, caplog):
    """A job SIGKILLed before its first checkpoint was complete (its warm start's record, a
    step's, the first save's .tmp) is requeued: it starts over, no --restart. Once a
    checkpoint was complete (``latest`` written), the same files are history again."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000001.tmp" / "state").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "warm_start_loss": 1.0}\n{"step": 1}\n')
    with caplog.at_level("WARNING", logger="megatron_rl.trainer.rundir"):
        claim_run_dir(_config(), run_dir).lock.release()
    assert (
        "a run stopped before its first checkpoint wrote (metrics.jsonl (2 records)" in caplog.text
    )
    assert not list(run_dir.glob("previous_*"))  # nothing moved: the run rewrites it

    (run_dir / "checkpoints" / "latest").write_text("step_00000001\n")  # since pruned or lost
    with pytest.raises(RunDirError, match=r"metrics.jsonl \(2 records\)"):
        claim_run_dir(_config(), run_dir)


def test_changed_settings_on_resume_need_allow_changes(tmp_path, caplog):
    path = tmp_path / "config.yaml"
    save_run_config(_config(), path)
    safe = to_yaml(_config("training.max_steps=500", "logging.tensorboard=false"))
    with caplog.at_level("WARNING"):
        changes = check_changes(path, safe, allow_changes=False)
    assert changes == {"training.max_steps": (120, 500), "logging.tensorboard": (True, False)}
    assert "training.max_steps changed from 120 to 500" in caplog.text

    unsafe = to_yaml(_config("optimizer.lr=2e-4", "training.max_steps=500"))
    with pytest.raises(RunDirError) as info:
        check_changes(path, unsafe, allow_changes=False)
    message = str(info.value)
    assert "optimizer.lr: 0.0001 -> 0.0002" in message and "--allow-changes" in message
    assert "training.max_steps:" not in message  # safe: not among the refused
    assert set(check_changes(path, unsafe, allow_changes=True)) == {
        "optimizer.lr",
        "training.max_steps",
    }


def test_config_yaml_is_written_only_by_save_config(tmp_path):
    """The claim checks; the config is written once the run is built (save_config)."""
    run_dir = tmp_path / "run"
    claim = claim_run_dir(_config("optimizer.lr=3e-4"), run_dir)
    assert not (run_dir / "config.yaml").exists()
    save_config(claim, run_dir)
    assert load_run_config(run_dir / "config.yaml", check_model=False).optimizer.lr == 3e-4
    claim.lock.release()
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        claim_run_dir(_config(), run_dir / "config.yaml")


def _checkpoint(run_dir: Path, step: int, config_text: str | None) -> Path:
    """An intact checkpoint of ``step`` as CheckpointManager finds it (meta.json, the parts
    it names, a manifest), with ``config_text`` as its config.yaml (None: an older one)."""
    import json

    from megatron_rl.conversion.checkpoint import MODEL_SUBDIR
    from megatron_rl.trainer.state import _manifest

    path = run_dir / "checkpoints" / f"step_{step:08d}"
    (path / "model" / MODEL_SUBDIR).mkdir(parents=True)
    (path / "state").mkdir()
    for name in ("loop.pt", "rng_00000.pt"):
        (path / "state" / name).write_bytes(b"x")
    if config_text is not None:
        (path / "config.yaml").write_text(config_text)
    meta = {"step": step, "world_size": 1, "optimizer": False}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "manifest.json").write_text(json.dumps(_manifest(path)))
    return path


def test_a_hand_edited_config_yaml_is_compared_with_the_checkpoints_config(tmp_path, caplog):
    """The resume command loads RUN_DIR/config.yaml; the check compared the recipe with that
    same file, so a hand edit of it (prompts_per_step 16 -> 8) took effect silently. The
    checkpoint's own copy of its config is the reference now; a checkpoint written before
    they kept one falls back to RUN_DIR/config.yaml, with a warning."""
    run_dir = tmp_path / "run"
    trained = to_yaml(_config())
    _checkpoint(run_dir, 3, trained)
    edited = _config("batch.prompts_per_step=8")
    save_run_config(edited, run_dir / "config.yaml")  # the hand edit
    recipe = load_run_config(run_dir / "config.yaml", check_model=False)
    with pytest.raises(RunDirError, match=r"batch.prompts_per_step: 16 -> 8") as info:
        claim_run_dir(recipe, run_dir)
    assert "checkpoints/step_00000003/config.yaml" in str(info.value)
    claim_run_dir(_config(), run_dir).lock.release()  # the recipe it was trained with

    older = tmp_path / "older"
    _checkpoint(older, 3, None)
    save_run_config(_config(), older / "config.yaml")
    with caplog.at_level("WARNING", logger="megatron_rl.trainer.rundir"):
        with pytest.raises(RunDirError, match=r"batch.prompts_per_step: 16 -> 8"):
            claim_run_dir(edited, older)
    assert "keeps no copy of its config" in caplog.text


def test_a_change_a_resume_cannot_apply_is_refused_even_when_allowed(tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 3, to_yaml(_config()))
    with pytest.raises(RunDirError, match=r"warm_start.steps: 100 -> 7, which a resumed run"):
        claim_run_dir(_config("warm_start.steps=7"), run_dir, allow_changes=True)
    claim_run_dir(_config("optimizer.lr=1e-3"), run_dir, allow_changes=True).lock.release()


def test_a_finished_run_run_again_is_already_finished_unless_its_budget_grows(tmp_path):
    """Re-running a finished run started its engines, trained "steps 121 to 120", saved and
    validated step 120 again at more GPU-hours. Its metrics end in run_finished at its last
    checkpoint's step: nothing to do, unless training.max_steps or max_gpu_hours grew."""
    from megatron_rl.trainer.rundir import AlreadyFinished

    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 120, to_yaml(_config()))
    records = '{"step": 120, "reward_mean": 0.5}\n{"step": 120, "run_finished": true}\n'
    (run_dir / "metrics.jsonl").write_text(records)
    with pytest.raises(AlreadyFinished, match=r"already finished \(120 steps"):
        claim_run_dir(_config(), run_dir)
    claim_run_dir(_config("training.max_steps=240"), run_dir).lock.release()  # trains on
    # killed after its last checkpoint, before its end record: its resume ends it
    (run_dir / "metrics.jsonl").write_text('{"step": 120, "reward_mean": 0.5}\n')
    claim_run_dir(_config(), run_dir).lock.release()
    # checkpoint.save_at_end off: finished at 120, its newest checkpoint of step 100
    other = tmp_path / "no_save_at_end"
    _checkpoint(other, 100, to_yaml(_config()))
    (other / "metrics.jsonl").write_text(records)
    with pytest.raises(AlreadyFinished, match=r"already finished \(120 steps"):
        claim_run_dir(_config(), other)


def test_a_finished_run_without_checkpoints_is_moved_aside_not_overwritten(tmp_path, caplog):
    """checkpoint.every_steps 0 without save_at_end: the finished run's metrics were taken
    for those of a run stopped before its first checkpoint and rewritten (with a warning)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = '{"step": 6, "reward_mean": 0.5}\n{"step": 6, "run_finished": true}\n'
    (run_dir / "metrics.jsonl").write_text(records)
    with caplog.at_level("WARNING", logger="megatron_rl.trainer.rundir"):
        claim_run_dir(_config(), run_dir).lock.release()
    (aside,) = run_dir.glob("previous_*")
    assert (aside / "metrics.jsonl").read_text() == records
    assert not (run_dir / "metrics.jsonl").exists()
    assert "a finished run without checkpoints" in caplog.text


# -- whole runs (the CLI in a subprocess) -------------------------------------------------

SMALL = [
    "warm_start.steps=5",
    "data.val_size=16",
    "data.synthetic.num_problems=200",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "validation.enabled=false",
    "checkpoint.every_steps=2",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
]


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(RECIPE), *SMALL, *overrides]
    return [*cmd, "--run-dir", str(run_dir)]


def _train(run_dir: Path, *overrides: str, timeout: int) -> subprocess.CompletedProcess:
    """``megatron-rl train`` of the small recipe to its end (output captured)."""
    return subprocess.run(
        _cmd(run_dir, *overrides),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _env() -> dict[str, str]:
    from megatron_rl.platform import LAUNCHER_VARS

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, "VLLM_CPU_KVCACHE_SPACE": "1"}


def _steps(run_dir: Path) -> list[int]:
    from megatron_rl.scaling.records import read_records

    return [r["step"] for r in read_records(run_dir / "metrics.jsonl") if "reward_mean" in r]


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A run stopped by Ctrl-C after its checkpoint at step 2: SIGINT to its whole process
    group, as a terminal sends it (SIGTERM to the group, as scancel and a preemption send it,
    is test_tracking's and the start-up test's): (run_dir, exit status, output)."""
    run_dir = tmp_path_factory.mktemp("preempted") / "run"
    log = run_dir.parent / "output.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _cmd(run_dir, "training.max_steps=40"),
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=out,
            start_new_session=True,  # its own group, as a job's processes under srun
        )
        meta = run_dir / "checkpoints" / "step_00000002" / "meta.json"
        deadline = time.monotonic() + 400
        while not meta.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert meta.is_file(), log.read_text()[-3000:]
        time.sleep(2)  # every helper of the first save (and of the step after) is up
        os.killpg(proc.pid, signal.SIGINT)
        try:
            status = proc.wait(timeout=300)
        finally:
            proc.kill()
    return run_dir, status, log.read_text()


@pytest.mark.timeout(900)  # 96 s for the run, the resume and the re-run on a quiet machine
def test_ctrl_c_checkpoints_the_run_which_resumes_and_then_is_finished(preempted, tmp_path):
    """Ctrl-C (SIGINT) stops the run as SIGTERM does: the checkpoint it asks for completes
    (with SIGTERM it once failed with BrokenPipeError: the group's signal had killed megatron's
    checkpoint helper process), exit status 0, and the resumed run continues from it, not from
    the periodic checkpoint before. Before, SIGINT printed "failed", a KeyboardInterrupt
    traceback, exited 130 and saved nothing. Run again once finished, it does nothing: "already
    finished" (before: it started its engines, trained "steps N+1 to N", saved again and wrote
    a second run_finished record)."""
    run_dir, status, output = preempted
    assert status == 0, output[-3000:]
    signalled = max(_steps(run_dir))
    assert signalled > 2
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert f"step_{signalled:08d}" in ckpts, ckpts
    assert not [name for name in ckpts if name.endswith(".tmp")], ckpts
    assert f"stopping on SIGINT after checkpointing step {signalled}" in output
    assert "KeyboardInterrupt" not in output and "Traceback" not in output
    # the end summary after a signal: the steps done and the command that resumes
    assert f"stopped on SIGINT:\n  steps: {signalled} this job, {signalled} of 40" in output
    assert f"--run-dir {run_dir}" in output
    # checkpoint.async_save: the periodic save of step 2 was written while training went on,
    # completed at a later step's finalize; the signal's save was synchronous
    step2 = run_dir / "checkpoints" / "step_00000002"
    assert f"checkpoint {step2}: writing in the background" in output
    assert f"saved checkpoint {step2} (written in the background" in output
    assert f"saved checkpoint {run_dir}/checkpoints/step_{signalled:08d} in " in output

    resumed = tmp_path / "run"
    shutil.copytree(run_dir, resumed)
    proc = _train(resumed, f"training.max_steps={signalled + 1}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {resumed}/checkpoints/step_{signalled:08d}" in proc.stderr
    assert _steps(resumed) == list(range(1, signalled + 2))  # every step once
    # the same command again: the run is finished
    metrics = (resumed / "metrics.jsonl").read_bytes()
    checkpoints = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    proc = _train(resumed, f"training.max_steps={signalled + 1}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"already finished ({signalled + 1} steps" in proc.stderr
    assert "starting 1 engine(s)" not in proc.stderr
    assert (resumed / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == checkpoints


@pytest.mark.timeout(600)
def test_the_cli_refuses_a_locked_run_dir_and_changed_settings(preempted, tmp_path):
    """A run directory in use (a requeued job while the old one lives) and a resume with a
    changed learning rate are refused by `megatron-rl train` (exit status 2, one line
    naming the holder / the key); config.yaml keeps the run's settings."""
    run_dir = tmp_path / "run"
    shutil.copytree(preempted[0], run_dir)
    config = (run_dir / "config.yaml").read_bytes()
    holder = _hold_lock(run_dir)
    try:
        proc = _train(run_dir, "training.max_steps=40", timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"in use by another run (host {socket.gethostname()} pid {holder.pid}" in proc.stderr

    proc = _train(run_dir, "training.max_steps=40", "optimizer.lr=5e-4", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "optimizer.lr: 0.0001 -> 0.0005" in proc.stderr
    assert (run_dir / "config.yaml").read_bytes() == config


# -- a job preempted at each phase of its start-up, requeued each time ---------------------

VAL_SAMPLES = 128

STARTUP = (
    "warm_start.steps=20",  # a few seconds: long enough to be signalled in
    "batch.prompts_per_step=2",
    "batch.samples_per_prompt=2",
    "checkpoint.every_steps=1",
    "training.max_steps=4",
    # one validation, at step 4: long (16 prompts x 128 samples), to be signalled in
    "validation.enabled=true",
    "validation.at_start=false",
    "validation.every_steps=4",
    f"validation.samples_per_prompt={VAL_SAMPLES}",
)


def _job(
    run_dir: Path, log: Path, marker: str | None, until: str | None = None
) -> tuple[int, str, float]:
    """One job of the run (its own process group, as under srun): SIGTERM to the whole
    group once ``marker`` is in its output (None: let it finish). (status, its output, the
    seconds from the signal to its exit, or to ``until`` appearing in its output)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _cmd(run_dir, *STARTUP),
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
        signalled = time.monotonic()
        seen = None
        try:
            deadline = time.monotonic() + 400
            while marker is not None and proc.poll() is None and time.monotonic() < deadline:
                if marker in log.read_text(errors="replace"):
                    os.killpg(proc.pid, signal.SIGTERM)
                    signalled = time.monotonic()
                    break
                time.sleep(0.05)
            while until is not None and proc.poll() is None and time.monotonic() < deadline:
                if until in log.read_text(errors="replace"):
                    seen = time.monotonic()
                    break
                time.sleep(0.05)
            status = proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return status, log.read_text(errors="replace"), (seen or time.monotonic()) - signalled


@pytest.mark.timeout(900)  # 6 jobs: 131-165 s for the first 5 on a loaded machine; 750 s at load 45
def test_a_job_preempted_at_each_phase_of_its_start_up_is_requeued_and_finishes(tmp_path):
    """SIGTERM to the job's process group while it warm-starts, while its engines start,
    while its first checkpoint is written, in the first step of a requeued job, and during
    a long validation (step 4's): each job exits 0 (the requeue's status) and the next one
    starts without --restart (the warm start's record is not history); the run ends with one
    warm-start record, every step once and the one validation an unsignalled run makes.
    Before: the first job died of the signal (-15) and the second was refused ("history of
    a run but no intact checkpoint: metrics.jsonl (1 records)"); a signal during the
    validation was answered after the whole pass (at scale longer than the signal's window:
    SIGKILL, no checkpoint)."""
    from megatron_rl.scaling.records import read_records

    run_dir = tmp_path / "run"
    phases = [
        ("warm start: 20 steps", "during start-up (during the warm start)"),
        ("starting 1 engine(s)", "during start-up (while the engines started)"),
        ("step_00000001: writing in the background", "after checkpointing step 2"),
        ("training: steps 3 to 4", "after checkpointing step 3"),  # a requeued job's
        ("step 4: validating", "after checkpointing step 4"),  # the pass is given up
    ]
    for i, (marker, stopped) in enumerate(phases):
        until = "was stopped" if marker.startswith("step 4: validating") else None
        status, output, to_stop = _job(run_dir, tmp_path / f"job{i}.txt", marker, until)
        assert status == 0, output[-3000:]
        assert f"stopping on SIGTERM {stopped}" in output, output[-3000:]
    assert "the validation of step 4 was stopped" in output, output[-3000:]
    assert "step 4: validation pass rate" not in output  # no partial record
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step_00000004" in ckpts and not [c for c in ckpts if c.endswith(".tmp")], ckpts
    assert not [r for r in read_records(run_dir / "metrics.jsonl") if "val_pass_rate" in r]

    status, output, _ = _job(run_dir, tmp_path / "last.txt", None)
    assert status == 0, output[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_00000004" in output
    records = read_records(run_dir / "metrics.jsonl")
    assert len([r for r in records if "warm_start_loss" in r]) == 1
    assert _steps(run_dir) == [1, 2, 3, 4]
    assert [r.get("run_finished") for r in records].count(True) == 1
    # the owed validation, at step 4, whole: what an unsignalled run records (16 x 128)
    (val,) = [r for r in records if "val_pass_rate" in r]
    assert val["step"] == 4 and val["val_samples"] == 16 * VAL_SAMPLES
    # the pass was given up in far less time than it takes (the checkpoint and the exit
    # follow, as for any signal: 5 s here, quiet, for a 9 s pass)
    assert to_stop < val["val_seconds"] / 3, (to_stop, val["val_seconds"])


def test_a_read_only_run_dir_is_one_line_and_exit_2(tmp_path):
    """A run directory the trainer cannot write ended in a traceback at run.lock (exit 1).
    Run as an unprivileged user (root writes anywhere): one line naming the directory, exit 2,
    both for an existing read-only directory and one that cannot be created."""
    import shutil
    import tempfile

    # Under a directory any user can search (pytest's tmp_path is root's alone).
    top = Path(tempfile.mkdtemp(prefix="megatron_rl_ro_"))
    os.chmod(top, 0o755)
    base = top / "ro"
    (base / "run").mkdir(parents=True)
    os.chmod(base / "run", 0o555)
    os.chmod(base, 0o555)
    prefix: list[str] = []
    if os.getuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: cannot drop to an unprivileged user")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    try:
        _refuse_read_only(prefix, tmp_path, (base / "run", base / "new", top / "no" / "x"))
    finally:
        os.chmod(base, 0o755)
        shutil.rmtree(top)


def _refuse_read_only(prefix: list[str], home: Path, run_dirs: tuple[Path, ...]) -> None:
    os.chmod(run_dirs[-1].parent.parent, 0o755)
    run_dirs[-1].parent.mkdir(mode=0o700)  # a parent the user may not search
    for run_dir in run_dirs:
        proc = subprocess.run(
            [*prefix, sys.executable, "-m", "megatron_rl.cli", "train", str(RECIPE),
             "--run-dir", str(run_dir), "--quiet"],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home)},
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert str(run_dir) in proc.stderr and "megatron-rl train: error:" in proc.stderr
