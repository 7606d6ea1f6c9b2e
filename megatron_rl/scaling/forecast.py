"""A forecast of a running run: fit the compute curve to the validation points so far and
predict the pass rate at the run's budget, with bootstrap intervals (no torch import).

The fit is the post-hoc tool's (:func:`megatron_rl.scaling.fit_run`: the paper's grid over
A and C_mid with B fitted at each point, then the joint refinement, then a bootstrap over
points); a forecast only chooses which points (``x >= min_gpu_hours``, all so far) and where
to read the curve (the budget). The trainer runs it in a background process after every
validation (``megatron_rl.trainer.live_forecast``); ``megatron-rl fit --watch RUN_DIR``
runs it from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rl.scaling.analysis import fit_run

# ForecastConfig lives with the other configs (the run-config schema imports it without
# numpy or scipy); imported here for the callers that know it from this module.
from megatron_rl.scaling.config import ForecastConfig
from megatron_rl.scaling.data import RunData, domain_fields, load_run
from megatron_rl.scaling.model import CurveParams

_CURVE_POINTS = 200


@dataclass
class Forecast:
    """The curve fitted to a run's points so far and its prediction at ``budget``.

    ``curve_x`` [M] spans 0..budget; ``curve_y`` [M] is the fitted curve there and ``band_lo``
    / ``band_hi`` [M] its bootstrap band (None without bootstrap). Intervals are
    ``(low, high)`` of A, B, C_mid and of the prediction (None without bootstrap).
    """

    params: CurveParams
    budget: float
    pass_rate_at_budget: float
    n_points: int
    x_last: float  # compute of the last point fitted
    intervals: dict[str, tuple[float, float]] | None
    prediction_interval: tuple[float, float] | None
    at_bound: tuple[str, ...]
    points_x: np.ndarray  # [N] every validation point of the run (fitted or not)
    points_y: np.ndarray  # [N]
    fitted: np.ndarray  # [N] bool
    curve_x: np.ndarray  # [M]
    curve_y: np.ndarray  # [M]
    band_lo: np.ndarray | None = None  # [M]
    band_hi: np.ndarray | None = None  # [M]

    def record(self, domain: str | None = None) -> dict[str, Any]:
        """The metrics fields (``forecast_*``; intervals as ``*_lo`` / ``*_hi``); a
        ``domain``'s forecast names them ``forecast_*/<domain>``, as ``val_pass_rate/<domain>``."""
        if domain is not None:
            return {f"{key}/{domain}": value for key, value in self.record().items()}
        p = self.params
        out: dict[str, Any] = {
            "forecast_A": p.a,
            "forecast_B": p.b,
            "forecast_C_mid": p.c_mid,
            "forecast_R0": p.r0,
            "forecast_pass_rate_at_budget": self.pass_rate_at_budget,
            "forecast_budget_gpu_hours": self.budget,
            "forecast_points": self.n_points,
            "forecast_x_last": self.x_last,
        }
        names = {"a": "A", "b": "B", "c_mid": "C_mid"}
        for key, name in names.items():
            low, high = self.intervals[key] if self.intervals else (None, None)
            out[f"forecast_{name}_lo"], out[f"forecast_{name}_hi"] = low, high
        low, high = self.prediction_interval or (None, None)
        out["forecast_pass_rate_at_budget_lo"] = low
        out["forecast_pass_rate_at_budget_hi"] = high
        if self.at_bound:
            out["forecast_at_bound"] = [names[k] for k in self.at_bound]
        return out

    def summary_line(self) -> str:
        """One line: the parameters and the prediction at the budget, with intervals."""
        iv = self.intervals or {}

        def value(v: float, key: str | None, fmt: str) -> str:
            text = format(v, fmt)
            if key in iv:
                text += f" [{format(iv[key][0], fmt)}, {format(iv[key][1], fmt)}]"
            return text

        p = self.params
        pred = format(self.pass_rate_at_budget, ".3f")
        if self.prediction_interval:
            low, high = self.prediction_interval
            pred += f" [{low:.3f}, {high:.3f}]"
        edge = f" (edge: {', '.join(self.at_bound)})" if self.at_bound else ""
        return (
            f"{self.n_points} points to {self.x_last:.5g} GPU-h: A {value(p.a, 'a', '.3f')}  "
            f"B {value(p.b, 'b', '.2f')}  C_mid {value(p.c_mid, 'c_mid', '.4g')}  "
            f"-> R({self.budget:.6g}) = {pred}{edge}"
        )


def forecast_run(run: RunData, config: ForecastConfig, budget: float) -> Forecast:
    """Fit ``run``'s points (x >= ``config.min_gpu_hours``) by the paper's protocol and
    predict R at ``budget``. Raises ValueError when there are too few points to fit."""
    if not (_is_number(budget) and budget > 0):
        raise ValueError(f"forecast budget must be > 0, got {budget!r}")
    run_fit = fit_run(run, config.fit_config())
    fit = run_fit.fit
    curve_x = np.linspace(0.0, max(budget, float(run.x.max())), _CURVE_POINTS)
    boot = run_fit.bootstrap
    band = boot.band(curve_x) if boot is not None else (None, None)
    return Forecast(
        params=fit.params,
        budget=float(budget),
        pass_rate_at_budget=run_fit.predict(budget),
        n_points=fit.n_points,
        x_last=float(run.x[run_fit.fitted].max()),
        intervals=boot.intervals() if boot is not None else None,
        prediction_interval=run_fit.prediction_interval(budget),
        at_bound=fit.at_bound,
        points_x=run.x,
        points_y=run.y,
        fitted=run_fit.fitted,
        curve_x=curve_x,
        curve_y=fit.params.predict(curve_x),
        band_lo=band[0],
        band_hi=band[1],
    )


@dataclass
class RunForecast:
    """The forecast of a run's ``val_pass_rate`` and, for a mixture of sources, of each
    domain's ``val_pass_rate/<domain>`` (same points' compute, same budget).

    ``domains``: domain -> its forecast; ``skipped``: domain -> why it has none yet (too few
    points, a flat curve ...: the overall forecast does not wait for every domain).
    """

    overall: Forecast
    domains: dict[str, Forecast]
    skipped: dict[str, str]

    def record(self) -> dict[str, Any]:
        """The overall forecast's fields, then each domain's (``forecast_A/math`` ...)."""
        out = self.overall.record()
        for domain, forecast in self.domains.items():
            out.update(forecast.record(domain))
        return out

    def summary_line(self) -> str:
        """The overall line, then each domain's prediction at the budget."""
        parts = [self.overall.summary_line()]
        for domain, forecast in self.domains.items():
            text = f"{domain} {forecast.pass_rate_at_budget:.3f}"
            if forecast.prediction_interval:
                text += " [{:.3f}, {:.3f}]".format(*forecast.prediction_interval)
            parts.append(text)
        return "; ".join(parts)


def forecast_metrics(
    metrics_path: str | Path, config: ForecastConfig, budget: float, growing: bool = True
) -> RunForecast:
    """Forecast ``val_pass_rate`` of a metrics.jsonl and every ``val_pass_rate/<domain>`` in
    it. Raises ValueError when the overall curve cannot be fitted yet; a domain that cannot
    is listed in ``skipped``. ``growing``: the file is being written (see ``load_run``)."""
    overall = forecast_run(load_run(metrics_path, growing=growing), config, budget)
    domains: dict[str, Forecast] = {}
    skipped: dict[str, str] = {}
    for field in domain_fields(metrics_path):
        domain = field.split("/", 1)[1]
        try:
            run = load_run(metrics_path, y_field=field, growing=growing)
            domains[domain] = forecast_run(run, config, budget)
        except ValueError as err:
            skipped[domain] = str(err)
    return RunForecast(overall, domains, skipped)


def resolve_budget(
    config: ForecastConfig,
    max_gpu_hours: float | None,
    max_steps: int,
    step: int,
    gpu_hours: float,
) -> float | None:
    """The compute to forecast at: ``config.budget_gpu_hours``, else ``max_gpu_hours``, else
    the training GPU-hours at ``max_steps`` at the rate so far (None before any step)."""
    if config.budget_gpu_hours is not None:
        return float(config.budget_gpu_hours)
    if max_gpu_hours is not None:
        return float(max_gpu_hours)
    if step <= 0 or gpu_hours <= 0:
        return None
    return gpu_hours * max_steps / step


def _is_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
