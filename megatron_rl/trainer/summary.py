"""What a run says at its start and at its end (main rank, one log block each).

Start: the recipe, the layout (trainer ranks, TP / PP / EP / CP / DP, engines and their
placement), the model and where its weights come from, the data sources with their sizes, the
step budget and where the outputs go. End (also after a signal or an error): the steps done,
the validation pass rate's first and last values, the GPU-hours (training and total), the run
directory's contents and the next commands. The start block is the console's first line
(:mod:`megatron_rl.trainer.console`): it is logged once the run is built, before the warm start
or resume. ``megatron-rl train --quiet`` hides both (it keeps the progress bars, the
validations and errors).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.scaling.records import read_records
from megatron_rl.trainer.console import START_BLOCK

if TYPE_CHECKING:
    from megatron_rl.config import RunConfig
    from megatron_rl.trainer.setup import Run

logger = logging.getLogger(__name__)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def layout_line(config: RunConfig, world: int) -> str:
    """``2 trainer ranks: TP 2, PP 1, EP 1, CP 1, DP 1; 1 engine(s) x TP 1, in_process``."""
    p = config.parallel
    dp = max(world // (p.tensor * p.pipeline * p.context), 1)
    r = config.rollout
    return (
        f"{world} trainer rank{'s' if world != 1 else ''}: TP {p.tensor}, PP {p.pipeline}, "
        f"EP {p.expert}, CP {p.context}, DP {dp}; {r.engines} engine"
        f"{'s' if r.engines != 1 else ''} x TP {r.tensor_parallel}, placement {r.placement}"
    )


def start_block(config: RunConfig, run: Run, step: int, world: int | None = None) -> str:
    """The start summary's text."""
    world = _world_size() if world is None else world
    m = config.model
    if step:  # resumed: the weights are the checkpoint's, whatever the run started from
        weights = f"weights from the step-{step} checkpoint in {run.run_dir}/checkpoints/"
    elif m.hf_path:
        weights = f"weights from {m.hf_path}"
    else:
        weights = f"random initialisation of preset {m.preset}, written to {run.hf_dir}"
    data = run.data
    counts: dict[int, list[int]] = {}
    for i in data.train_ids:
        counts.setdefault(data.prompts[i].source, [0, 0])[0] += 1
    for i in data.val_ids:
        counts.setdefault(data.prompts[i].source, [0, 0])[1] += 1
    sources = [
        f"  - {s.name or s.domain} ({s.domain}, {s.config.source}, weight {s.weight:g}): "
        f"{counts.get(k, [0, 0])[0]} train, {counts.get(k, [0, 0])[1]} validation prompts"
        for k, s in enumerate(data.sources)
    ]
    t = config.training
    budget = f"{t.max_steps} steps"
    if t.max_gpu_hours:
        budget += f" or {t.max_gpu_hours:g} training GPU-hours"
    budget += f", from step {step}" + (" (resumed)" if step else "")
    budget += (
        f"; {config.batch.prompts_per_step} prompts x {config.batch.samples_per_prompt} samples"
        f" a step, {config.off_policy.mode}"
    )
    if config.validation.enabled:
        budget += f"; validation every {config.validation.every_steps} steps"
    rd = run.run_dir
    outputs = [f"{rd}/metrics.jsonl", f"{rd}/checkpoints/"]
    if config.logging.tensorboard:
        outputs.append(f"{rd}/tensorboard/")
    if config.forecast.enabled and config.validation.enabled:
        outputs.append(f"{rd}/reward_curve.png")
    if config.logging.wandb.mode != "disabled":
        outputs.append(f"W&B ({config.logging.wandb.mode})")
    lines = [
        f"run {config.name}:",
        f"  layout: {layout_line(config, world)}",
        f"  model: {m.preset or 'HF config'} ({m.dtype}), {weights}",
        "  data:",
        *sources,
        f"  budget: {budget}",
        f"  outputs: {', '.join(outputs)}",
    ]
    return "\n".join(lines)


def _contents(run_dir: Path) -> str:
    if not run_dir.is_dir():
        return "(none)"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir())
    return ", ".join(n for n in names if not n.startswith("."))


def end_block(config: RunConfig, run: Run, first_step: int, step: int, outcome: str) -> str:
    """The end summary's text; ``outcome``: "finished", "stopped on SIGTERM", ..."""
    rd = run.run_dir
    path = rd / "metrics.jsonl"
    rates = (
        [r["val_pass_rate"] for r in read_records(path) if "val_pass_rate" in r]
        if (path.exists())
        else []
    )
    rates = [r for r in rates if r is not None]
    if rates:
        val = f"{rates[0]:.3f} first, {rates[-1]:.3f} last ({len(rates)} validations)"
    else:
        val = "no validation yet"
    hours = run.clock.summary()
    resume = f"megatron-rl train {rd}/config.yaml --run-dir {rd}"
    if outcome == "finished":
        resume += f" training.max_steps={config.training.max_steps * 2}  # to train on"
    lines = [
        f"run {config.name} {outcome}:",
        f"  steps: {step - first_step} this job, {step} of {config.training.max_steps} in all",
        f"  validation pass rate: {val}",
        f"  GPU-hours: {hours['gpu_hours']:.4g} training, {hours['total_gpu_hours']:.4g} total",
        f"  run directory {rd}: {_contents(rd)}",
        "  next:",
        f"    megatron-rl fit {path} --plot {rd}/fit.png",
        f"    {resume}",
    ]
    return "\n".join(lines)


def resume_step(run: Run) -> int:
    """The step the run goes on from: its newest intact checkpoint's (the one a resume
    loads), 0 without one."""
    latest = run.checkpoints.latest()
    return int(latest.name.removeprefix("step_")) if latest is not None else 0


def log_start(config: RunConfig, run: Run, step: int, main: bool) -> None:
    """Log the start summary on the main rank (the console's first line)."""
    if main:
        logger.info("%s", start_block(config, run, step), extra=START_BLOCK)


def log_end(
    config: RunConfig, run: Run, first_step: int, step: int, outcome: str, main: bool
) -> None:
    """Log the end summary on the main rank; never raises (it may follow an error)."""
    if not main:
        return
    try:
        logger.info("%s", end_block(config, run, first_step, step, outcome))
    except Exception as err:  # a summary must not hide the run's own error
        logger.warning("no end summary: %r", err)
