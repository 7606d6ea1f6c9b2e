"""Run the checks on every trainer rank and make the report.

A check that raises on one rank. Every rank runs every check, and a check's status is agreed
on by a collective after it (``collectives.any_rank``). A rank whose check raises (an OOM on
the busiest expert rank, a node that cannot read the HF files, a push that fails) may leave
the other ranks inside that check, blocked in a collective that waits for it; they would wait
the collective timeout (``parallel.timeout_minutes``, 30) and no report would be written. So:

- every rank, its check done, posts on the world's rendezvous store (c10d's TCPStore, which
  every rank reaches outside any collective: ``collectives.world_store``) that it has arrived,
  and, when its check failed, why (:class:`FailureBoard`);
- a rank whose check raised waits :data:`AGREE_SECONDS` for every rank to arrive. If they do
  (the check failed everywhere, or the others did not need this rank), the status is agreed
  as usual and the preflight goes on. If they do not, they are stuck inside the check (or
  slow, which makes no difference): this rank writes the report itself (the checks so far,
  this one FAIL naming the rank and its error, the rest SKIP), prints the table and ends its
  process with status 1 (``os._exit``: no unwinding through NCCL teardown, which can block
  on a communicator a peer still uses);
- the launcher then ends the others: ``srun --kill-on-bad-exit=1`` (the sbatch job's steps)
  and torchrun on one node end every task of a step when one fails (torchrun across nodes
  does not: each node's agent stops only its own workers, so the other nodes' ranks wait
  for the collective timeout; launch multi-node preflights with srun, as the sbatch job
  does). On NCCL that is the only way: an NCCL
  collective cannot be interrupted by a flag, and aborting this rank's communicators
  (``ncclCommAbort``) is local and wakes no peer; its watchdog would only fire after the
  collective timeout. On gloo the others' collective fails as soon as this rank's process is
  gone; they find the failure on the board (:class:`PeerFailure`) and end with status 1,
  without a report of their own (the failing rank's stands).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import RunConfig
from megatron_rl.preflight.context import Check, Outcome, PreflightContext, free_bytes
from megatron_rl.preflight.report import REPORT_FILE, CheckResult, Report

logger = logging.getLogger(__name__)

WORK_DIR = "preflight"  # under the run directory: what the checks build and write
# How long a rank whose check raised waits for the others to finish that check before it
# writes the report and ends its process (see the module docstring). Ranks that fail alike
# (a deterministic error) arrive within this; a rank blocked in a collective never does.
AGREE_SECONDS = 5.0
EXIT_FAILED = 1  # the process status of a failed preflight (the CLI's)
CLOSE_SECONDS = 30.0  # the engines' shutdown before a failing rank ends its process
STORE_PREFIX = "megatron_rl/preflight"
_runs = 0  # preflights run by this process (every rank runs the same): the store keys' prefix


class RankFailure(Exception):
    """This rank's check raised while other ranks were still inside it: this rank reports."""

    def __init__(self, check: str, rank: int, error: str, seconds: float) -> None:
        super().__init__(f"rank {rank} failed in check {check}: {error}")
        self.check, self.rank, self.error, self.seconds = check, rank, error, seconds


class PeerFailure(Exception):
    """Another rank ended the preflight (its check raised; it wrote the report): this rank
    ends without one. ``failures``: {rank: why} posted on the board for the check."""

    def __init__(self, check: str, failures: dict[int, str]) -> None:
        why = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items())) or "unknown"
        super().__init__(f"the preflight ended in check {check} on another rank ({why})")
        self.check, self.failures = check, failures


class FailureBoard:
    """The ranks' notes to each other about one check, on the world's rendezvous store:
    how many ranks finished it, and why it failed on which rank. Store calls that fail (the
    store lives in rank 0's process, which may be gone) raise :class:`PeerFailure`."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str) -> None:
        self.store, self.rank, self.world, self.prefix = store, rank, world, prefix

    @classmethod
    def of_world(cls) -> FailureBoard | None:
        """The board of this world (None on one rank: nobody to tell)."""
        import torch.distributed as dist

        from megatron_rl.platform import collectives

        global _runs
        store = collectives.world_store()
        if store is None:
            return None
        _runs += 1
        return cls(store, dist.get_rank(), dist.get_world_size(), f"{STORE_PREFIX}/{_runs}")

    def _key(self, check: str, what: str) -> str:
        return f"{self.prefix}/{check}/{what}"

    def _call(self, check: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as err:  # the store's server (rank 0's process) is gone
            raise PeerFailure(check, {0: f"rendezvous store unreachable: {err}"}) from err

    def finish(self, check: str, failure: str | None) -> None:
        """This rank is done with ``check``; ``failure``: why it failed here (None: passed)."""
        if failure is not None:
            key = self._key(check, f"failed/{self.rank}")
            self._call(check, self.store.set, key, failure)
        self._call(check, self.store.add, self._key(check, "arrived"), 1)

    def all_arrived(self, check: str, seconds: float) -> bool:
        """Whether every rank finishes ``check`` within ``seconds``."""
        key = self._key(check, "arrived")
        deadline = time.monotonic() + seconds
        while self._call(check, self.store.add, key, 0) < self.world:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def failures(self, check: str) -> dict[int, str]:
        """{rank: why} of the ranks that posted a failure of ``check``."""
        out = {}
        for rank in range(self.world):
            key = self._key(check, f"failed/{rank}")
            if self._call(check, self.store.check, [key]):
                out[rank] = self._call(check, self.store.get, key).decode()
        return out


def preflight_config(config: RunConfig) -> RunConfig:
    """The recipe as the preflight runs it: the same model, layout, lengths and engines; no
    TensorBoard files (the run directory's belong to the run)."""
    config = copy.deepcopy(config)
    config.logging.tensorboard = False
    config.logging.progress_bar = False
    return config


def run_check(
    check: Check,
    ctx: PreflightContext,
    done: dict[str, CheckResult],
    board: FailureBoard | None = None,
) -> CheckResult:
    """One check on this rank, timed; an exception is its failure, a failed prerequisite
    skips it. The status is the same on every rank: a failure anywhere fails it, and the
    report names the rank(s) it failed on. With ``board`` (several ranks): raises
    :class:`RankFailure` when this rank's check raised and the others did not finish the
    check within :data:`AGREE_SECONDS`, :class:`PeerFailure` when another rank ended the
    preflight (see the module docstring)."""
    from megatron_rl.platform import collectives

    missing = [n for n in check.needs if n in done and not done[n].passed]
    if missing:
        return CheckResult(check.name, "SKIP", message=f"needs {', '.join(missing)}, which failed")
    logger.info("preflight: %s (%s)", check.name, check.summary)
    t0 = time.perf_counter()
    raised = None
    try:
        outcome = check.run(ctx)
    except Exception as err:  # a check that raises has found its failure
        logger.error("preflight %s:\n%s", check.name, traceback.format_exc())
        raised = f"{type(err).__name__}: {err}"
        outcome = Outcome(False, "error", message=raised)
    seconds = time.perf_counter() - t0
    if board is not None:
        board.finish(check.name, None if outcome.passed else outcome.message or outcome.value)
        if raised is not None and not board.all_arrived(check.name, AGREE_SECONDS):
            raise RankFailure(check.name, board.rank, raised, seconds)
    try:
        failed_anywhere = collectives.any_rank(not outcome.passed)
    except Exception as err:  # a rank that ended the preflight is gone from the agreement
        if board is None:
            raise
        raise PeerFailure(check.name, board.failures(check.name)) from err
    message, details = outcome.message, dict(outcome.details)
    if failed_anywhere and board is not None:
        failures = board.failures(check.name)
        details["failed_ranks"] = sorted(failures)
        if outcome.passed:
            message = "; ".join(f"failed on rank {r}: {m}" for r, m in sorted(failures.items()))
        else:
            message = f"rank {board.rank}: {message}"
    elif failed_anywhere and outcome.passed:
        message = "failed on another rank (see that rank's log)"
    status = "FAIL" if failed_anywhere else "PASS"
    return CheckResult(
        check.name,
        status,
        outcome.value,
        outcome.limit,
        seconds,
        message,
        details,
    )


def run_preflight(
    config: RunConfig,
    run_dir: str | Path,
    recipe: str = "",
    checks: Sequence[Check] | None = None,
    free: Callable[[Path], int] = free_bytes,
) -> Report:
    """Every check (``registry.CHECKS``) on this rank; every trainer rank calls this. The
    report (the same on every rank) is written to ``RUN_DIR/preflight.json`` by rank 0; or,
    when a check raised on some ranks while the others stayed inside it, by the failing
    rank, which then ends this process with status 1 (so do the others once they learn it;
    see the module docstring): this function then does not return."""
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
    checks = CHECKS if checks is None else checks
    board = FailureBoard.of_world()
    try:
        for check in checks:
            result = run_check(check, ctx, done, board)
            done[check.name] = result
            report.results.append(result)
            logger.info("preflight: %s %s %s", result.name, result.status, result.value)
    except RankFailure as failure:
        report.seconds = time.perf_counter() - start
        _end_with_report(report, checks, failure, ctx, run_dir)
    except PeerFailure as failure:
        logger.error("preflight stopped: %s; report: %s", failure, run_dir / REPORT_FILE)
        _end_process(ctx)
    finally:
        _close(ctx)
    report.seconds = time.perf_counter() - start
    if main:
        report.write(run_dir)
    return report


def _end_with_report(
    report: Report,
    checks: Sequence[Check],
    failure: RankFailure,
    ctx: PreflightContext,
    run_dir: Path,
) -> None:
    """This rank's check raised while others were inside it: the report from this rank (the
    checks so far, this one FAIL naming the rank, the rest SKIP), the table on stdout, then
    the end of this process (the launcher ends the others)."""
    from megatron_rl.preflight.report import render_table

    ran = {r.name for r in report.results}
    report.results.append(
        CheckResult(
            failure.check,
            "FAIL",
            "error",
            "",
            failure.seconds,
            f"rank {failure.rank}: {failure.error} (the other ranks did not finish the check "
            f"within {AGREE_SECONDS:g} s: the preflight ended here)",
            {"failed_ranks": [failure.rank]},
        )
    )
    for check in checks:
        if check.name not in ran and check.name != failure.check:
            report.results.append(
                CheckResult(
                    check.name,
                    "SKIP",
                    message=f"not run: rank {failure.rank} failed in {failure.check}",
                )
            )
    path = report.write(run_dir)
    logger.error("preflight stopped: %s; report: %s", failure, path)
    sys.stdout.write(render_table(report))
    _end_process(ctx)


def _end_process(ctx: PreflightContext) -> None:
    """End this process now with :data:`EXIT_FAILED`, after at most :data:`CLOSE_SECONDS`
    for the engines' shutdown (no unwinding: see the module docstring)."""
    closer = threading.Thread(target=_close, args=(ctx,), name="preflight-close", daemon=True)
    closer.start()
    closer.join(CLOSE_SECONDS)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILED)


def _close(ctx: PreflightContext) -> None:
    if ctx.pool is not None:
        ctx.pool.close()
    if ctx.run is not None:
        ctx.run.rewards.close()
        ctx.run.metrics.close()
