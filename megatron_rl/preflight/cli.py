"""`megatron-rl preflight RECIPE.yaml [dotted.key=value ...] [--run-dir DIR]`: check the
allocation before a long run.

Runs the production code paths at reduced length on every trainer rank (start it like
``megatron-rl train``: under torchrun / srun for several ranks), prints a PASS/FAIL table and
writes ``RUN_DIR/preflight.json``. Exit status: 0 when every check passes, 1 when one fails,
2 for a bad recipe.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megatron-rl preflight`` (those of ``megatron-rl train``)."""
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. parallel.tensor=2"
    )
    parser.add_argument(
        "--run-dir", default=None, help="run directory (default: runs/<recipe name>)"
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="CHECK[,CHECK...]",
        help="run these checks (and those they need) only, e.g. --only engines",
    )


def run(args: argparse.Namespace) -> int:
    """Load the recipe, run every check, print the table; returns the exit status."""
    from megatron_rl.config import ConfigError, load_run_config
    from megatron_rl.preflight.registry import select

    try:
        checks = select(args.only.split(",") if args.only else None)
    except ValueError as err:
        print(f"megatron-rl preflight: error: --only: {err}", file=sys.stderr)
        return 2
    try:
        # The model's shapes are checked by the "model" check, which names what is wrong.
        config = load_run_config(args.recipe, args.overrides, check_model=False)
    except ConfigError as err:
        print(f"megatron-rl preflight: error: {err}", file=sys.stderr)
        return 2
    from megatron_rl.platform.launcher import lone_process_problem

    problem = lone_process_problem(config.parallel, config.cluster.trainer_gpus, "preflight")
    if problem:
        print(f"megatron-rl preflight: error: {problem}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from megatron_rl.preflight.report import render_table
    from megatron_rl.preflight.runner import run_preflight

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / config.name
    report = run_preflight(config, run_dir, recipe=args.recipe, checks=checks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        sys.stdout.write(render_table(report))
        sys.stdout.flush()
    return 0 if report.passed else 1
