"""`megatron-rl tournament SPEC.yaml`: compare recipe variants at small compute and predict
them at a target budget (docs/scaling.md).

Each variant of the spec is a normal run directory under the tournament's directory
(``--dir``, default ``runs/tournaments/<name>``), trained by local processes or one Slurm job
each (``executor``), all from one shared initial checkpoint. Every variant is fitted as its
validations arrive (bootstrap intervals); a variant whose A is confidently below the
leader's is stopped early. At the end: ``ranking.txt`` (A, B, C_mid with intervals, compute
spent, predicted pass rate at the target, stopped early or not, the compute saved),
``tournament.png`` (every variant's points, fit and band) and ``tournament.json``.
Running the same command again resumes. ``--dry-run`` prints the plan (GPU-hours per
variant) and each variant's command or sbatch script, and runs nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatron_rl.config.errors import ConfigError

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``megatron-rl tournament``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("spec", help="tournament spec YAML (see recipes/tournaments/)")
    parser.add_argument("--dir", help="the tournament's directory (runs/tournaments/<name>)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan and the jobs; run nothing"
    )
    parser.add_argument(
        "--poll-seconds", type=float, default=15.0, help="seconds between two looks (15)"
    )
    parser.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        default="gpu",
        help="Slurm: the jobs' `megatron-rl launch --device` (default gpu)",
    )


def run(args: argparse.Namespace) -> int:
    """Plan, then run or resume (or print, ``--dry-run``); 2 with a message on a bad spec."""
    from megatron_rl.scaling.tournament import runner
    from megatron_rl.scaling.tournament.spec import format_plan, load_spec, plan

    try:
        spec = load_spec(args.spec)
        tdir = Path(args.dir or Path("runs") / "tournaments" / spec.name).resolve()
        plans = plan(spec)
        if args.dry_run:
            sys.stdout.write(format_plan(spec, plans) + "\n\n")
            sys.stdout.write(_jobs(spec, tdir, args.device) + "\n")
            return 0
        logger.info("%s", format_plan(spec, plans))
        if spec.executor == "local":
            executor = runner.LocalExecutor(spec.parallel)
        else:
            executor = runner.SlurmExecutor(launch_args=["--device", args.device])
        results = runner.run_tournament(spec, tdir, executor, args.poll_seconds)
    except ConfigError as err:
        sys.stderr.write(f"megatron-rl tournament: error: {err}\n")
        return 2
    sys.stdout.write(runner.finish(spec, tdir, results) + "\n")
    sys.stdout.write(f"ranking, plot and state in {tdir}\n")
    failed = [r.name for r in results if r.status == runner.FAILED]
    if failed:
        sys.stderr.write(f"megatron-rl tournament: failed variants: {', '.join(failed)}\n")
        return 1
    return 0


def _jobs(spec, tdir: Path, device: str) -> str:
    """Each variant's command (local) or sbatch script (Slurm), as the real run would."""
    from megatron_rl.scaling.tournament import runner
    from megatron_rl.scaling.tournament.spec import load_variant

    start: list[str] = []
    config = load_variant(spec, next(iter(spec.variants)))
    if config.warm_start.steps > 0:
        if spec.executor == "slurm":
            runner.shared_start(spec, tdir, local=False)  # raises: needs model.hf_path
        hf = tdir / runner.WARM_START_DIR / "hf"
        start = [f"model.hf_path={hf}", "warm_start.steps=0"]
    out = []
    if start:
        out.append(f"# the shared warm start, once: {tdir / runner.WARM_START_DIR}")
    for name in spec.variants:
        overrides = [*spec.variant_overrides(name), *start]
        run_dir = tdir / name
        if spec.executor == "local":
            command = runner.cli_command("train", str(spec.base), *overrides)
            out.append(f"# {name}\n" + " ".join([*command, "--run-dir", str(run_dir)]))
            continue
        from megatron_rl.launch.render import LaunchOptions, render_job_script

        options = LaunchOptions(device, sys.executable, os.getcwd(), None)
        script = render_job_script(
            load_variant(spec, name, start), str(spec.base), overrides, str(run_dir), options
        )
        out.append(f"# ===== {name}: {run_dir / 'job.sbatch'}\n{script}")
    return "\n".join(out)
