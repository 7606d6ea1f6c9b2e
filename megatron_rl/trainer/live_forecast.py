"""The live forecast of a training run (main rank): after every validation, fit the compute
curve to the validation points so far in a background process, then log the forecast
(``forecast_*`` fields, see :class:`megatron_rl.scaling.forecast.Forecast`) and redraw
``reward_curve.png`` with the fit and its band extrapolated to the budget. A mixture of
sources (math + code) is also forecast per domain, from its ``val_pass_rate/<domain>``
points: fields ``forecast_*/<domain>`` and a band per domain in the plot.

Nothing here blocks a step: a validation only hands the job to the worker process (spawned,
one at a time, at a lower CPU priority); the loop collects finished forecasts each step.
While a fit runs, later validations leave one pending job (the newest) instead of queueing
them all. The worker imports no torch (numpy, scipy, matplotlib) and exits with its parent.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.scaling.forecast import ForecastConfig, RunForecast
from megatron_rl.scaling.records import read_records
from megatron_rl.trainer import compute

logger = logging.getLogger(__name__)

_WORKER_NICE = 10
# At the normal end of a run, wait this long for the last forecast (a paper-grid fit with
# 100 bootstrap resamples takes a few seconds).
FINAL_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class _Job:
    step: int  # the validation step the forecast is made at
    budget: float


class LiveForecast:
    """Forecasts of one run, made in a background process.

    Args:
        metrics_path: the run's metrics.jsonl (the worker reads the validation points there).
        config: the recipe's ``forecast`` section.
        png: the plot to redraw after each forecast (None: no plot).
        title: the plot's title.
        log: writes a metrics record (the run's MetricsLogger.log).
    """

    def __init__(
        self,
        metrics_path: str | Path,
        config: ForecastConfig,
        png: str | Path | None,
        title: str,
        log: Callable[[dict[str, Any]], None],
    ) -> None:
        self.metrics_path = Path(metrics_path)
        self.config = config
        self.png = Path(png) if png is not None else None
        self.title = title
        self.log = log
        self.latest: RunForecast | None = None  # the newest forecast logged
        self._executor: ProcessPoolExecutor | None = None
        self._running: tuple[_Job, Future] | None = None
        self._pending: _Job | None = None
        # Points a fit would use (a resumed run's file is already cut to its checkpoint):
        # no worker is started before there are enough.
        self._points = 0
        if self.metrics_path.is_file():
            for record in read_records(self.metrics_path):
                if record.get("val_pass_rate") is not None:
                    self._count(record.get("gpu_hours"))

    def _count(self, gpu_hours: float | None) -> None:
        if gpu_hours is not None and gpu_hours > 0 and gpu_hours >= self.config.min_gpu_hours:
            self._points += 1

    def submit(self, step: int, budget: float | None, gpu_hours: float) -> None:
        """Forecast from the points logged so far (call after logging the validation of
        ``step`` at ``gpu_hours``)."""
        self._count(gpu_hours)
        if self._points < self.config.min_points:
            return
        if budget is None:
            logger.debug("no budget to forecast at yet (step %d)", step)
            return
        job = _Job(step, float(budget))
        if self._running is None:
            self._start(job)
        else:
            self._pending = job  # the newest replaces an older pending job

    def _start(self, job: _Job) -> None:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
            )
        png = str(self.png) if self.png is not None else None
        future = self._executor.submit(
            forecast_job, str(self.metrics_path), self.config, job.budget, png, self.title
        )
        # The worker's fits are not training compute (a CPU run's clock counts processes);
        # ProcessPoolExecutor starts its worker in submit() and keeps it in _processes.
        for pid in getattr(self._executor, "_processes", None) or {}:
            compute.background(pid)
        self._running = (job, future)

    def poll(self, fields: dict[str, Any]) -> None:
        """Log a finished forecast (merged with ``fields``: step, gpu_hours ...) and start the
        pending job, if any. Never waits."""
        if self._running is None or not self._running[1].done():
            return
        job, future = self._running
        self._running = None
        try:
            forecast = future.result()
        except ValueError as err:  # too few points so far, a flat curve ...
            logger.info("no forecast at step %d: %s", job.step, err)
        except Exception as err:  # a forecast must never stop training
            logger.warning("forecast at step %d failed: %r", job.step, err)
        else:
            self.latest = forecast
            self.log({**fields, "forecast_step": job.step, **forecast.record()})
            logger.info("forecast at step %d: %s", job.step, forecast.summary_line())
            for domain, why in forecast.skipped.items():
                logger.info("no %s forecast at step %d: %s", domain, job.step, why)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._start(pending)

    def close(self, fields: Callable[[], dict[str, Any]], wait_seconds: float = 0.0) -> None:
        """Wait up to ``wait_seconds`` for the running and pending forecasts (at the normal
        end of a run, so that the last validation gets its forecast), log them, stop."""
        if wait_seconds > 0:
            for _ in range(2):  # the running job, then the pending one it starts
                if self._running is None:
                    break
                wait([self._running[1]], timeout=wait_seconds)
                self.poll(fields())
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def forecast_job(
    metrics_path: str, config: ForecastConfig, budget: float, png: str | None, title: str
) -> RunForecast:
    """The worker's job: fit the run's validation points (overall and per domain), redraw
    the plot, return the forecast. Raises ValueError when there is nothing to fit yet."""
    from megatron_rl.scaling.forecast import forecast_metrics
    from megatron_rl.scaling.records import plot_reward_curve

    forecast = forecast_metrics(metrics_path, config, budget, growing=True)
    if png is not None:
        try:
            plot_reward_curve(
                metrics_path,
                png,
                title=title,
                forecast=forecast.overall,
                domain_forecasts=forecast.domains,
            )
        except Exception as err:  # the forecast is still worth logging
            logging.getLogger(__name__).warning("could not redraw %s: %r", png, err)
    return forecast


def _init_worker() -> None:
    """Lower priority and one BLAS thread (the trainer owns the cores); exit with the parent."""
    import threading
    import time

    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    # A SIGTERM / SIGUSR1 to the job's process group (preemption), or Ctrl-C's SIGINT, is the
    # trainer's to handle (it checkpoints, then ends this worker): killed, the pool would break.
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    try:
        os.nice(_WORKER_NICE)
    except OSError:
        pass
    parent = os.getppid()

    def watch() -> None:  # megatron_rl.platform has this too, but importing it imports torch
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
