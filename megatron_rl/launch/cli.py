"""`megatron-rl launch RECIPE.yaml [dotted.key=value ...] [--run-dir D] [--dry-run]`.

Renders the run's sbatch script from the recipe's ``cluster`` section into
``RUN_DIR/job.sbatch`` and submits it with ``sbatch`` (``--dry-run``: prints it, writes and
submits nothing). Launching again on the same run directory resumes the run. A recipe whose
cluster section does not add up fails with the dotted key in one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from megatron_rl.launch.layout import DEVICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megatron-rl launch``."""
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. training.max_steps=100",
    )
    parser.add_argument(
        "--run-dir", default=None, help="run directory (default: runs/<recipe name>)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the sbatch script; write and submit nothing"
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="gpu",
        help="gpu: request the cluster section's GPUs (GRES) and set NCCL up; cpu: no GPUs, "
        "the cluster section's GPUs are task slots (default: gpu)",
    )
    parser.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs per Slurm task (default: each node's CPUs split evenly among its tasks)",
    )
    parser.add_argument(
        "--python",
        default=None,
        help="interpreter of the tasks (default: this one; python3 inside a container image)",
    )


def run(args: argparse.Namespace) -> int:
    """Render, then print (``--dry-run``) or write and submit. Returns the exit code."""
    from megatron_rl.config import ConfigError, load_run_config
    from megatron_rl.launch.render import LaunchOptions, render_job_script

    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        return _error(f"--cpus-per-task must be >= 1, got {args.cpus_per_task}", 2)
    try:
        config = load_run_config(args.recipe, args.overrides)
        run_dir = Path(args.run_dir or Path("runs") / config.name).resolve()
        python = args.python or ("python3" if config.cluster.container_image else sys.executable)
        options = LaunchOptions(args.device, python, os.getcwd(), args.cpus_per_task)
        script = render_job_script(
            config, str(Path(args.recipe).resolve()), args.overrides, str(run_dir), options
        )
    except ConfigError as err:
        return _error(str(err), 2)
    from megatron_rl.config.checks import start_weights_problem

    problem = start_weights_problem(config)
    if args.dry_run:
        if problem:  # the script asks for $HF_PATH at submission; a real launch refuses
            print(f"megatron-rl launch: warning: {problem}", file=sys.stderr)
        sys.stdout.write(script)
        return 0
    if problem:
        return _error(problem, 2)
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        return _error("sbatch not found: run on a Slurm login node (or use --dry-run)", 1)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / "job.sbatch"
    path.write_text(script)
    proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        return _error(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}", 1)
    job_id = proc.stdout.strip().split(";")[0]
    sys.stdout.write(
        f"submitted job {job_id}: {path}\n"
        f"  logs:    {run_dir}/logs/{config.name}-{job_id}-{{batch,trainer,generator}}.log\n"
        f"  metrics: {run_dir}/metrics.jsonl\n"
    )
    return 0


def _error(message: str, code: int) -> int:
    print(f"megatron-rl launch: error: {message}", file=sys.stderr)
    return code
