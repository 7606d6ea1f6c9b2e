"""Run the checks on every trainer rank and make the report."""

from __future__ import annotations

import copy
import logging
import shutil
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_rl.config.schema import RunConfig
from megatron_rl.preflight.context import Check, Outcome, PreflightContext, free_bytes
from megatron_rl.preflight.report import CheckResult, Report

logger = logging.getLogger(__name__)

WORK_DIR = "preflight"  # under the run directory: what the checks build and write


def preflight_config(config: RunConfig) -> RunConfig:
    """The recipe as the preflight runs it: the same model, layout, lengths and engines; no
    TensorBoard files (the run directory's belong to the run)."""
    config = copy.deepcopy(config)
    config.logging.tensorboard = False
    config.logging.progress_bar = False
    return config


def run_check(check: Check, ctx: PreflightContext, done: dict[str, CheckResult]) -> CheckResult:
    """One check on this rank, timed; an exception is its failure, a failed prerequisite
    skips it. The status is the same on every rank: a failure anywhere fails it."""
    from megatron_rl.platform import collectives

    missing = [n for n in check.needs if n in done and not done[n].passed]
    if missing:
        return CheckResult(check.name, "SKIP", message=f"needs {', '.join(missing)}, which failed")
    logger.info("preflight: %s (%s)", check.name, check.summary)
    t0 = time.perf_counter()
    try:
        outcome = check.run(ctx)
    except Exception as err:  # a check that raises has found its failure
        logger.error("preflight %s:\n%s", check.name, traceback.format_exc())
        outcome = Outcome(False, "error", message=f"{type(err).__name__}: {err}")
    seconds = time.perf_counter() - t0
    failed_anywhere = collectives.any_rank(not outcome.passed)
    message = outcome.message
    if failed_anywhere and outcome.passed:
        message = "failed on another rank (see that rank's log)"
    status = "FAIL" if failed_anywhere else "PASS"
    return CheckResult(
        check.name,
        status,
        outcome.value,
        outcome.limit,
        seconds,
        message,
        dict(outcome.details),
    )


def run_preflight(
    config: RunConfig,
    run_dir: str | Path,
    recipe: str = "",
    checks: Sequence[Check] | None = None,
    free: Callable[[Path], int] = free_bytes,
) -> Report:
    """Every check (``registry.CHECKS``) on this rank; every trainer rank calls this. The
    report (the same on every rank) is written to ``RUN_DIR/preflight.json`` by rank 0."""
    import torch.distributed as dist

    from megatron_rl.platform import collectives, get_platform, init_distributed
    from megatron_rl.preflight.registry import CHECKS

    start = time.perf_counter()
    config = preflight_config(config)
    run_dir = Path(run_dir)
    init_distributed(config.parallel, seed=config.seed)
    main = dist.get_rank() == 0
    work_dir = run_dir / WORK_DIR
    if main and work_dir.is_dir():
        # Scratch of an earlier preflight (a requeued job runs it again): its checkpoint and
        # config.yaml would make the trainer check resume there, and refuse an edited recipe.
        shutil.rmtree(work_dir)
    collectives.barrier()
    ctx = PreflightContext(config, run_dir, work_dir, main=main, free_bytes=free)
    report = Report(
        recipe or config.name, str(run_dir), get_platform().device, dist.get_world_size()
    )
    done: dict[str, CheckResult] = {}
    try:
        for check in CHECKS if checks is None else checks:
            result = run_check(check, ctx, done)
            done[check.name] = result
            report.results.append(result)
            logger.info("preflight: %s %s %s", result.name, result.status, result.value)
    finally:
        _close(ctx)
    report.seconds = time.perf_counter() - start
    if main:
        report.write(run_dir)
    return report


def _close(ctx: PreflightContext) -> None:
    if ctx.pool is not None:
        ctx.pool.close()
    if ctx.run is not None:
        ctx.run.rewards.close()
        ctx.run.metrics.close()
