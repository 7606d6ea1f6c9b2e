#!/usr/bin/env python
"""`gpu_hours` is training compute: it must not depend on how often a run validates.

Trains the tiny CPU recipe (real megatron + vLLM) 10 steps twice, validating every step and
every 10 steps, and prints at step 10 the ratio of the two runs' ``gpu_hours`` (issue 14's
criterion: within 10%), of the old clock (every device-second since start-up, still logged as
``total_gpu_hours``), and of the hours charged to validation. With ``--repeats N`` the pair
runs N times, alternating, and the median ratio is printed too.

It compares wall clocks, so run it on a machine nothing else is using: on a shared 2-core
machine the two runs' step times alone differ by more than 10%. Measured on this project's
2-core CPU machine (quiet): gpu_hours ratio 1.075, old clock 1.76, validation hours 2.5.

    .venv/bin/python tools/bench_gpu_hours.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from train_run import ROOT, train

RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
# Small batches, no warm start (the accounting, not the learning, is measured), heavy
# validation: 32 prompts x 2 samples = 64 validation samples against 16 training samples a
# step, so that validating every step would quadruple the generation of the old clock.
ARGS = [
    "warm_start.steps=0",
    "data.val_size=32",
    "data.synthetic.num_problems=200",
    "batch.prompts_per_step=4",
    "batch.samples_per_prompt=4",
    "validation.samples_per_prompt=2",
    "training.max_steps=10",
    "checkpoint.every_steps=0",
    "checkpoint.save_at_end=false",
    "forecast.enabled=false",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
]


def run(run_dir: Path, every: int) -> dict:
    """Train 10 steps validating every ``every`` steps; the step-10 training record."""
    overrides = [*ARGS, f"validation.every_steps={every}"]
    records = train(RECIPE, overrides, run_dir, VLLM_CPU_KVCACHE_SPACE="1")
    (last,) = [r for r in records if r["step"] == 10 and "reward_mean" in r]
    validations = sum("val_pass_rate" in r for r in records)
    expected = 11 if every == 1 else 2
    if validations != expected:
        sys.exit(f"{run_dir}: {validations} validations, expected {expected}")
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            every_step = run(Path(tmp) / f"every_step_{repeat}", 1)
            every_ten = run(Path(tmp) / f"every_ten_{repeat}", 10)
            ratio = every_step["gpu_hours"] / every_ten["gpu_hours"]
            old = [r["total_gpu_hours"] - r["startup_gpu_hours"] for r in (every_step, every_ten)]
            val = every_step["validation_gpu_hours"] / every_ten["validation_gpu_hours"]
            ratios.append(ratio)
            print(
                f"run {repeat}: gpu_hours at step 10: every step {every_step['gpu_hours']:.5f}, "
                f"every 10 steps {every_ten['gpu_hours']:.5f}: ratio {ratio:.3f} "
                f"({'within' if abs(ratio - 1) < 0.1 else 'NOT within'} 10%); old clock ratio "
                f"{old[0] / old[1]:.2f}; validation hours ratio {val:.2f} (11 vs 2 validations)",
                flush=True,
            )
    if args.repeats > 1:
        print(f"median gpu_hours ratio over {args.repeats} pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
