#!/usr/bin/env python
"""Wall time per 768 samples: PipelineRL-8 vs PPO-off-policy-1 on the tiny CPU recipe.

Runs `megatron-rl train` for each mode and engine placement (the recipe's warm start, then
``--steps`` RL steps; no validation, no checkpoints) and reads the step records: the loop's
wall time is the sum of ``step_seconds`` (generation wait + update + weight push) after the
first two steps. The warm start matters: from random weights every group's rewards are
equal, the zero-variance filter leaves nothing to train, and both modes only generate.

Placement decides how much PipelineRL can overlap here. ``in_process`` (the embedded
default) runs vLLM on a thread of the trainer: with a model this small both sides are mostly
Python and take turns on the GIL. ``subprocess`` gives the engine a process (and a core) of
its own. Prints seconds per 768 samples for each run with its step split, the ratio per
placement, and the ratio of each mode at its faster placement. The figure in brackets is
PPO's step over its longer part (generation, or update + push): what hiding the shorter
part entirely would give at PPO's update speed. It is not a bound: PipelineRL also skips
PPO's wait for the batch's longest sample, and its update slows while the engine shares
the cores.

Measured on the project's 2-core machine, one run each (the update skips zero-variance
groups, about half of each batch; the push is fed):

    steps  in_process  subprocess  each at its faster placement
      24       1.44x       2.01x      1.67x
      24       1.57x       1.66x      1.58x
      48       1.21x       1.84x      1.60x   (PipelineRL 2.80 s vs PPO 4.48 s per 768)
      48       1.61x       1.88x      1.86x   (PipelineRL 2.39 s vs PPO 4.43 s per 768)
      24       1.32x       2.15x      1.77x   (PipelineRL 2.36 s vs PPO 4.18 s per 768)
      24       1.30x       1.64x      1.64x   (PipelineRL 3.23 s vs PPO 5.29 s per 768; a
                                               slower day: PPO in process 5.72 s, not 4.18)

and in process alone, five more runs of 24 steps: 1.56x, 1.34x, 1.33x, 1.41x, 1.31x. After the
rollout and loop restructuring (issue 29), quiet machine, 24 steps: in_process 1.49x, subprocess
1.65x (PipelineRL 2.48 s vs PPO 4.09 s per 768); beside other processes' tests (load 3-7):
1.26x and 1.32x.
(``OMP_WAIT_POLICY=PASSIVE`` sped both modes up by 0-17% in three of four paired runs, and
left the ratio where it was: 1.23x, 1.35x, 1.31x.)

Before those two changes: in_process 1.30x, subprocess 1.28x. In process, the PipelineRL
update varies most from run to run (0.33-0.52 s a step against PPO's 0.30 s): the engine's
thread and the trainer share the GIL (a shorter ``sys.setswitchinterval``, 0.5 ms, did not
help). The update's cost follows the fraction of groups trained on, which each mode's
learning sets: PipelineRL kept 50-57% of its groups, PPO 54-57% (in the last run 50% and
55% against 57%: about 12% and 4% less update work for PipelineRL).

    .venv/bin/python tools/bench_offpolicy.py [--steps 24] [--recipe recipes/tiny_cpu.yaml]
        [--placements in_process subprocess]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from train_run import step_records, train

ARGS = [
    "validation.enabled=false",
    "checkpoint.every_steps=0",
    "checkpoint.save_at_end=false",
    "logging.progress_bar=false",
]
MODES = {
    "PipelineRL-8": ["off_policy.mode=pipeline_rl", "off_policy.max_lag=8"],
    "PPO-off-policy-1": ["off_policy.mode=ppo", "off_policy.k=1"],
}
PLACEMENTS = ("in_process", "subprocess")


def seconds_per_768(
    recipe: str, steps: int, overrides: list[str], run_dir: Path
) -> tuple[float, dict[str, float]]:
    """Seconds per 768 samples, and the mean step's parts: waiting for the generator, the
    update (the rest) and the weight push."""
    records = train(recipe, [f"training.max_steps={steps}", *ARGS, *overrides], run_dir)
    steps_ = step_records(records, skip=2)  # skip warm-up steps
    seconds = sum(r["step_seconds"] for r in steps_) / sum(r["samples"] for r in steps_) * 768
    mean = lambda key: sum(r.get(key, 0.0) for r in steps_) / len(steps_)  # noqa: E731
    parts = {"step": mean("step_seconds"), "wait": mean("gen_wait_seconds")}
    parts["push"] = mean("push_seconds")
    parts["update"] = parts["step"] - parts["wait"] - parts["push"]
    parts["idle"] = mean("generator_idle_fraction")
    parts["kept"] = mean("effective_batch_fraction")  # the update's work: kept groups only
    return seconds, parts


def longer_part_ratio(ppo: dict[str, float]) -> float:
    """PPO's step over its longer part: generation (PPO's wait), or the update and the push
    (what hiding the shorter part entirely gives at PPO's update speed; see the docstring)."""
    return ppo["step"] / max(ppo["wait"], ppo["update"] + ppo["push"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS))
    args = parser.parse_args()
    results: dict[tuple[str, str], float] = {}
    parts: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for placement in args.placements:
            for name, overrides in MODES.items():
                run_dir = Path(tmp) / f"{name}-{placement}"
                overrides = [*overrides, f"rollout.placement={placement}"]
                seconds, part = seconds_per_768(args.recipe, args.steps, overrides, run_dir)
                results[name, placement], parts[name] = seconds, part
                print(
                    f"{name:>18} {placement:>11}: {seconds:7.2f} s per 768 samples; a step "
                    f"{part['step']:.2f} s = generator wait {part['wait']:.2f} + update "
                    f"{part['update']:.2f} + push {part['push']:.2f}; generator idle "
                    f"{part['idle']:.0%}; groups trained on {part['kept']:.0%}",
                    flush=True,
                )
            ratio = results["PPO-off-policy-1", placement] / results["PipelineRL-8", placement]
            bound = longer_part_ratio(parts["PPO-off-policy-1"])
            print(
                f"PPO-off-policy-1 / PipelineRL-8 wall-time ratio, {placement}: {ratio:.2f} "
                f"(PPO's step over its longer part: {bound:.2f})"
            )
    if len(args.placements) > 1:
        best = {n: min(v for (m, _), v in results.items() if m == n) for n in MODES}
        ratio = best["PPO-off-policy-1"] / best["PipelineRL-8"]
        print(f"PPO-off-policy-1 / PipelineRL-8, each at its faster placement: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
