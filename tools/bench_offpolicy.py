#!/usr/bin/env python
"""Wall time per 768 samples: PipelineRL-8 vs PPO-off-policy-1 on the tiny CPU recipe.

Runs `megatron-rl train` twice (no warm start, no validation, no checkpoints) and reads the
step records: the loop's wall time is the sum of ``step_seconds`` (generation wait + update +
weight push). Prints both numbers and their ratio.

    .venv/bin/python tools/bench_offpolicy.py [--steps 24] [--recipe recipes/tiny_cpu.yaml]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from train_run import step_records, train

ARGS = [
    "warm_start.steps=0",
    "validation.enabled=false",
    "checkpoint.every_steps=0",
    "checkpoint.save_at_end=false",
    "logging.progress_bar=false",
]
MODES = {
    "PipelineRL-8": ["off_policy.mode=pipeline_rl", "off_policy.max_lag=8"],
    "PPO-off-policy-1": ["off_policy.mode=ppo", "off_policy.k=1"],
}


def seconds_per_768(recipe: str, steps: int, overrides: list[str], run_dir: Path) -> float:
    records = train(recipe, [f"training.max_steps={steps}", *ARGS, *overrides], run_dir)
    steps_ = step_records(records, skip=2)  # skip warm-up steps
    return sum(r["step_seconds"] for r in steps_) / sum(r["samples"] for r in steps_) * 768


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in MODES.items():
            results[name] = seconds_per_768(args.recipe, args.steps, overrides, Path(tmp) / name)
            print(f"{name:>18}: {results[name]:7.2f} s per 768 samples", flush=True)
    ratio = results["PPO-off-policy-1"] / results["PipelineRL-8"]
    print(f"PPO-off-policy-1 / PipelineRL-8 wall-time ratio: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
