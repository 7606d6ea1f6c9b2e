"""W&B tracking (logging.wandb) in offline mode, read back from W&B's own run files: one run
per run directory, every metrics record once across kills and resumes. No network: offline
runs only, and the one online case fails before it would need one."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.wandb_files import merged_history, offline_runs

from megatron_rl.trainer.metrics import MetricsLogger, read_records
from megatron_rl.trainer.tracking import (
    STATE_FILE,
    WANDB_DIR,
    WRITTEN_AFTER,
    TrackingError,
    WandbConfig,
    WandbTracker,
)

ROOT = Path(__file__).resolve().parents[2]
HOME = os.environ.get("HOME", "")  # the trainer's caches (vLLM, HF) live there
RECIPE = {"name": "tiny", "optimizer": {"lr": 1e-3}, "logging": {"wandb": {"mode": "offline"}}}
# W&B bookkeeping in every history row, and media fields
W_AND_B_KEYS = ("_timestamp", "_runtime", "_step")


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    """No W&B settings, credentials or network from this machine: W&B's own directories
    in tmp, no key, and a server address nothing listens on."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    # wandb.init sets WANDB_SERVICE (its service's address) for child processes to share it:
    # a job here must start its own, as a requeued job does; removed again after the test.
    monkeypatch.setenv("WANDB_SERVICE", "")
    monkeypatch.delenv("WANDB_SERVICE")


def job_env() -> dict[str, str]:
    """The environment of a job run as a child process (no W&B service of this process)."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _tracker(run_dir: Path, mode: str = "offline") -> WandbTracker:
    return WandbTracker(WandbConfig(mode=mode, tags=["ci"]), run_dir, RECIPE, "tiny")


def _records(first_step: int, last_step: int) -> list[dict]:
    """Fake training records, with a validation (and its domains) every 2 steps."""
    out = []
    for step in range(first_step, last_step + 1):
        hours = 0.01 * step
        out.append({"step": step, "gpu_hours": hours, "reward_mean": 0.1 * step,
                    "prompt_ids": [step, step + 1], "loss": -0.5 * step})  # fmt: skip
        if step % 2 == 0:
            out.append({"step": step, "gpu_hours": hours, "val_pass_rate": 0.05 * step,
                        "val_pass_rate/math": 0.04 * step, "val_pass_rate/code": 0.06 * step})  # fmt: skip
    return out


def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float))}


def _history(row: dict) -> dict:
    """A W&B history row as the record it mirrors: no W&B fields, no media."""
    media = {k.split("/")[0] for k in row if k.endswith("/_type")}
    return {
        k: v
        for k, v in row.items()
        if k not in W_AND_B_KEYS and k.split("/")[0] not in media and not k.startswith("moe/")
    }


def _finished_parts(run_dir: Path, timeout: float = 60.0) -> list:
    """The offline parts of a run whose last job finished it: W&B's service writes the end of
    a run's file a moment after ``finish()`` returns (seen: the exit record missing when read
    at once), so wait for it."""
    deadline = time.monotonic() + timeout
    while True:
        parts = offline_runs(run_dir)
        if (parts and parts[-1].finished) or time.monotonic() > deadline:
            return parts
        time.sleep(0.2)


def _run_ids(parts: list) -> set[str]:
    """The W&B runs of offline parts (a job killed within a second may leave a .wandb file
    with no record at all: W&B never wrote its buffer)."""
    assert all(p.run_id or not p.rows for p in parts)
    return {p.run_id for p in parts if p.run_id}


def _assert_rows_are_the_records(rows: list[dict], records: list[dict]) -> None:
    assert [r["_step"] for r in rows] == list(range(len(records)))  # every record once
    for row, record in zip(rows, records):
        expected = _scalars(record)
        got = _history(row)
        assert got.keys() == expected.keys(), (row["_step"], got, expected)
        for key, value in expected.items():
            assert math.isclose(got[key], value, rel_tol=1e-12), (row["_step"], key)


def test_every_record_goes_to_one_offline_run_with_config_axes_curve_and_preflight(tmp_path):
    from megatron_rl.preflight.report import CheckResult, Report

    run_dir = tmp_path / "run"
    report = Report("tiny.yaml", str(run_dir), "cpu", 1, seconds=3.0)
    report.results = [
        CheckResult("engines", "PASS", "2 of 2", ">= 2", 1.5),
        CheckResult("weights", "FAIL", "gap 0.3", "< 1e-3", 0.5, "logprobs disagree"),
    ]
    report.write(run_dir)
    records = [{"step": 0, "gpu_hours": 0.0, "warm_start_loss": 1.25}, *_records(1, 4)]
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
    metrics.truncate(0)  # the run's start
    for record in records:
        metrics.log(record)
        if "reward_mean" in record:  # a MoE step: per-layer loads, not in metrics.jsonl
            metrics.log_tensorboard(record["step"], {"moe/layer_0/load": record["step"] / 8})
    metrics.close()

    (part,) = _finished_parts(run_dir)
    assert part.finished and part.branch_point is None
    assert part.run_id == json.loads((run_dir / WANDB_DIR / STATE_FILE).read_text())["run_id"]
    assert part.config["optimizer"] == {"lr": 1e-3} and part.config["name"] == "tiny"
    _assert_rows_are_the_records(part.rows, read_records(run_dir / "metrics.jsonl"))
    for row, record in zip(part.rows, records):
        if "reward_mean" in record:  # the per-layer series in the row of its step
            assert row["moe/layer_0/load"] == record["step"] / 8
        # the curve after each validation (a PNG W&B copied into the run's media)
        has_curve = row.get("reward_curve/_type") == "image-file"
        assert has_curve == ("val_pass_rate" in record), row
        if has_curve:
            assert (part.path / "files" / row["reward_curve/path"]).is_file()
    assert part.rows[0]["preflight/_type"] == "table-file"  # with the first record
    table = json.loads((part.path / "files" / part.rows[0]["preflight/path"]).read_text())
    assert table["columns"][:2] == ["check", "status"]
    assert [r[:2] for r in table["data"]] == [["engines", "PASS"], ["weights", "FAIL"]]
    axes = {(m.name or m.glob_name): m.step_metric for m in part.metrics}
    assert axes["*"] == "step" and "gpu_hours" in axes and "step" in axes
    for key in ("val_pass_rate", "val_pass_rate/math", "val_pass_rate/code"):
        assert axes[key] == "gpu_hours", key
    state = json.loads((run_dir / WANDB_DIR / STATE_FILE).read_text())
    assert state["written"] == len(records) - 1  # a normal end: all of it written


KILLED_JOB = """
import os, signal, sys, time
sys.path[:0] = {paths!r}  # this file's directory, and tests/ for support.*
from test_tracking import _records, _tracker
from megatron_rl.trainer import tracking
from megatron_rl.trainer.metrics import MetricsLogger
from pathlib import Path

tracking.WRITTEN_AFTER["offline"] = {written_after}
run_dir = Path({run_dir!r})
records = _records(1, 6)  # 9 records
metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
metrics.truncate(0)
for record in records[:4]:
    metrics.log(record)
time.sleep({wait})  # records 0-2 are written now (record 3's row is still open)
for record in records[4:7]:
    metrics.log(record)
os.kill(os.getpid(), signal.SIGKILL)  # no finish: W&B writes nothing more
"""


@pytest.mark.timeout(120)  # ~15 s
@pytest.mark.parametrize("waited", [True, False], ids=["waited", "at_once"])
def test_a_killed_job_resumed_from_its_checkpoint_continues_the_run_with_every_record_once(
    tmp_path, waited
):
    """A job logs 7 records and is SIGKILLed; its last checkpoint kept 6 (metrics.jsonl is cut
    back to them on resume). The next job continues the same W&B run, rewound to the last
    record the killed job is known to have written, logs the records after it again from
    metrics.jsonl, then its own: once synced, the run has every record once, with the
    values of metrics.jsonl. ``at_once``: a job killed before any record is known written
    (within seconds of its first; here made sure by a delay longer than the job): the whole
    history is rewound, and the run is still the same."""
    run_dir = tmp_path / "run"
    after = WRITTEN_AFTER["offline"] if waited else 3600.0
    wait = after + 0.5 if waited else 0.0
    script = KILLED_JOB.format(
        paths=[str(Path(__file__).resolve().parent), str(ROOT / "tests")],
        run_dir=str(run_dir),
        wait=wait,
        written_after=after,
    )
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=job_env(), cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL
    state = json.loads((run_dir / WANDB_DIR / STATE_FILE).read_text())
    # waited: logged 4 records, waited, 3 more: rows 0-2 were closed and waited for (row 3
    # too when the plot of record 5 took longer than the wait, on a loaded machine)
    written = state["written"]
    assert written in ((2, 3) if waited else (-1,))
    (killed,) = offline_runs(run_dir)
    assert not killed.finished
    # what the state says is written is in the file
    assert [r["_step"] for r in killed.rows][: written + 1] == list(range(written + 1))

    # the resume: the checkpoint held 6 records; this job logs the rest of the 10-step run
    records = _records(1, 10)
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
    metrics.truncate(6)
    assert metrics.tracker.rewound_to == written  # min(6 - 1, written)
    for record in records[6:]:
        metrics.log(record)
    metrics.close()

    parts = _finished_parts(run_dir)
    assert len(parts) == 2 and _run_ids(parts) == {state["run_id"]}  # one run
    resumed = parts[1]
    assert resumed.branch_point == (state["run_id"], "_step", float(written))
    assert resumed.finished
    assert [r["_step"] for r in resumed.rows] == list(range(written + 1, len(records)))
    final = read_records(run_dir / "metrics.jsonl")
    assert final == [json.loads(json.dumps(r)) for r in records]
    _assert_rows_are_the_records(merged_history(parts), final)


def test_a_resume_after_a_normal_end_rewinds_to_the_checkpoint_record(tmp_path):
    """A job that ended normally (SIGTERM: checkpoint, then finish) wrote everything; the
    next one rewinds to its checkpoint's last record and logs nothing twice."""
    run_dir = tmp_path / "run"
    records = _records(1, 5)
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
    metrics.truncate(0)
    for record in records[:5]:
        metrics.log(record)
    metrics.close()
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
    metrics.truncate(4)  # the checkpoint came before the fifth record
    assert metrics.tracker.rewound_to == 3
    for record in records[4:]:
        metrics.log(record)
    metrics.close()
    parts = _finished_parts(run_dir)
    assert len(parts) == 2 and parts[0].run_id == parts[1].run_id
    assert [r["_step"] for r in parts[1].rows] == list(range(4, len(records)))
    _assert_rows_are_the_records(merged_history(parts), records)


def test_tracking_turned_on_at_a_resume_logs_the_run_so_far_first(tmp_path):
    """``logging.*`` may change on resume: a run that had no W&B run gets one holding every
    record kept, then the new ones."""
    run_dir = tmp_path / "run"
    records = _records(1, 4)
    with MetricsLogger(run_dir, tensorboard=False) as metrics:  # no tracking
        metrics.truncate(0)
        for record in records[:4]:
            metrics.log(record)
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
    metrics.truncate(3)  # the checkpoint held 3
    assert metrics.tracker.rewound_to is None  # a new run
    for record in records[3:]:
        metrics.log(record)
    metrics.close()
    (part,) = _finished_parts(run_dir)
    assert part.branch_point is None
    _assert_rows_are_the_records(part.rows, records)


def test_restart_moves_the_wandb_run_aside_and_the_next_start_opens_a_new_run(tmp_path):
    from megatron_rl.trainer.rundir import find_history, move_history_aside

    run_dir = tmp_path / "run"
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
    metrics.truncate(0)
    metrics.log(_records(1, 1)[0])
    metrics.close()
    old_id = json.loads((run_dir / WANDB_DIR / STATE_FILE).read_text())["run_id"]
    aside = move_history_aside(run_dir, find_history(run_dir))
    assert (aside / WANDB_DIR / STATE_FILE).is_file() and not (run_dir / WANDB_DIR).exists()
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir))
    metrics.truncate(0)
    metrics.close()
    assert json.loads((run_dir / WANDB_DIR / STATE_FILE).read_text())["run_id"] != old_id


def test_online_without_a_login_fails_at_start_naming_the_mode(tmp_path):
    run_dir = tmp_path / "run"
    metrics = MetricsLogger(run_dir, tensorboard=False, tracker=_tracker(run_dir, "online"))
    t0 = time.monotonic()
    with pytest.raises(TrackingError, match=r"logging\.wandb\.mode=online.*API key.*wandb login"):
        metrics.truncate(0)
    assert time.monotonic() - t0 < 30  # no wait for a server
    metrics.close()


@pytest.mark.timeout(300)  # ~15 s: the CLI up to the distributed init
def test_train_online_without_a_login_is_refused_before_anything_is_built(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(ROOT / "recipes" / "tiny_cpu.yaml"),
           "logging.wandb.mode=online", "--run-dir", str(run_dir)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_trainer_env() | {"HOME": os.environ["HOME"]},
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: logging.wandb.mode=online: no W&B API key configured" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()  # refused before the run directory was claimed
    assert time.monotonic() - t0 < 200


def test_the_config_section_is_checked_with_its_key_path():
    from megatron_rl.config import ConfigError, load_run_config

    recipe = ROOT / "recipes" / "tiny_cpu.yaml"
    cfg = load_run_config(recipe, ["logging.wandb.mode=offline"], check_model=False)
    assert cfg.logging.wandb.mode == "offline" and cfg.logging.wandb.project
    assert load_run_config(recipe, check_model=False).logging.wandb.mode == "disabled"
    for override, key in [
        ("logging.wandb.mode=cloud", "logging.wandb.mode"),
        ("logging.wandb.project=", "logging.wandb.project"),
        ("logging.wandb.tags=x", "logging.wandb.tags"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_run_config(recipe, ["logging.wandb.mode=offline", override], check_model=False)


# -- a real run: killed after a checkpoint, resumed --------------------------------------------

RUN_ARGS = [
    "warm_start.steps=40",
    "data.val_size=16",
    "data.synthetic.num_problems=200",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "validation.samples_per_prompt=2",
    "validation.every_steps=3",
    "training.max_steps=3",
    "checkpoint.every_steps=1",
    "forecast.enabled=false",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "logging.wandb.mode=offline",
    "logging.wandb.tags=[ci,tiny]",
]


def _train_cmd(run_dir: Path) -> list[str]:
    recipe = ROOT / "recipes" / "tiny_cpu.yaml"
    return [sys.executable, "-m", "megatron_rl.cli", "train", str(recipe), *RUN_ARGS,
            "--run-dir", str(run_dir)]  # fmt: skip


def _trainer_env() -> dict[str, str]:
    from megatron_rl.platform import LAUNCHER_VARS

    env = {k: v for k, v in job_env().items() if k not in LAUNCHER_VARS}
    return {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "HOME": HOME}  # offline: no credentials read


@pytest.mark.timeout(1500)  # two tiny runs: ~60 s each on a quiet machine, 4 min at load 20
def test_a_run_killed_after_a_checkpoint_and_resumed_is_one_wandb_run_with_every_record_once(
    tmp_path,
):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(run_dir), cwd=ROOT, env=_trainer_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    meta = run_dir / "checkpoints" / "step_00000002" / "meta.json"
    deadline = time.monotonic() + 600
    while not meta.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the trainer, hard: a node failure
    proc.wait()
    assert meta.is_file(), "the run never wrote the checkpoint of step 2"
    killed = json.loads((run_dir / WANDB_DIR / STATE_FILE).read_text())
    resumed = subprocess.run(_train_cmd(run_dir), cwd=ROOT, env=_trainer_env(),
                             capture_output=True, text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    final = read_records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in final if "reward_mean" in r] == [1, 2, 3]
    parts = _finished_parts(run_dir)
    assert len(parts) == 2 and _run_ids(parts) == {killed["run_id"]}  # one run
    first, second = parts
    # what the killed job's state said was written is in its file
    assert [r["_step"] for r in first.rows][: killed["written"] + 1] == list(
        range(killed["written"] + 1)
    )
    assert second.branch_point is not None and second.finished
    assert second.branch_point[2] <= 3  # the step-2 checkpoint held 4 records (0-3)
    _assert_rows_are_the_records(merged_history(parts), final)
    assert second.config["logging"]["wandb"]["tags"] == ["ci", "tiny"]
    assert second.config["training"]["max_steps"] == 3  # the resolved recipe
    validations = [r for r in merged_history(parts) if "val_pass_rate" in r]
    assert len(validations) == 2  # steps 0 and 3
    # the curve after each validation logged live (one logged again after a rewind has none)
    assert "reward_curve/path" in validations[-1]
    assert all("reward_curve/path" in r for r in first.rows if "val_pass_rate" in r)


@pytest.mark.timeout(900)  # ~50 s on a quiet machine
def test_a_preempted_run_finishes_its_wandb_run_with_every_record_written(tmp_path):
    """SIGTERM to the whole process group (scancel, preemption): the trainer checkpoints and
    exits 0, and its W&B run is finished with every record (W&B's service runs in a session
    of its own: the group's signal does not end it before the trainer's finish)."""
    run_dir = tmp_path / "run"
    cmd = [
        a if a != "training.max_steps=3" else "training.max_steps=40" for a in _train_cmd(run_dir)
    ]
    log = tmp_path / "output.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_trainer_env(), stdout=out, stderr=out,
                                start_new_session=True)  # fmt: skip
        meta = run_dir / "checkpoints" / "step_00000002" / "meta.json"
        deadline = time.monotonic() + 600
        while not meta.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert meta.is_file(), log.read_text()[-3000:]
        time.sleep(2)  # the helpers of the first save (and of the step after) are up
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        finally:
            proc.kill()
    final = read_records(run_dir / "metrics.jsonl")
    (part,) = _finished_parts(run_dir)
    assert part.finished
    _assert_rows_are_the_records(part.rows, final)
    state = json.loads((run_dir / WANDB_DIR / STATE_FILE).read_text())
    assert state["written"] == len(final) - 1  # the next job rewinds to its checkpoint's record
