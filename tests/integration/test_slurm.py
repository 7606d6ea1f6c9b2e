"""The tiny recipe through `megatron-rl launch` on a real Slurm cluster (tools/local_slurm.sh).

Skipped unless a cluster answers: ``$SLURM_CONF`` set (or the env file that
``tools/local_slurm.sh start`` writes) and ``sinfo`` showing a usable node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
ENV_FILE = Path(os.environ.get("MEGATRON_RL_SLURM_DIR", "/tmp/megatron_rl_slurm")) / "env"
SMALL = [
    "warm_start.steps=20",
    "data.val_size=16",
    "data.synthetic.num_problems=200",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "validation.samples_per_prompt=2",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "preflight=false",  # its own test below: the others time the training job alone
]
JOB_SECONDS = 400  # a run takes about a minute here; the machine is shared


def _slurm_env() -> dict[str, str] | None:
    env = dict(os.environ)
    if "SLURM_CONF" not in env and ENV_FILE.is_file():
        match = re.search(r"SLURM_CONF=(\S+)", ENV_FILE.read_text())
        if match:
            env["SLURM_CONF"] = match.group(1)
    if "SLURM_CONF" not in env or not shutil.which("sbatch"):
        return None
    try:
        state = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if state.returncode != 0 or not re.search(r"idle|mix|alloc", state.stdout):
        return None
    return env


SLURM_ENV = _slurm_env()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.xdist_group("slurm"),  # one Slurm node: its jobs run one at a time
    pytest.mark.timeout(2 * JOB_SECONDS),
    pytest.mark.skipif(SLURM_ENV is None, reason="no Slurm cluster (tools/local_slurm.sh start)"),
]


def slurm(*cmd: str) -> str:
    proc = subprocess.run(cmd, env=SLURM_ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{cmd}: {proc.stderr}"
    return proc.stdout


def launch(run_dir: Path, *overrides: str, **env: str) -> str:
    """Submit the tiny recipe (``env``: more variables for the job); returns the job id."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "launch", TINY, *SMALL, *overrides]
        + ["--device", "cpu", "--run-dir", str(run_dir)],
        env={**SLURM_ENV, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)


def job_fields(job: str) -> dict[str, str]:
    text = slurm("scontrol", "show", "job", job)
    return dict(re.findall(r"(\w+)=(\S+)", text))


def wait_for(predicate, what: str, run_dir: Path, timeout: float = JOB_SECONDS):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in (run_dir / "logs").glob("*"))
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def finished(job: str) -> dict[str, str] | None:
    fields = job_fields(job)
    done = fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    return fields if done else None


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log(run_dir: Path, job: str, role: str) -> str:
    return (run_dir / "logs" / f"tiny_cpu-{job}-{role}.log").read_text(errors="replace")


def task_line(text: str, role: str) -> dict[str, str]:
    line = re.search(rf"megatron-rl task: role={role} (.*)", text).group(1)
    return dict(re.findall(r"(\w+)=(\S+)", line))


def test_pre_timeout_signal_checkpoints_requeues_and_resumes_with_every_step_once(tmp_path):
    """The tiny recipe as a trainer task and a generator task of one job, stopped by the
    pre-timeout signal mid-run, requeued, and resumed: every step once, weights in every
    push crossing into the generator's own process."""
    run_dir = tmp_path / "run"
    max_steps = 12
    job = launch(
        run_dir,
        f"training.max_steps={max_steps}",
        "validation.every_steps=4",
        "checkpoint.every_steps=100",  # only the signal's and the final checkpoint
    )
    wait_for(lambda: any("reward_mean" in r for r in records(run_dir)), "the first step", run_dir)
    slurm("scancel", "--signal=USR1", "--batch", job)  # what Slurm sends before the limit

    def requeued():
        fields = job_fields(job)
        return fields if fields["Restarts"] == "1" and fields["JobState"] == "PENDING" else None

    wait_for(requeued, "the requeue", run_dir)
    # Skip Slurm's ~2 min hold, but not within the second of the requeue: slurmd revokes the
    # old credential at that second and kills a restart whose credential is not newer
    # ("Job credential revoked").
    time.sleep(2)
    slurm("scontrol", "update", f"jobid={job}", "starttime=now")
    fields = wait_for(lambda: finished(job), f"job {job} to finish", run_dir)
    batch = log(run_dir, job, "batch")
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1")
    assert "requeueing job" in batch and "(restart 1)" in batch
    assert "training finished" in batch

    trainer, generator = log(run_dir, job, "trainer"), log(run_dir, job, "generator")
    t, g = task_line(trainer, "trainer"), task_line(generator, "generator")
    # two Slurm steps of one job, each with its own task and process
    assert (t["rank"], t["world_size"], t["procid"], g["engine"]) == ("0", "1", "0", "0")
    assert t["step"] != g["step"] and t["pid"] != g["pid"]
    assert "generator engine 0 connected" in trainer
    stopped = int(re.search(r"stopping on SIGUSR1 after checkpointing step (\d+)", trainer)[1])
    assert 1 <= stopped < max_steps, "the signal must land mid-run"
    assert re.search(rf"resumed from \S+ at step {stopped}\b", trainer)
    recs = records(run_dir)
    assert [r["step"] for r in recs if "reward_mean" in r] == list(range(1, max_steps + 1))
    assert [r["step"] for r in recs if "val_pass_rate" in r] == [0, 4, 8, 12]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{max_steps:08d}"
    # Every weight push crossed into the generator's process, logged by the engine task: the
    # first push of each attempt (versions 1 and stopped + 1) and one after each update.
    loads = re.findall(r"engine 0: loaded policy version (\d+) \((\d+) tensors", generator)
    versions = [int(v) for v, _ in loads]
    assert sorted(set(versions)) == list(range(1, max_steps + 2)), versions
    assert versions[-1] == max_steps + 1 and all(int(n) > 0 for _, n in loads)


def test_a_killed_generator_task_ends_the_job_with_the_failure_in_the_logs(tmp_path):
    run_dir = tmp_path / "run"
    # the pool waits $MEGATRON_RL_GENERATOR_RECONNECT_TIMEOUT (60 s by default) for the task
    # to return; sbatch passes the submitting environment on to the job
    wait = {"MEGATRON_RL_GENERATOR_RECONNECT_TIMEOUT": "20"}
    job = launch(run_dir, "training.max_steps=500", "validation.enabled=false", **wait)
    wait_for(lambda: any("reward_mean" in r for r in records(run_dir)), "the first step", run_dir)
    steps = slurm("squeue", "--steps", "--noheader", f"--jobs={job}", "--format=%i %j")
    generator_step = re.search(r"^\s*(\S+) generator$", steps, re.M).group(1)
    slurm("scancel", "--signal=KILL", generator_step)  # the engine dies without a word

    fields = wait_for(lambda: finished(job), f"job {job} to end", run_dir, timeout=240)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0"
    batch, trainer = log(run_dir, job, "batch"), log(run_dir, job, "trainer")
    assert "ERROR: the generator step failed" in batch
    assert "ERROR: the trainer failed" in batch
    # the whole task is gone (not only its engine process): nothing reconnects
    assert re.search(
        r"RuntimeError: vLLM engine 0 failed:\n.*generator engine 0 lost its connection and "
        r"its task did not reconnect within 20 s",  # lines prefixed "0: [rank0]: "
        trainer,
    )
    assert "generator engine 0" in trainer and "connection lost" in trainer
    assert len([r for r in records(run_dir) if "reward_mean" in r]) < 500


def test_a_killed_remote_engine_process_is_restarted_and_every_prompt_trains_once(tmp_path):
    """Remote elastic engines: SIGKILL the generator task's engine process after the first
    step (on this one-node cluster it is a process of this machine). The task starts it
    again on its devices, it reconnects, and the pool resubmits its requests and reweighs
    it: the run completes, every prompt is trained on once, one restart is counted."""
    import signal

    from support.elastic_runs import assert_every_prompt_trained_once, assert_killed_in_time

    run_dir = tmp_path / "run"
    k, max_steps = 1, 10  # enough steps after the kill: assert_killed_in_time
    job = launch(
        run_dir,
        f"training.max_steps={max_steps}",
        f"off_policy.max_lag={k}",
        "validation.enabled=false",
    )
    wait_for(lambda: any("reward_mean" in r for r in records(run_dir)), "the first step", run_dir)
    started = re.findall(
        r"engine 0: engine process pid (\d+) started", log(run_dir, job, "generator")
    )
    assert len(started) == 1
    os.kill(int(started[0]), signal.SIGKILL)
    assert_killed_in_time(max_steps, len([r for r in records(run_dir) if "reward_mean" in r]), k)

    fields = wait_for(lambda: finished(job), f"job {job} to finish", run_dir)
    trainer, generator = log(run_dir, job, "trainer"), log(run_dir, job, "generator")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), trainer[-3000:]
    assert "was killed by SIGKILL: starting it again" in generator
    assert len(re.findall(r"engine 0: engine process pid (\d+) started", generator)) == 2
    assert "generator engine 0 reconnected" in trainer
    steps = [r for r in records(run_dir) if "reward_mean" in r]
    assert_every_prompt_trained_once(steps, max_steps, k, prompts=4, samples=4)


def test_a_failed_preflight_ends_the_job_before_training(tmp_path):
    run_dir = tmp_path / "run"
    job = launch(run_dir, "preflight=true", MEGATRON_RL_PREFLIGHT_FREE_BYTES="1000")
    fields = wait_for(lambda: finished(job), "the job to end", run_dir)
    assert fields["JobState"] == "FAILED", fields
    report = json.loads((run_dir / "preflight.json").read_text())
    assert {c["name"]: c["status"] for c in report["checks"]}["disk"] == "FAIL"
    assert not (run_dir / "metrics.jsonl").exists()  # no training
