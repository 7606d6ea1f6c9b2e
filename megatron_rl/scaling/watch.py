"""`megatron-rl fit --watch RUN_DIR`: follow a running run, refit its forecast, redraw its
plot and print a one-line summary per refresh, until the run finishes (no torch import).

The forecast settings are the run's (``forecast`` and ``training`` of ``RUN_DIR/config.yaml``,
the resolved recipe the trainer writes); the run's metrics are read as they grow.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from megatron_rl.config.errors import ConfigError
from megatron_rl.scaling.forecast import (
    ForecastConfig,
    RunForecast,
    forecast_metrics,
    resolve_budget,
)
from megatron_rl.scaling.records import METRICS_FILE

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"


@dataclass
class WatchSettings:
    """What a watch needs from the run's recipe."""

    forecast: ForecastConfig
    max_gpu_hours: float | None
    max_steps: int | None


def read_settings(run_dir: Path) -> WatchSettings:
    """The forecast settings of the run in ``run_dir`` (defaults without a config.yaml)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        logger.warning("%s not found: the paper's forecast settings, no budget", path)
        return WatchSettings(ForecastConfig(), None, None)
    data = yaml.safe_load(path.read_text()) or {}
    section = data.get("forecast") or {}
    known = {f.name for f in dataclasses.fields(ForecastConfig)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"{path}: unknown forecast keys {unknown}")
    forecast = ForecastConfig(**section)
    try:
        forecast.validate()
    except ConfigError as err:  # its key within the run's config.yaml
        raise err.within("forecast") from None
    training = data.get("training") or {}
    return WatchSettings(forecast, training.get("max_gpu_hours"), training.get("max_steps"))


@dataclass
class Refresh:
    """One look at the run: its progress, the forecast (if one could be fitted; per domain
    too for a mixture of sources), the line."""

    step: int
    gpu_hours: float
    finished: bool
    forecast: RunForecast | None
    line: str


def refresh(run_dir: Path, settings: WatchSettings, plot: Path | None) -> Refresh:
    """Read the run's metrics, fit the forecast, redraw ``plot``; never raises on a run that
    has too little to fit yet (the line says why)."""
    from megatron_rl.scaling.records import plot_reward_curve, read_records

    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        return Refresh(0, 0.0, False, None, f"waiting for {metrics}")
    records = read_records(metrics)
    if not records:
        return Refresh(0, 0.0, False, None, f"waiting for records in {metrics}")
    last = records[-1]
    step, hours = int(last["step"]), float(last.get("gpu_hours") or 0.0)
    finished = bool(last.get("run_finished"))
    vals = [r for r in records if r.get("val_pass_rate") is not None]
    progress = f"step {step}" + (f"/{settings.max_steps}" if settings.max_steps else "")
    head = f"{progress}  gpu_hours {hours:.4g}"
    if "total_gpu_hours" in last:
        head += f" (total {float(last['total_gpu_hours']):.4g})"
    if vals:
        head += f"  val {vals[-1]['val_pass_rate']:.3f}"
    forecast, tail = None, ""
    budget = resolve_budget(
        settings.forecast, settings.max_gpu_hours, settings.max_steps or 0, step, hours
    )
    if not vals:
        tail = "no validation yet"
    elif budget is None:
        tail = "no budget to forecast at yet"
    else:
        try:
            forecast = forecast_metrics(metrics, settings.forecast, budget, growing=True)
            tail = forecast.summary_line()
        except ValueError as err:
            tail = f"no forecast: {err}"
    if plot is not None and vals:
        try:
            plot_reward_curve(
                metrics,
                plot,
                title=run_dir.name,
                forecast=forecast.overall if forecast is not None else None,
                domain_forecasts=forecast.domains if forecast is not None else None,
            )
        except (ValueError, OSError) as err:
            tail += f" (plot failed: {err})"
    line = f"{head}  |  {tail}" + ("  [finished]" if finished else "")
    return Refresh(step, hours, finished, forecast, line)


def watch(
    run_dir: str | Path,
    interval: float = 30.0,
    max_refreshes: int = 0,
    plot: str | Path | None = None,
    budget: float | None = None,
    bootstrap: int | None = None,
    out: TextIO | None = None,
    sleep: Callable[[float], Any] = time.sleep,
) -> int:
    """Refresh every ``interval`` s until the run finishes, ``max_refreshes`` refreshes
    (0: no limit) or Ctrl-C. ``plot``: the PNG to redraw (default RUN_DIR/reward_curve.png);
    ``budget`` / ``bootstrap`` override the run's settings. Returns an exit code."""
    import sys

    out = out or sys.stdout
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    if interval < 0 or max_refreshes < 0:
        raise ValueError("--interval and --max-refreshes must be >= 0")
    settings = read_settings(run_dir)
    if budget is not None:
        settings.forecast.budget_gpu_hours = budget
    if bootstrap is not None:
        settings.forecast.bootstrap = bootstrap
    settings.forecast.validate()
    png = Path(plot) if plot is not None else run_dir / "reward_curve.png"
    done = 0
    try:
        while True:
            r = refresh(run_dir, settings, png)
            out.write(r.line + "\n")
            out.flush()
            done += 1
            if r.finished or (max_refreshes and done >= max_refreshes):
                return 0
            sleep(interval)
    except KeyboardInterrupt:
        out.write("stopped\n")
        return 0
