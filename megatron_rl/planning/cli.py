"""`megatron-rl plan RECIPE.yaml [dotted.key=value ...]`: will the run fit, and what to change.

Prints the memory of one trainer GPU and one engine GPU of the recipe's cluster (rich tables,
or Markdown with ``--markdown``), a verdict against the GPU's memory, and, when the trainer
does not leave ``--headroom``, the smallest change of its layout (TP / PP / EP / activation
recompute, every one passing the config checks) that does. Exit status: 0 when trainer and
engines fit with the headroom, 1 when not, 2 for a bad recipe.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rl.planning.gpus import DEFAULT_GPU, GPUS
from megatron_rl.planning.plan import DEFAULT_HEADROOM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megatron-rl plan``."""
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. parallel.expert=16",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        default=None,
        help=f"default: the recipe's cluster.gpu ({DEFAULT_GPU} unless set)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        help=f"fraction of the GPU to leave free (default: {DEFAULT_HEADROOM})",
    )
    parser.add_argument(
        "--expert-load",
        type=float,
        default=1.0,
        help="routed tokens on the busiest expert rank over the balanced share (default: 1)",
    )
    parser.add_argument(
        "--alternatives", type=int, default=5, help="fitting layouts to list (default: 5)"
    )
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")


def run(args: argparse.Namespace) -> int:
    """Plan and print; returns the exit status."""
    from megatron_rl.config import ConfigError, load_run_config
    from megatron_rl.planning.plan import plan_run
    from megatron_rl.planning.report import markdown, print_rich

    if not 0 <= args.headroom < 1:
        print(
            f"megatron-rl plan: error: --headroom must be in [0, 1), got {args.headroom}",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_run_config(args.recipe, args.overrides)
    except ConfigError as err:
        print(f"megatron-rl plan: error: {err}", file=sys.stderr)
        return 2
    gpu = args.gpu or config.cluster.gpu
    if gpu != config.cluster.gpu:  # the recipe was checked against cluster.gpu at load
        from megatron_rl.config.checks import fp8_recipe_problem, rollout_quantization_problem

        problem = fp8_recipe_problem(config.model, f"--gpu {gpu}", GPUS[gpu].fp8_recipes)
        if problem is not None:
            print(f"megatron-rl plan: error: {ConfigError(*problem)}", file=sys.stderr)
            return 2
        why = rollout_quantization_problem(config, f"--gpu {gpu}", GPUS[gpu].capability)
        if why is not None:
            error = ConfigError("rollout.quantization", why)
            print(f"megatron-rl plan: error: {error}", file=sys.stderr)
            return 2
    plan = plan_run(
        config,
        gpu=gpu,
        headroom=args.headroom,
        expert_load=args.expert_load,
    )
    if args.markdown:
        sys.stdout.write(markdown(plan, args.alternatives))
    else:
        print_rich(plan, args.alternatives)
    return 0 if plan.trainer_fits and plan.engine_fits else 1
