"""The training-compute axis (``gpu_hours``) does not depend on how often a run validates
(issue 48 part 1, docs/scaling.md): two runs of the embedded default side by side, one
validating every step and one every 10 steps, reach step 30 at the same training compute
within 15%.

Not step 10 and 5%, as the issue asks: on this 2-core machine the CPU time of the same work
varies with the contention more than that. Measured on 2026-12-08, PPO-off-policy-1, 30
steps, two runs side by side (the same work: same tokens, same losses), seven pairs with the
old clock and eleven with this one (which leaves out gloo's polling threads and its own
scans), loads 3-24: two runs of the same cadence differed by up to 35% at step 10 (1.35 at a
load of 19; 0.90-1.19 at loads 3-9 with this clock) and by up to 8.8% at step 30 (0.92-1.07,
ten pairs); the two cadences gave 0.91-1.07 at step 30 (eight pairs), within that noise. No
leak: one per validation would grow with the 30 validations against 3, and the frequent
validation's run is, if anything, 3% lower. A run's CPU time rose with its training wall
time (correlation 0.5 and 0.7 in the two series): the engine thread spent 0.12 CPU-s on a
batch in one run and 0.20 on the same batch in the other, which waited longer for the cores.
The training wall time of the same pairs (the old axis, wall time x processes) differed by
up to 25% at step 30 (0.80-1.22): it fails this bound in 3 of the 18 pairs. The pair takes
1-3 minutes (75 s at a load of 10)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_trainer_loop import ROOT, train_cmd, train_env

STEP = 30

# The embedded default with a short warm start (start-up is not on the axis), no checkpoints,
# PPO-off-policy-1: nothing is generated ahead of a step, so the axis at a step holds the
# same work in both runs (under PipelineRL it holds the generation done ahead for the batches
# in flight, which depends on timing: 18% apart in one full-suite run here).
AXIS_ARGS = (
    "off_policy.mode=ppo",
    "off_policy.k=1",
    f"training.max_steps={STEP}",
    "warm_start.steps=20",
    "checkpoint.every_steps=0",
    "checkpoint.save_at_end=false",
)


def _at_step(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if r.get("step") == STEP and "step_seconds" in r]
    return record


@pytest.mark.slow
@pytest.mark.timeout(600)  # 1-3 min for the pair on a 2-core machine under a load of 3-24
def test_training_compute_does_not_depend_on_the_validation_cadence(tmp_path):
    runs = {every: tmp_path / f"every_{every}" for every in (1, 10)}
    procs = {
        every: subprocess.Popen(
            train_cmd(run_dir, *AXIS_ARGS, f"validation.every_steps={every}"),
            cwd=ROOT,
            env=train_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for every, run_dir in runs.items()
    }
    for proc in procs.values():
        _, err = proc.communicate(timeout=540)
        assert proc.returncode == 0, err[-3000:]
    often, rarely = (_at_step(runs[every]) for every in (1, 10))
    # the same work: the same samples trained on
    assert often["response_tokens"] == rarely["response_tokens"]
    # validating every step spends far more on validation ...
    assert often["validation_gpu_hours"] > 2 * rarely["validation_gpu_hours"]
    # ... and none of it on the training axis
    ratio = often["gpu_hours"] / rarely["gpu_hours"]
    assert abs(ratio - 1) < 0.15, (often["gpu_hours"], rarely["gpu_hours"])
