"""`megatron-rl train RECIPE.yaml [dotted.key=value ...]`: run (or resume) an RL recipe.

A malformed recipe fails before anything starts, with the dotted key path in one line on
stderr and exit status 2 (no traceback); a run stopped by the log-prob gap monitor exits
with status 3 and its reason on stderr, as is one whose reward fails (``RewardFailure``: more
than ``reward.max_error_fraction`` of a batch's responses fail to score, or the reward
workers cannot start). ``--dry-run`` prints the resolved config and the first training
prompt as the model will see it (text and token ids, as YAML comments:
:mod:`megatron_rl.trainer.preview`), and exits.
Re-running the same command on an existing run directory resumes it from its newest intact
checkpoint; a directory in use by another run, or with history but no checkpoint, or a recipe
that changed more than the safe keys, is refused with exit status 2 (``--restart``,
``--allow-changes``: see :mod:`megatron_rl.trainer.rundir`); a finished run says "already
finished" and exits 0. Ctrl-C (SIGINT, as SIGTERM) checkpoints at the next step and exits 0;
a second Ctrl-C stops at once, without a checkpoint: one line, exit status 130. The console
shows the run's own lines, the start block first; the libraries' output goes to
``RUN_DIR/logs/`` (:mod:`megatron_rl.trainer.console`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.config import RunConfig
    from megatron_rl.trainer.console import RunConsole


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megatron-rl train``."""
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optimizer.lr=1e-6"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and print the resolved config and the first prompt's text and ids, then exit",
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
        help="the progress bars, the validation pass rates and errors only (no start / end "
        "summaries, no other log lines, no library warnings; all are in RUN_DIR/logs/)",
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

    try:
        config = load_run_config(args.recipe, args.overrides)
    except ConfigError as err:
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    problem = start_weights_problem(config)
    if args.dry_run:
        if problem:  # a dry run shows the config; the real run would refuse
            print(f"megatron-rl train: warning: {problem}", file=sys.stderr)
        from megatron_rl.data import DataError
        from megatron_rl.trainer.preview import preview_lines

        sys.stdout.write(to_yaml(config))
        try:
            sys.stdout.write("".join(line + "\n" for line in preview_lines(config)))
        except DataError as err:  # the data the run would read: checked, named
            print(f"megatron-rl train: error: {err}", file=sys.stderr)
            return 2
        return 0
    if problem:
        print(f"megatron-rl train: error: {problem}", file=sys.stderr)
        return 2
    from megatron_rl.platform.launcher import lone_process_problem

    lone = lone_process_problem(config.parallel, config.cluster.trainer_gpus, "train")
    if lone:  # megatron's 'world size 1 is not divisible ...' traceback, per rank, otherwise
        print(f"megatron-rl train: error: {lone}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / config.name
    try:
        not_a_dir = next(
            (p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None
        )
    except OSError as err:  # a parent this user may not search
        print(f"megatron-rl train: error: run directory {run_dir}: {err}", file=sys.stderr)
        return 2
    if not_a_dir is not None:
        print(
            f"megatron-rl train: error: run directory {run_dir}: {not_a_dir} is a file, "
            "not a directory",
            file=sys.stderr,
        )
        return 2
    from megatron_rl.trainer.console import RunConsole

    # The console is ours from here (the libraries' output goes to RUN_DIR/logs/); a bar
    # ticks while the libraries import and the run is built, until the start block.
    with RunConsole(quiet=args.quiet, bars=config.logging.progress_bar) as console:
        return _train(config, run_dir, args, console)


def _train(config: RunConfig, run_dir: Path, args: argparse.Namespace, console: RunConsole) -> int:
    """Train; the errors a user can fix are one line on the console with an exit code."""
    from megatron_rl.data import DataError
    from megatron_rl.rewards.pool import RewardFailure
    from megatron_rl.trainer.loop import train
    from megatron_rl.trainer.rundir import RunDirError
    from megatron_rl.trainer.step import LogprobGapError
    from megatron_rl.trainer.tracking import TrackingError

    try:
        return int(train(config, run_dir, args.restart, args.allow_changes) or 0)
    except (RunDirError, TrackingError) as err:  # busy, history, changes; W&B cannot start
        console.error(f"megatron-rl train: error: {err}")
        return 2
    except (LogprobGapError, RewardFailure) as err:  # stopped on purpose: say why, no traceback
        console.error(f"megatron-rl train: error: {err}")
        return 3
    except DataError as err:  # a bad data file or row: its message names it
        console.error(f"megatron-rl train: error: {err}")
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C (the first one stops after a checkpoint)
        console.error(
            "megatron-rl train: interrupted (Ctrl-C twice): stopped at once, without a "
            "checkpoint of the steps since the last one (the same command resumes from it: "
            f"--run-dir {run_dir})"
        )
        return 130
