"""Issue 45 section 1 end to end: a tiny CPU training run (real vLLM, megatron, reward pool)
whose scorer raises on half of every training batch goes on and logs ``reward_errors``; its
validation pass, where the scorer raises on every response (over
``reward.max_error_fraction``), stops the run with exit status 3 naming the setting, after
saving the step's due checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.platform import LAUNCHER_VARS

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
SMALL = [
    "warm_start.steps=0",
    "data.val_size=16",
    "data.synthetic.num_problems=200",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "validation.samples_per_prompt=2",
    "validation.at_start=false",
    "validation.every_steps=2",
    "checkpoint.every_steps=2",
    "training.max_steps=4",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
]

# The CLI with a scorer that fails: ``math.prepare`` (the reward's checks in the trainer
# process) raises on every other response of the training batches (8 of each step's 16) and
# on every response of a validation pass.
FAILING_SCORER = """
import sys

import megatron_rl.trainer.validation as validation
from megatron_rl.rewards import math

real_prepare, real_validate = math.prepare, validation.validate
state = {"calls": 0, "validating": False}


def prepare(response, answer, config):
    state["calls"] += 1
    if state["validating"] or state["calls"] % 2:
        raise OverflowError("int too large to convert to float")
    return real_prepare(response, answer, config)


def validate(*args, **kwargs):
    state["validating"] = True
    try:
        return real_validate(*args, **kwargs)
    finally:
        state["validating"] = False


math.prepare, validation.validate = prepare, validate
from megatron_rl.cli import main

sys.exit(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(600)  # 56-90 s on a loaded 2-core machine
def test_a_run_goes_on_past_scoring_failures_and_stops_past_the_fraction(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-c", FAILING_SCORER, "train", str(RECIPE), *SMALL]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    proc = subprocess.run(
        [*cmd, "--run-dir", str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "reward_mean" in r]
    # 8 of 16 failed each step: at reward.max_error_fraction 0.5, not over it
    assert [(r["step"], r["samples"], r["reward_errors"]) for r in steps] == [
        (1, 16, 8),
        (2, 16, 8),
    ]
    assert all(r["reward_crashes"] == 0 and r["pass_rate"] <= 0.5 for r in steps)
    # logged once for the kind, with the response
    logged = re.findall(
        r"scoring a math response failed \(in this process: OverflowError", proc.stderr
    )
    assert len(logged) == 1, proc.stderr[-3000:]
    # every validation response failed: the run stops, after the checkpoint due at step 2
    last = proc.stderr.strip().splitlines()[-1]
    failed = re.match(
        r"megatron-rl train: error: scoring failed on (\d+) of the (\d+) responses of the "
        r"validation pass of step 2 \((\d+) error\)",
        last,
    )
    assert failed and len(set(failed.groups())) == 1, last
    assert "reward.max_error_fraction 0.5" in last
    assert (run_dir / "checkpoints" / "step_00000002" / "meta.json").is_file()
