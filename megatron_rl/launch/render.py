"""Render the sbatch script of a run from :mod:`megatron_rl.launch.template`.

``python -m megatron_rl.launch.render --write`` regenerates the checked-in scripts in
``slurm/`` (``--check`` fails when they differ from what the template renders now).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config.checks import start_weights_problem
from megatron_rl.launch.layout import JobLayout, plan_job, segment_nodes
from megatron_rl.launch.template import (
    CPU_ENV,
    GPU_DIRECTIVES_NOTE,
    GPU_ENV,
    HF_PATH_LINES,
    JOB_TEMPLATE,
    NO_SEGMENT_NOTE,
    SEGMENT_NOTE,
)
from megatron_rl.rollout.engine.nccl_env import ENGINE_NVLS_ENV

if TYPE_CHECKING:
    from megatron_rl.config.schema import RunConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
# recipe (relative to the repository root) -> checked-in script
CHECKED_IN: dict[str, str] = {
    "recipes/scalerl_8b.yaml": "slurm/scalerl_8b.sbatch",
    "recipes/scalerl_scout.yaml": "slurm/scalerl_scout.sbatch",
}
# The trainer reaches its generator tasks over TCP (megatron_rl.rollout.engine.serve).
PLACEMENT_OVERRIDE = "rollout.placement=remote"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass(frozen=True)
class LaunchOptions:
    """How the job runs, beyond the recipe.

    Attributes:
        device: "gpu" (GRES GPUs requested, NCCL settings) or "cpu" (no GPUs: task slots).
        python: the interpreter the tasks run (``$PYTHON`` at submission overrides it).
        workdir: the job's working directory (``#SBATCH --chdir``); None: where it is submitted.
        cpus_per_task: CPUs per task; None: each node's CPUs split evenly among its tasks.
    """

    device: str = "gpu"
    python: str = "python3"
    workdir: str | None = None
    cpus_per_task: int | None = None


def fill(template: str, values: Mapping[str, object]) -> str:
    """Replace every ``{{name}}``; a placeholder without a value or a value without a
    placeholder is a bug of the caller (AssertionError)."""
    names = set(_PLACEHOLDER.findall(template))
    assert names == set(values), f"template placeholders {sorted(names ^ set(values))} unmatched"
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def _quote_all(items: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(item)) for item in items)


def _directives(config: RunConfig, layout: JobLayout, run_dir: str, options: LaunchOptions) -> str:
    c = config.cluster
    t, g = layout.trainer, layout.generator
    tasks_per_node = (
        t.tasks + g.tasks if layout.shared_node else max(t.tasks_per_node, g.tasks_per_node)
    )
    lines = [
        f"--job-name={config.name}",
        f"--nodes={layout.nodes}",
        f"--ntasks-per-node={tasks_per_node}",
    ]
    if options.device == "gpu":
        lines.append(f"--gpus-per-node={layout.gpus_per_node}")
    if options.cpus_per_task:
        lines.append(f"--cpus-per-task={options.cpus_per_task}")
    lines += ["--exclusive", "--mem=0", f"--time={c.time}"]
    lines += [f"--partition={c.partition}"] * bool(c.partition)
    lines += [f"--account={c.account}"] * bool(c.account)
    lines += [f"--chdir={options.workdir}"] * bool(options.workdir)
    lines += [f"--output={run_dir}/logs/%x-%j-batch.log", "--open-mode=append"]
    if c.requeue:
        lines.append("--requeue")
    if c.signal_minutes_before_end:
        # B: the batch shell alone gets it and relays it to the trainer (see template.py).
        lines.append(f"--signal=B:USR1@{c.signal_minutes_before_end * 60}")
    segment = segment_nodes(config, layout)
    lines += [f"--segment={segment}"] * bool(segment)
    out = "\n".join(f"#SBATCH {line}" for line in lines)
    if options.device == "gpu" and layout.nodes > 1 and c.nvlink_domain_gpus > c.gpus_per_node:
        total = layout.nodes * layout.gpus_per_node
        fit = "are more than" if total > c.nvlink_domain_gpus else "fit in"
        how = SEGMENT_NOTE.format(segment=segment) if segment else NO_SEGMENT_NOTE
        domain = c.nvlink_domain_gpus
        out += "\n" + GPU_DIRECTIVES_NOTE.format(total=total, fit=fit, domain=domain, how=how)
    return out


def _on_off(value: bool) -> int:
    return 1 if value else 0


def _gpu_env(config: RunConfig) -> str:
    """GPU_ENV with the NCCL settings the recipe's cluster section makes (none: NCCL's own)."""
    c = config.cluster
    lines = []
    if c.nccl_mnnvl is None:
        lines.append("# NCCL_MNNVL_ENABLE: NCCL's auto-detect (cluster.nccl_mnnvl)")
    else:
        v = _on_off(c.nccl_mnnvl)
        lines.append(f"export NCCL_MNNVL_ENABLE=${{NCCL_MNNVL_ENABLE:-{v}}}  # cluster.nccl_mnnvl")
    if c.nccl_nvls is None:
        lines.append("# NCCL_NVLS_ENABLE (trainer): NCCL's default (cluster.nccl_nvls)")
    else:
        v = _on_off(c.nccl_nvls)
        lines.append(f"export NCCL_NVLS_ENABLE=${{NCCL_NVLS_ENABLE:-{v}}}  # cluster.nccl_nvls")
    return GPU_ENV.replace("{{nccl_settings}}", "\n".join(lines))


def _container_args(config: RunConfig) -> str:
    c = config.cluster
    if not c.container_image:
        return ""
    args = [f"--container-image={c.container_image}"]
    if c.container_mounts:
        args.append(f"--container-mounts={','.join(c.container_mounts)}")
    # relative paths (recipe, run dir) are resolved in the directory the job runs in
    return _quote_all(args) + ' --container-workdir="$PWD"'


def render_job_script(
    config: RunConfig,
    recipe: str,
    overrides: Sequence[str],
    run_dir: str,
    options: LaunchOptions = LaunchOptions(),
) -> str:
    """The sbatch script that trains ``recipe`` with ``overrides`` in ``run_dir``.

    ``config`` is the validated RunConfig of that recipe and those overrides (it gives the
    layout, the time limit, the requeue settings and the step budget). Raises ConfigError
    for a cluster section that Slurm cannot run (see :func:`plan_job`).
    """
    layout = plan_job(config, options.device)
    t, g = layout.trainer, layout.generator
    gpu = options.device == "gpu"
    train_args = _quote_all([recipe, *overrides, PLACEMENT_OVERRIDE])
    start_weights = ""
    if start_weights_problem(config) is not None:
        # A production preset without model.hf_path: the job takes the checkpoint from $HF_PATH
        # at submission and ends at once without it (the trainer would refuse it anyway).
        start_weights = HF_PATH_LINES.format(preset=config.model.preset)
        train_args += ' "model.hf_path=$HF_PATH"'
    train_args += " " + _quote_all(["--run-dir", run_dir])
    values = {
        "title": f"megatron_rl job: {recipe}" + (f" {' '.join(overrides)}" if overrides else ""),
        "summary": layout.summary(),
        "sbatch_directives": _directives(config, layout, run_dir, options),
        "run_dir": shlex.quote(run_dir),
        "python": shlex.quote(options.python),
        "start_weights": start_weights,
        "train_args": train_args,
        "max_steps": config.training.max_steps,
        "requeue": int(bool(config.cluster.requeue)),
        "preflight": int(bool(config.preflight)),
        "cpus_per_task": options.cpus_per_task or "",
        "container_args": _container_args(config),
        "trainer_tasks": t.tasks,
        "trainer_nodes": t.nodes,
        "trainer_tasks_per_node": t.tasks_per_node,
        "trainer_sharing": t.tasks_sharing_node,
        # expandable segments: less allocator fragmentation (megatron-rl plan counts 10%);
        # one hardware queue per GPU: Megatron's TP/SP overlap (not the engines': it would
        # serialise vLLM's streams)
        "trainer_gpu_args": (
            f"--gpus-per-node={t.gpus_per_node} "
            "--export=ALL,PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,"
            "CUDA_DEVICE_MAX_CONNECTIONS=1"
        )
        if gpu
        else "",
        "generator_tasks": g.tasks,
        "generator_nodes": g.nodes,
        "generator_tasks_per_node": g.tasks_per_node,
        "generator_sharing": g.tasks_sharing_node,
        # the same NCCL_* as the trainer (they share communicators); NVLS of the engines' own
        # communicators through a vLLM pin (megatron_rl.rollout.engine.nccl_env)
        "generator_gpu_args": (
            f"--gpus-per-node={g.gpus_per_node} "
            f"--export=ALL,{ENGINE_NVLS_ENV}={_on_off(config.cluster.engine_nccl_nvls)}"
        )
        if gpu
        else "",
        "generator_first_node": g.first_node,
        "engine_gpus": g.gpus_per_task,
        "device_env": _gpu_env(config) if gpu else CPU_ENV,
    }
    return fill(JOB_TEMPLATE, values)


def render_checked_in(recipe: str) -> str:
    """The checked-in script of ``recipe`` (a key of CHECKED_IN): submitted from the
    repository root, run directory ``runs/<name>``, ``python3`` unless ``$PYTHON`` is set."""
    from megatron_rl.config import load_run_config

    config = load_run_config(REPO_ROOT / recipe)
    return render_job_script(config, recipe, [], f"runs/{config.name}")


def main(argv: Sequence[str] | None = None) -> int:
    """``--write``: regenerate slurm/*.sbatch; ``--check``: exit 1 if any is stale."""
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch.render")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the checked-in scripts")
    mode.add_argument("--check", action="store_true", help="fail if a script is out of date")
    args = parser.parse_args(argv)
    stale = []
    for recipe, script in CHECKED_IN.items():
        text, path = render_checked_in(recipe), REPO_ROOT / script
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            sys.stdout.write(f"wrote {script}\n")
        elif not path.is_file() or path.read_text() != text:
            stale.append(script)
    if stale:
        sys.stderr.write(
            f"out of date: {', '.join(stale)} (run python -m megatron_rl.launch.render --write)\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
