"""`megatron-rl train RECIPE.yaml [dotted.key=value ...]`: run (or resume) an RL recipe.

A malformed recipe fails before anything starts, with the dotted key path in one line on
stderr and exit status 2 (no traceback); a run stopped by the log-prob gap monitor exits
with status 3 and its reason on stderr. ``--dry-run`` prints the resolved config and exits.
Re-running the same command on an existing run directory resumes it from its newest intact
checkpoint; a directory in use by another run, or with history but no checkpoint, or a recipe
that changed more than the safe keys, is refused with exit status 2 (``--restart``,
``--allow-changes``: see :mod:`megatron_rl.trainer.rundir`); a finished run says "already
finished" and exits 0. Ctrl-C (SIGINT, as SIGTERM) checkpoints at the next step and exits 0;
a second Ctrl-C stops at once, without a checkpoint: one line, exit status 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megatron-rl train``."""
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optimizer.lr=1e-6"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="validate and print the resolved config, then exit"
    )
    parser.add_argument(
        "--run-dir", default=None, help="run directory (default: runs/<recipe name>)"
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="start over in a run directory that has history (it is moved to previous_<time>/)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="the progress bar and errors only (no start / end summaries, no info logs)",
    )
    parser.add_argument(
        "--allow-changes",
        action="store_true",
        help="resume with settings that differ from the run's config.yaml beyond the safe keys",
    )


def run(args: argparse.Namespace) -> int:
    """Load and validate the recipe; print it (``--dry-run``) or train. Returns the exit code."""
    from megatron_rl.config import ConfigError, load_run_config, to_yaml
    from megatron_rl.config.checks import start_weights_problem

    if getattr(args, "quiet", False):
        # Ours and vLLM's (read when vLLM is imported, also by engine processes) loggers.
        logging.getLogger().setLevel(logging.ERROR)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    try:
        config = load_run_config(args.recipe, args.overrides)
    except ConfigError as err:
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    problem = start_weights_problem(config)
    if args.dry_run:
        if problem:  # a dry run shows the config; the real run would refuse
            print(f"megatron-rl train: warning: {problem}", file=sys.stderr)
        sys.stdout.write(to_yaml(config))
        return 0
    if problem:
        print(f"megatron-rl train: error: {problem}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / config.name
    not_a_dir = next(
        (p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None
    )
    if not_a_dir is not None:
        print(
            f"megatron-rl train: error: run directory {run_dir}: {not_a_dir} is a file, "
            "not a directory",
            file=sys.stderr,
        )
        return 2
    from megatron_rl.data import DataError
    from megatron_rl.trainer.loop import train
    from megatron_rl.trainer.rundir import RunDirError
    from megatron_rl.trainer.step import LogprobGapError
    from megatron_rl.trainer.tracking import TrackingError

    try:
        return int(train(config, run_dir, args.restart, args.allow_changes) or 0)
    except (RunDirError, TrackingError) as err:  # busy, history, changes; W&B cannot start
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    except LogprobGapError as err:  # the run is stopped on purpose: say why, no traceback
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 3
    except DataError as err:  # a bad data file or row: its message names it
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first one stops after a checkpoint)
        print(
            "megatron-rl train: interrupted (Ctrl-C twice): stopped at once, without a "
            "checkpoint of the steps since the last one (the same command resumes from it: "
            f"--run-dir {run_dir})",
            file=sys.stderr,
        )
        return 130
