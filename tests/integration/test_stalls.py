"""Stalls become restarts (issue 30, section 3): an engine process that is alive but answers
nothing (SIGSTOP) is killed and restarted like a dead one, its requests resubmitted; a trainer
rank that makes no progress dumps its stacks and exits 75, which the sbatch script requeues."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.messages import Alive

ROOT = Path(__file__).resolve().parents[2]
POOL_LOGGER = "megatron_rl.rollout.pool"  # the pool's and its supervisor's


def test_engine_stall_timeout_is_checked():
    with pytest.raises(ValueError, match="'engine_stall_timeout': must be >= 0"):
        RolloutConfig(engine_stall_timeout=-1).validate()
    RolloutConfig(engine_stall_timeout=0).validate()  # 0: off


@pytest.fixture
def beating_pool(tmp_path):
    """The real pool over fake engine "processes" on real pipes (test_rollout_elastic's)."""
    from support.fake_engines import FakeEngines

    from megatron_rl.rollout.pool import GeneratorPool

    fakes = FakeEngines(tmp_path)
    hf = SimpleNamespace(vocab_size=100, eos_token_id=2)
    config = RolloutConfig(
        engines=2, placement="subprocess", samples_per_prompt=2, engine_stall_timeout=1.0
    )
    pool = GeneratorPool("unused", config, launcher=fakes, text_config=hf)
    yield pool, fakes
    pool.close()


def _beat_for(pool, fakes, seconds: float) -> None:
    """Both engines beat every 0.2 s for ``seconds`` (no step under way); the pool polls."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for index, writer in fakes.writers.items():
            writer.put(Alive(index, 0.0))
        pool.poll(timeout=0.2)


def test_an_engine_that_beats_is_never_stalled_however_long_it_is_quiet(beating_pool):
    """Beats alone (no samples, e.g. a long weight load or an idle wait) for 3x the timeout:
    no restart."""
    pool, fakes = beating_pool
    pool.submit([[10, 11]], seeds=[1])
    _beat_for(pool, fakes, 3.0)
    assert pool.restarts == 0 and fakes.spawned == [0, 1]


def test_silence_or_one_endless_step_counts_as_a_stall(beating_pool, caplog):
    """Engine 1 beats but reports one step under way for longer than the timeout (a frozen
    worker); engine 0 goes silent after its first beats (SIGSTOP): both are restarted,
    and the requests they held are resubmitted."""
    from support.fake_engines import submitted

    pool, fakes = beating_pool
    pool.submit([[10, 11], [12]], seeds=[1, 2])
    held = {(s.prompt_index, s.sample_index) for h in pool.engine_handles() for s in submitted(h)}
    with caplog.at_level(logging.WARNING, logger=POOL_LOGGER):
        start = time.monotonic()
        fakes.writers[0].put(Alive(0, 0.0))  # engine 0 beats once, then falls silent
        fakes.writers[1].put(Alive(1, 5.0))  # engine 1: one step of 5 s > 1 s
        pool.poll(timeout=0.5)
        assert fakes.spawned == [0, 1, 1]
        assert "vLLM engine 1 (pid -1) has been in one engine step for 5 s" in caplog.text
        stopped = fakes.writers.pop(0)  # engine 0 says nothing from now on
        while pool.restarts < 2:
            assert time.monotonic() - start < 5, "the silent engine was never restarted"
            fakes.writers[1].put(Alive(1, 0.0))
            pool.poll(timeout=0.2)
    assert 1.0 < time.monotonic() - start < 3.0  # from its beat: the timeout, plus a poll
    assert fakes.spawned == [0, 1, 1, 0]
    assert "vLLM engine 0 (pid -1) sent nothing for 1 s" in caplog.text
    assert "rollout.engine_stall_timeout 1 s): stalled" in caplog.text
    handles = pool.engine_handles()  # both restarted: what they were given is what was held
    resubmitted = {(s.prompt_index, s.sample_index) for h in handles for s in submitted(h)}
    assert resubmitted == held
    stopped._conn.close()


@pytest.mark.timeout(600)  # two engine starts (~60 s each here) and a 20 s stall
def test_a_stopped_engine_process_is_killed_restarted_and_its_samples_come_back(
    tiny_hf_dirs, caplog
):
    """A real engine process SIGSTOPped with requests in flight: the pool notices within
    rollout.engine_stall_timeout (plus a beat), kills it, restarts it, resubmits; every
    sample comes back. Before the stall check the pool waited forever."""
    from megatron_rl.rollout.pool import GeneratorPool

    timeout = 20.0
    config = RolloutConfig(
        placement="subprocess",
        max_tokens=16,
        samples_per_prompt=2,
        dtype="float32",
        engine_stall_timeout=timeout,
    )
    with GeneratorPool(tiny_hf_dirs["tiny-llama"], config) as pool:
        assert pool.generate([[1, 2, 3]])  # up and generating
        pid = pool.engine_handles()[0].pid
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        indices = pool.submit([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seeds=[1, 2, 3])
        got = []
        with caplog.at_level(logging.WARNING, logger=POOL_LOGGER):
            while pool.restarts == 0:
                assert time.monotonic() - stopped < timeout + 30, "the stall went unnoticed"
                got += pool.poll(timeout=1.0)
        noticed = time.monotonic() - stopped
        assert timeout < noticed < timeout + 15  # the timeout, plus a beat and a poll
        assert f"vLLM engine 0 (pid {pid}) sent nothing for" in caplog.text
        with pytest.raises(ProcessLookupError):  # killed (and reaped)
            os.kill(pid, 0)
        assert pool.engine_handles()[0].pid != pid
        deadline = time.monotonic() + 300
        while pool.in_flight:
            assert time.monotonic() < deadline, "the resubmitted requests never came back"
            got += pool.poll(timeout=1.0)
    want = sorted((i, j) for i in indices for j in range(2))
    assert sorted((s.prompt_index, s.sample_index) for s in got) == want
    assert all(len(s.response_ids) > 0 for s in got)


# -- trainer ranks: the hang watchdog ---------------------------------------------------------


def _stuck_in_a_filesystem_call(release):  # a name to find in the stack dump
    release.wait(30)


def test_a_rank_without_progress_dumps_every_stack_and_exits_75(tmp_path):
    """No beat for the timeout: every thread's stack (the stuck one's function included) in
    the dump, exit status 75; beats before that keep it quiet."""
    import threading

    from megatron_rl.platform.watchdog import HANG_EXIT_CODE, HangWatchdog

    exits = []
    fired = threading.Event()
    dump = tmp_path / "hang" / "rank_3.txt"
    dog = HangWatchdog(1.0, dump, rank=3, exit=lambda code: (exits.append(code), fired.set()))
    dog.start()
    for i in range(8):  # 1.6 s of beats every 0.2 s: no hang
        dog.beat(f"step {i}")
        time.sleep(0.2)
    assert exits == [] and not dump.exists()
    release = threading.Event()
    worker = threading.Thread(target=_stuck_in_a_filesystem_call, args=(release,))
    worker.start()
    start = time.monotonic()
    assert fired.wait(10), "the watchdog never fired"
    waited = time.monotonic() - start
    release.set()
    worker.join()
    assert exits == [HANG_EXIT_CODE] == [75]
    assert 0.8 < waited < 2.5  # the last beat was 0.2 s before; timeout 1 s, polls of 0.1 s
    text = dump.read_text()
    assert text.startswith("trainer rank 3 (pid ")
    assert (
        "made no progress for 1 s (training.hang_timeout_minutes 0.0166667) in phase 'step 7'"
        in text
    )
    assert "_stuck_in_a_filesystem_call" in text  # the other thread's stack
    assert "test_a_rank_without_progress_dumps_every_stack_and_exits_75" in text  # this one's


def test_a_paused_rank_is_not_judged_and_is_judged_again_after(tmp_path):
    from megatron_rl.platform.watchdog import HangWatchdog

    exits = []
    dog = HangWatchdog(0.5, tmp_path / "rank_0.txt", rank=0, exit=exits.append).start()
    with dog.paused("waiting for the main rank"):
        time.sleep(1.5)  # 3x the timeout
    assert exits == []
    time.sleep(1.5)
    assert exits == [75]
    dog.stop()


def test_hang_timeout_is_checked_and_off_at_zero(tmp_path):
    from megatron_rl.config.sections import TrainingConfig
    from megatron_rl.platform import watchdog

    with pytest.raises(ValueError, match="'hang_timeout_minutes': must be a finite number >= 0"):
        TrainingConfig(hang_timeout_minutes=-1).validate()
    assert watchdog.arm(0, tmp_path, 0) is None
    watchdog.beat("nothing armed: a no-op")
    with watchdog.paused("nothing armed"):
        pass


RANK_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
from megatron_rl.platform import watchdog

def _stuck_in_step():  # a deadlock, a stuck filesystem
    time.sleep(3600)

rank, mode = int(os.environ["RANK"]), sys.argv[2]
dist.init_process_group("gloo")
watchdog.arm(float(sys.argv[3]) / 60, sys.argv[1], rank)
for step in range(10**6):
    watchdog.beat(f"step {step}")
    if mode == "sleep" and rank == 1 and step == 20:
        _stuck_in_step()
    dist.all_reduce(torch.ones(4))
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.05)
"""


def _two_ranks(tmp_path, mode: str, timeout_s: float):
    import socket
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    args = [sys.executable, str(script), str(tmp_path / "run"), mode, str(timeout_s)]
    return [
        subprocess.Popen(
            args, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for r in range(2)
    ]


def _wait_for_steps(proc, count: int) -> None:
    for _ in range(count):
        assert proc.stdout.readline(), proc.stderr.read().decode()[-2000:]


@pytest.mark.timeout(180)  # two ranks importing torch (~10-20 s here), then seconds
def test_a_rank_asleep_outside_a_collective_is_detected_and_both_ranks_exit_75(tmp_path):
    """Two gloo ranks; rank 1 sleeps in a step (outside any collective). Rank 1 fires itself
    (its stack shows where it sleeps), rank 0 fires in the all-reduce it waits in: both
    stacks dumped, both exit 75, within the timeout, not the collective's 30 min."""
    procs = _two_ranks(tmp_path, "sleep", 5.0)
    _wait_for_steps(procs[0], 20)  # rank 0 passed step 19: rank 1 is at its step 20
    start = time.monotonic()
    codes = [p.wait(timeout=60) for p in procs]
    assert time.monotonic() - start < 5.0 + 5  # the timeout, a poll, an exit
    assert codes == [75, 75], [p.stderr.read().decode()[-2000:] for p in procs]
    dumps = {r: (tmp_path / "run" / "hang" / f"rank_{r}.txt").read_text() for r in (0, 1)}
    assert "in phase 'step 20'" in dumps[1] and "_stuck_in_step" in dumps[1]
    assert "in phase 'step 20'" in dumps[0] and "all_reduce" in dumps[0]
    err = procs[1].stderr.read().decode()
    assert "trainer rank 1 (pid" in err and "exiting with status 75" in err


@pytest.mark.timeout(180)
def test_without_the_watchdog_a_rank_asleep_outside_a_collective_hangs_both(tmp_path):
    """The control (hang_timeout 0: off, as before the watchdog): rank 1 asleep, rank 0 in
    its all-reduce, neither ends nor says anything."""
    procs = _two_ranks(tmp_path, "sleep", 0.0)
    try:
        _wait_for_steps(procs[0], 20)
        time.sleep(15)  # three times the timeout of the test above
        assert [p.poll() for p in procs] == [None, None]
        assert not (tmp_path / "run" / "hang").exists()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_a_sigstopped_rank_is_detected_by_the_rank_that_waits_for_it(tmp_path):
    """A stopped rank cannot report itself (its threads stop too): rank 0, waiting for it in
    the next all-reduce, fires within the timeout with its stack, and exits 75."""
    procs = _two_ranks(tmp_path, "run", 5.0)
    try:
        _wait_for_steps(procs[1], 5)
        os.kill(procs[1].pid, signal.SIGSTOP)
        start = time.monotonic()
        assert procs[0].wait(timeout=60) == 75, procs[0].stderr.read().decode()[-2000:]
        assert 5.0 < time.monotonic() - start < 5.0 + 5
        dump = (tmp_path / "run" / "hang" / "rank_0.txt").read_text()
        assert "made no progress for" in dump and "all_reduce" in dump
        assert not (tmp_path / "run" / "hang" / "rank_1.txt").exists()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


HANGING_TRAINER = """
import os, sys, time
from megatron_rl.platform.threads import set_omp_defaults

set_omp_defaults()
import megatron_rl.trainer.loop as loop

real, calls = loop.policy_update, []


def _stuck_in_policy_update():  # e.g. a read from a stuck filesystem
    time.sleep(3600)


def policy_update(*args, **kwargs):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        _stuck_in_policy_update()
    return real(*args, **kwargs)


if __name__ == "__main__":  # engine processes are spawned: they import this module too
    loop.policy_update = policy_update
    from megatron_rl.cli import main

    sys.exit(main())
"""


@pytest.mark.timeout(900)  # two 2-rank runs: ~1.5 + ~1.5 min here, more under load
def test_a_hung_trainer_rank_exits_75_with_its_stack_and_the_run_resumes(tmp_path):
    """2-rank gloo run (torchrun) whose rank 1 sleeps in its second update: it exits 75 within
    training.hang_timeout_minutes with its stack in RUN_DIR/hang/rank_1.txt (before: the
    other rank waited 30 min in the gradient all-reduce, rank 1 forever). The same command
    again (what the requeued job runs) resumes from the step-1 checkpoint and finishes with
    every step logged once."""
    import re
    import subprocess
    import sys

    from test_trainer_loop import RECIPE, SMALL, records, train_env

    run_dir = tmp_path / "run"
    (tmp_path / "hanging.py").write_text(HANGING_TRAINER)
    args = [
        "train", str(RECIPE), *SMALL, "training.max_steps=3", "checkpoint.every_steps=1",
        "validation.every_steps=3", "training.logprob_probe_every=0",
        "rollout.placement=subprocess", "cluster.gpus_per_node=3", "cluster.trainer_gpus=2",
        "cluster.generator_gpus=1", "training.hang_timeout_minutes=0.75",
        # the step-1 checkpoint must be complete before step 2 hangs: an async save completes
        # at a later step's finalize, which a hang never reaches (the save is then lost)
        "checkpoint.async_save=false",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2"]
    env = {**train_env(), "OMP_NUM_THREADS": "1"}
    hung = subprocess.run(
        [*torchrun, str(tmp_path / "hanging.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert hung.returncode != 0
    assert re.search(r"exitcode\s*:\s*75", hung.stderr), hung.stderr[-3000:]
    dump = (run_dir / "hang" / "rank_1.txt").read_text()
    assert dump.startswith("trainer rank 1 (pid ")
    assert "in phase 'step 2: update'" in dump and "_stuck_in_policy_update" in dump
    silent = int(re.search(r"made no progress for (\d+) s", dump)[1])
    assert 45 <= silent <= 45 + 15  # the timeout (0.75 min), plus a poll of 4.5 s, and load
    assert "exiting with status 75" in hung.stderr
    assert [r["step"] for r in records(run_dir) if "reward_mean" in r] == [1]
    resumed = subprocess.run(
        [*torchrun, "-m", "megatron_rl.cli", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"resumed from \S+ at step 1\b", resumed.stderr)
    assert [r["step"] for r in records(run_dir) if "reward_mean" in r] == [1, 2, 3]


def _hang_block() -> str:
    """The sbatch script's handling of a hung trainer (rendered, checked in)."""
    text = (ROOT / "slurm" / "scalerl_8b.sbatch").read_text()
    start = text.index("HANG_DUMPS=")
    end = text.index("fi\n", text.index('log "not requeued')) + 3
    return text[start:end]


def _run_hang_block(tmp_path, job_start: int, requeue: int = 1):
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.calls\n')
    fake.chmod(0o755)
    script = (
        f"RUN_DIR={tmp_path}/run; JOB_START={job_start}; TRAINER_RC=137; REQUEUE={requeue}\n"
        'SLURM_JOB_ID=42\nlog() { echo "$*"; }\n' + _hang_block() + "\nexit 99\n"
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)


def test_the_sbatch_script_requeues_a_hung_job_once_per_checkpoint(tmp_path):
    """A dump written during this job: requeue (whatever the step's status: another rank may
    have been killed first), once per checkpoint; an older dump is no hang of this job."""
    from megatron_rl.platform.watchdog import HANG_EXIT_CODE

    sbatch = (ROOT / "slurm" / "scalerl_8b.sbatch").read_text()
    assert f"status {HANG_EXIT_CODE} (megatron_rl/platform/watchdog.py)" in sbatch
    run = tmp_path / "run"
    (run / "hang").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step_00000007\n")
    dump = run / "hang" / "rank_1.txt"
    dump.write_text("trainer rank 1 ...")
    os.utime(dump, (1_000_000, 1_000_000))
    old = _run_hang_block(tmp_path, job_start=1_000_100)  # the dump is older than the job
    assert old.returncode == 99 and not (tmp_path / "scontrol.calls").exists()
    first = _run_hang_block(tmp_path, job_start=999_000)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"their stacks: {dump}" in first.stdout
    assert "requeueing job 42 after the hang: it resumes from step_00000007" in first.stdout
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 42\n"
    again = _run_hang_block(tmp_path, job_start=999_000)  # hung again, no new checkpoint
    assert again.returncode == 99 and "not requeued" in again.stdout
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 42\n"
    (run / "checkpoints" / "latest").write_text("step_00000009\n")
    assert _run_hang_block(tmp_path, job_start=999_000).returncode == 0  # progress: again
    off = _run_hang_block(tmp_path, job_start=999_000, requeue=0)
    assert off.returncode == 99 and "not requeued" in off.stdout
