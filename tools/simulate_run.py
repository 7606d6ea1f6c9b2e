#!/usr/bin/env python
"""Simulate a recipe at cluster scale: the real RolloutSource against emulated engines and
trainer on a simulated clock (megatron_rl/simulation/; cost model in simulation/costs.py).

Prints, per mode and k: generator busy and occupancy, trainer busy, per-token lag
percentiles, samples per GPU-hour and projected GPU-hours for the recipe's max_steps; for an
8B recipe the ratio to the paper's run (7,400 steps of 768 samples in ~100k GB200 GPU-hours).

    .venv/bin/python tools/simulate_run.py recipes/scalerl_8b.yaml [recipes/scalerl_scout.yaml]
        [--k 1 2 4 8 16] [--mode pipeline_rl ppo] [--hardware gb200|h200|h100] [--plot out.png]
        [--steps 40] [--think-median 4000] [--expected] [KEY=VALUE ...]

The tables use the physical limit (the roofline of simulation/costs.py) unless --expected
(the model calibrated on published runs). `--calibrate` prints the published runs next to the
simulator's predictions (simulation/calibration.py), the fitted factors, the ScaleRL 8B and
Scout predictions (physical limit, expected with a range, the paper) and what issue 31's items
2-4 change at 8B; `--calibrate-plot out.png` draws predicted vs published; `--refit` fits the
factors again (minutes) instead of using the stored ones:

    .venv/bin/python tools/simulate_run.py --calibrate [--calibrate-plot calib.png] [--refit]
"""

from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.simulation.costs import HARDWARE, cost_model
from megatron_rl.simulation.report import (
    calibration_report,
    markdown_table,
    plot_calibration,
    plot_utilisation,
)
from megatron_rl.simulation.run import settings_from_config, simulate
from megatron_rl.simulation.workload import length_model

PAPER_8B = {"steps": 7400, "samples_per_step": 768, "gpu_hours": 100_000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipe YAMLs (KEY=VALUE overrides follow)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--mode", nargs="+", default=["pipeline_rl", "ppo"], choices=["pipeline_rl", "ppo"]
    )
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="gb200")
    parser.add_argument("--steps", type=int, default=40, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="PipelineRL steps not measured")
    parser.add_argument(
        "--think-median",
        type=float,
        default=4000.0,
        help="median thinking tokens of the length model",
    )
    parser.add_argument(
        "--push",
        choices=["broadcast", "serial"],
        default="broadcast",
        help="weight push: one pipelined broadcast, or engine after engine",
    )
    parser.add_argument(
        "--trained-fraction",
        type=float,
        default=1.0,
        help="fraction of groups with reward variance (a run's effective_batch_fraction): "
        "the update skips the rest; 1.0 (default) trains on every group",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="PNG of utilisation vs k")
    parser.add_argument(
        "--expected", action="store_true", help="the calibrated model, not the physical limit"
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="published runs vs predictions (no recipes)"
    )
    parser.add_argument("--calibrate-plot", help="PNG of predicted vs published (--calibrate)")
    parser.add_argument("--refit", action="store_true", help="fit the factors again (minutes)")
    parser.add_argument(
        "--no-predictions",
        action="store_true",
        help="--calibrate without the ScaleRL 8B / Scout predictions (quicker)",
    )
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help="--calibrate: also rewrite the predictions block of tools/README.md",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.calibrate:
        root = Path(__file__).resolve().parents[1]
        recipes = (
            []
            if args.no_predictions
            else [
                load_run_config(str(root / "recipes" / name), [])
                for name in ("scalerl_8b.yaml", "scalerl_scout.yaml")
            ]
        )
        text, rows = calibration_report(
            recipes, refit=args.refit, trained_fraction=args.trained_fraction
        )
        print(text)
        if args.write_readme:
            write_readme(root, text)
        if args.calibrate_plot:
            print(f"\nplot: {plot_calibration(rows, args.calibrate_plot)}")
        return 0
    if not args.recipes:
        parser.error("name at least one recipe (or --calibrate)")
    recipes = [r for r in args.recipes if "=" not in r]
    overrides = [r for r in args.recipes if "=" in r]
    runs = {}
    for recipe in recipes:
        try:
            config = load_run_config(recipe, overrides)
        except ConfigError as err:
            parser.error(str(err))
        costs = cost_model(config, args.hardware)
        if args.expected:
            costs = costs.calibrated()
        costs = costs.with_(push_transport=args.push)
        lengths = length_model(config, think_median=args.think_median)
        results = []
        for mode in args.mode:
            for k in args.k:
                if mode == "ppo":  # whole rounds of k updates; each round starts empty
                    steps, warmup = math.ceil(args.steps / k) * k, 0
                else:
                    steps, warmup = args.steps, args.warmup
                settings = settings_from_config(
                    config,
                    mode,
                    k,
                    steps=steps,
                    warmup=warmup,
                    seed=args.seed,
                    trained_fraction=args.trained_fraction,
                )
                results.append(simulate(costs, lengths, settings))
        runs[Path(recipe).stem] = results
        max_steps = config.training.max_steps
        print(
            f"\n## {recipe} on {args.hardware}, "
            f"{'expected (calibrated)' if args.expected else 'physical limit'} "
            f"({config.cluster.trainer_gpus} trainer + "
            f"{config.cluster.generator_gpus} generator GPUs, {config.rollout.engines} "
            f"engines x {config.rollout.max_num_seqs} seqs, push {costs.push():.2f} s)\n"
        )
        print(markdown_table(results, max_steps))
        if "8b" in Path(recipe).stem:
            paper_s = (
                PAPER_8B["gpu_hours"]
                * 3600
                / PAPER_8B["steps"]
                / (config.cluster.trainer_gpus + config.cluster.generator_gpus)
            )
            print(
                f"\nPaper 8B: {PAPER_8B['gpu_hours']:,} GPU-h for {PAPER_8B['steps']:,} "
                f"steps = {paper_s:.0f} s/step on 80 GPUs."
            )
            for r in results:
                ratio = PAPER_8B["gpu_hours"] / r.gpu_hours(PAPER_8B["steps"])
                print(
                    f"  {r.settings.mode} k={r.settings.k}: simulated "
                    f"{r.gpu_hours(PAPER_8B['steps']):,.0f} GPU-h, paper / simulated = "
                    f"{ratio:.1f}x"
                )
    if args.plot:
        print(f"\nplot: {plot_utilisation(runs, args.plot)}")
    return 0


def write_readme(root: Path, report: str) -> None:
    """Put the report's predictions (from its 'Ranges below' line) into tools/README.md's
    ``<!-- simulate --calibrate ... -->`` block, with the digest of the inputs they come from."""
    import re

    from megatron_rl.simulation.report import prediction_inputs_digest

    readme = root / "tools" / "README.md"
    predictions = report[report.index("Ranges below:") :].replace("\n### ", "\n#### ").strip()
    digest = prediction_inputs_digest(root)
    block = re.compile(r"<!-- simulate --calibrate, inputs \w+ -->\n.*?<!-- end simulate -->", re.S)
    text = readme.read_text()
    if not block.search(text):
        raise SystemExit(f"{readme}: no <!-- simulate --calibrate ... --> block to rewrite")
    new = f"<!-- simulate --calibrate, inputs {digest} -->\n{predictions}\n\n<!-- end simulate -->"
    readme.write_text(block.sub(lambda _: new, text))
    print(f"wrote the predictions into {readme} (inputs {digest})")


if __name__ == "__main__":
    raise SystemExit(main())
