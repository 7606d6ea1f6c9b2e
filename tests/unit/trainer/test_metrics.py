"""metrics.jsonl writing / resume truncation, TensorBoard scalars, the reward-curve plot,
and GPU-hours accounting."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_rl.scaling.records import plot_reward_curve, read_records
from megatron_rl.trainer import compute
from megatron_rl.trainer.compute import (
    ComputeClock,
    WorkCPUClock,
    generation_share,
    run_devices,
)
from megatron_rl.trainer.metrics import MetricsLogger


def test_records_are_lines_flushed_as_written(tmp_path):
    import numpy as np
    import torch

    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"step": 1, "gpu_hours": 0.5, "reward_mean": torch.tensor(0.25)})
    # Readable before close: each line is flushed.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "gpu_hours": 0.5, "reward_mean": 0.25}
    logger.log({"step": 2, "loss": float("nan"), "n": np.int64(3), "rho": [np.float32(1.5)]})
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1]) == {
        "step": 2,
        "loss": None,  # strict JSON: non-finite numbers become null
        "n": 3,
        "rho": [1.5],
    }
    assert logger.position() == 2
    with pytest.raises(ValueError, match="step"):
        logger.log({"reward_mean": 1.0})
    logger.close()


def test_resume_truncates_to_the_checkpointed_position(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log({"step": step, "reward_mean": step / 10})
    # A crash in the middle of a line leaves a torn record.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')
    logger = MetricsLogger(tmp_path, tensorboard=False)
    assert logger.position() == 5  # the torn line is not a record
    logger.truncate(3)  # the checkpoint was taken after 3 records
    logger.log({"step": 4, "reward_mean": 0.44})
    logger.close()
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["reward_mean"] == 0.44
    with pytest.raises(ValueError):
        MetricsLogger(tmp_path, tensorboard=False).truncate(-1)


def test_a_short_or_lost_metrics_file_does_not_block_a_resume(tmp_path, caplog):
    """A checkpoint taken after 13 records, a file with 8 (two runs in one directory, or a
    hand edit): every resume failed ("cannot truncate metrics.jsonl with 8 records to 13").
    The records there are kept, with a warning, and logging continues after them; a lost
    file the same."""
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 9):
            logger.log({"step": step, "reward_mean": step / 10})
    logger = MetricsLogger(tmp_path, tensorboard=False)
    with caplog.at_level("WARNING"):
        logger.truncate(13)
    assert "has 8 records, the checkpoint expected 13" in caplog.text
    logger.log({"step": 14, "reward_mean": 1.4})
    logger.close()
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [*range(1, 9), 14]
    (tmp_path / "metrics.jsonl").unlink()
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.truncate(13)
        assert logger.position() == 0


def _tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 5):
            logger.log({"step": step, "reward_mean": step / 10, "phase": "train"})
    scalars = _tensorboard_scalars(tmp_path / "tensorboard")
    assert [s for s, _ in scalars["reward_mean"]] == [1, 2, 3, 4]
    assert "phase" not in scalars  # only numbers go to TensorBoard
    # Resume from a checkpoint after step 2; the next record is step 5 (steps 3-4 of the
    # crashed attempt must not survive, although nothing is re-logged over them).
    logger = MetricsLogger(tmp_path)
    logger.truncate(2)
    logger.log({"step": 5, "reward_mean": 0.9})
    logger.close()
    reward = _tensorboard_scalars(tmp_path / "tensorboard")["reward_mean"]
    assert [s for s, _ in reward] == [1, 2, 5]
    assert reward[-1][1] == pytest.approx(0.9)


def test_plot_reward_curve_writes_a_png(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 11):
            logger.log({"step": step, "gpu_hours": step * 0.01, "reward_mean": -1 + step / 10})
            if step % 5 == 0:
                logger.log({"step": step, "gpu_hours": step * 0.01, "val_pass_rate": step / 20})
    out = plot_reward_curve(tmp_path / "metrics.jsonl", tmp_path / "reward.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="no records"):
        plot_reward_curve(tmp_path / "empty" / "metrics.jsonl", tmp_path / "x.png")


def test_plot_shows_the_forecast_extrapolated_to_the_budget(tmp_path):
    from megatron_rl.scaling import CurveParams, synthetic_run
    from megatron_rl.scaling.data import load_run
    from megatron_rl.scaling.forecast import ForecastConfig, forecast_run

    truth = synthetic_run(CurveParams(0.8, 1.5, 0.01, 0.2), 0.02, 200, 10, 0.01, seed=0)
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for x, y in zip(truth.x, truth.y):
            logger.log({"step": int(x * 1e4), "gpu_hours": x, "val_pass_rate": y})
    metrics = tmp_path / "metrics.jsonl"
    config = ForecastConfig(min_gpu_hours=0, grid="auto", bootstrap=10)
    forecast = forecast_run(load_run(metrics), config, budget=0.05)
    assert forecast.curve_x.max() == pytest.approx(0.05)  # the band reaches the budget
    assert forecast.band_lo is not None and np.all(forecast.band_lo <= forecast.band_hi + 1e-12)
    plain = plot_reward_curve(metrics, tmp_path / "plain.png").read_bytes()
    with_fit = plot_reward_curve(metrics, tmp_path / "fit.png", forecast=forecast).read_bytes()
    assert with_fit[:8] == b"\x89PNG\r\n\x1a\n" and with_fit != plain
    assert len(with_fit) > len(plain)  # the curve, band and marker add ink
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".png") == [
        "fit.png",
        "plain.png",
    ]  # no temporary file left behind


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_gpu_hours_are_training_hours_times_devices_across_restarts():
    t = FakeClock()
    clock = ComputeClock(devices=80, clock=t, wall=t)
    t.now += 600  # start-up: not training compute
    clock.begin("train")
    t.now += 1800  # half an hour of training on 80 GPUs
    assert clock.gpu_hours == pytest.approx(40.0)
    assert clock.total_gpu_hours == pytest.approx(40.0 + 80 * 600 / 3600)
    assert clock.wall_hours == pytest.approx(2400 / 3600)
    state = clock.state_dict()
    t.now += 3 * 3600  # the job is down for three hours (and the last half hour is lost)
    resumed = ComputeClock(devices=16, clock=t, wall=t)  # resumed on a smaller allocation
    t.now += 300  # its start-up before the checkpoint is loaded: not counted anywhere
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.gpu_hours == pytest.approx(40.0)  # downtime not counted
    resumed.begin("train")
    t.now += 900
    assert resumed.gpu_hours == pytest.approx(40.0 + 0.25 * 16)
    assert resumed.hours("startup") == pytest.approx(80 * 600 / 3600)
    assert resumed.wall_hours == pytest.approx(2400 / 3600 + 0.25)
    assert math.isclose(resumed.state_dict()["gpu_hours"], 44.0)
    with pytest.raises(ValueError):
        ComputeClock(devices=0)
    with pytest.raises(ValueError, match="gpu_hours"):
        resumed.load_state_dict({})
    with pytest.raises(ValueError, match="unknown compute category"):
        resumed.begin("lunch")


def test_validation_and_checkpoints_are_accounted_apart():
    t = FakeClock()
    clock = ComputeClock(devices=10, clock=t)
    clock.begin("train")
    t.now += 360  # 1 device-hour of training
    with clock.window("validation") as window:
        t.now += 720  # 2 device-hours, a quarter of it decoding training requests
        window.train_fraction = 0.25
    assert clock.gpu_hours == pytest.approx(1.5)
    assert clock.hours("validation") == pytest.approx(1.5)
    with clock.window("checkpoint"):
        t.now += 36
    t.now += 360  # back to training after the window
    clock.begin("shutdown")
    t.now += 36
    assert clock.summary() == pytest.approx(
        {
            "gpu_hours": 2.5,
            "total_gpu_hours": 4.2,
            "startup_gpu_hours": 0.0,
            "validation_gpu_hours": 1.5,
            "checkpoint_gpu_hours": 0.1,
            "shutdown_gpu_hours": 0.1,
        }
    )


def test_generation_share_splits_a_window_by_tokens():
    assert generation_share(100, 300) == pytest.approx(0.25)
    assert generation_share(0, 300) == 0.0
    assert generation_share(0, 0) == 0.0
    assert generation_share(-5, 300) == 0.0  # a snapshot race never gives a negative share


def test_an_old_checkpoint_clock_counts_as_training():
    clock = ComputeClock(devices=2, clock=FakeClock())
    clock.load_state_dict({"gpu_hours": 7.0, "wall_hours": 3.5, "devices": 2})
    assert clock.gpu_hours == clock.total_gpu_hours == 7.0


def test_run_devices_counts_trainers_and_generators():
    assert run_devices(16, engines=64, engine_devices=1, gpu=True) == 80
    assert run_devices(32, engines=24, engine_devices=4, gpu=True) == 128
    assert run_devices(1, engines=1, engine_devices=1, gpu=False) == 2  # engine process
    assert run_devices(1, engines=0, engine_devices=1, gpu=False) == 1  # engine in-process
    with pytest.raises(ValueError):
        run_devices(0, 1, 1, True)


def test_per_layer_expert_load_goes_to_tensorboard_only(tmp_path):
    """The step record carries the expert-load summary; the per-layer series (tokens per
    expert ...) go to TensorBoard and not to metrics.jsonl."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rl.trainer.moe_metrics import ExpertLoad

    load = ExpertLoad(
        layers=(2, 4),
        tokens_per_expert=torch.tensor([[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]),
        dropped=torch.tensor([2.0, 0.0]),
        entropy_sum=torch.tensor([4.0, 8.0]),
        tokens=torch.tensor([8.0, 8.0]),
        aux_losses={},
    )
    assert load.load_ratio.tolist() == [3.0, 1.0]  # 6 / mean 2; even
    summary = load.summary()
    assert summary["moe/load_ratio_max"] == 3.0 and summary["moe/router_entropy"] == 0.75
    assert summary["moe/dropped_fraction"] == 2.0 / 16.0
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log({"step": 1, **summary})
        logger.log_tensorboard(1, load.per_layer())
    (record,) = read_records(tmp_path / "metrics.jsonl")
    assert not any("layer_" in k for k in record)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Scalars("moe/layer_02/tokens_expert_00")[0].value == 6.0
    assert events.Scalars("moe/layer_02/dropped_fraction")[0].value == 0.25
    assert events.Scalars("moe/load_ratio_max")[0].value == 3.0


def test_a_full_disk_under_metrics_jsonl_is_said_naming_the_disk(tmp_path):
    """A full disk (here /dev/full, which answers every write with ENOSPC, as a full disk
    does) while a record is written: an error that names the file, the disk and its free
    space, not a bare [Errno 28]; closing the logger afterwards does not raise again."""
    import errno

    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"step": 1, "loss": 0.5})
    logger._file.close()
    logger._file = open("/dev/full", "a")  # noqa: SIM115 (the logger closes it)
    with pytest.raises(OSError) as info:
        logger.log({"step": 2, "loss": 0.25})
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert "metrics.jsonl (the record of step 2)" in message and str(tmp_path) in message
    assert "file system" in message and "mounted at /" in message and "bytes free" in message
    logger.close()
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1]


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nprint(time.process_time())"


def _burn(seconds: float) -> subprocess.Popen:
    """A child that spends ``seconds`` of CPU, then prints its own CPU time and waits for a
    line on stdin (so that it is still alive when the clock looks at it)."""
    code = BURN.format(s=seconds) + "\nimport sys; sys.stdout.flush(); sys.stdin.readline()"
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_a_cpu_run_counts_the_cpu_time_of_its_work_processes_only():
    """CPU runs charge CPU seconds of the process tree (a loaded machine's waits are not
    work), less background helpers (the forecast's fits): each child's own CPU time is the
    reference."""
    clock = WorkCPUClock(refresh=0.0)
    start = clock()
    time.sleep(0.3)  # waiting is not work (the process's other threads, left by earlier
    assert clock() - start < 0.15  # tests of this pytest worker, may spend a little: 0.05 seen)
    worker, helper = _burn(0.4), _burn(0.4)
    compute.background(helper.pid)
    spent = float(worker.stdout.readline())  # the worker's own count, at its end
    float(helper.stdout.readline())
    counted = clock() - start
    for child in (worker, helper):
        child.stdin.close()
        child.wait()
    # the worker's CPU (its start-up included), not the helper's; this process adds little.
    # /proc gives a child's user and system times in 10 ms ticks, each rounded down.
    assert spent - 0.02 <= counted < spent + 0.25


READINGS = """import json, os, threading, time
from megatron_rl.trainer.compute import WorkCPUClock


def others_cpu():  # every thread's CPU but this one's, each read to the nanosecond
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != threading.get_native_id():
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:  # the thread has ended
                pass
    return total / 1e9


clock = WorkCPUClock(refresh=0.0)
start = clock()
others, mine = others_cpu(), time.thread_time()
for _ in range(100):
    clock()
mine, others = time.thread_time() - mine, others_cpu() - others
print(json.dumps({"counted": clock() - start, "others": others, "mine": mine}))
"""


@pytest.mark.timeout(120)
def test_the_cpu_clock_leaves_its_own_reading_out_and_reads_this_process_exactly():
    """The clock's reading (a scan of the process table at every call here, 3-7 ms of CPU
    with ~100 processes) is not work: the count over 100 readings is what the process's
    other threads spent, each read on its own to the nanosecond; not the tick-rounded CPU
    time of the process with the scans in it. In a fresh process: a pytest worker keeps
    earlier tests' gloo groups, whose polling threads the clock leaves out (tested below)
    and whose CPU between the clock's reading of them and of the process counted 8-22 ms
    here, with hundreds of them."""
    out = subprocess.run(
        [sys.executable, "-c", READINGS], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["mine"] > 0.02  # the readings did cost (the old clock counted all of it)
    assert abs(result["counted"] - result["others"]) < 0.003, result


POLLER = """import sys, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
groups = [dist.new_group([0], backend="gloo") for _ in range(40)]
print("ready", flush=True)
sys.stdin.readline()
"""


def _polling_cpu(pid: int) -> float:
    """CPU seconds of the gloo transport threads of ``pid``, read here from /proc."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() != "gloo_tcp_loop":
                continue
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0]) / 1e9
    return total


def test_the_cpu_clock_leaves_out_gloos_polling_threads(tmp_path):
    """gloo's TCP transport runs a thread per process group that wakes every 10 ms, idle or
    not (36 ms of CPU a wall second in a trainer here): a process that only holds 40 gloo
    groups is counted no work while its transport threads poll (their CPU time, read from
    /proc here, is the reference: the old clock counted it all)."""
    child = subprocess.Popen(
        [sys.executable, "-c", POLLER, str(tmp_path / "store")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        fds = len(os.listdir("/proc/self/fd"))
        clock = WorkCPUClock(root=child.pid)
        start, polled = clock(), _polling_cpu(child.pid)
        deadline = time.monotonic() + 20
        while _polling_cpu(child.pid) - polled < 0.05 and time.monotonic() < deadline:
            time.sleep(0.2)
        counted, polled = clock() - start, _polling_cpu(child.pid) - polled
        del clock  # its threads' files are closed with it (a clock per run in one process)
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert polled >= 0.05  # they polled (under load it takes longer: up to 20 s)
    # idle but for the polling; /proc reads the child's CPU time in 10 ms ticks
    assert counted <= 0.011, (counted, polled)
