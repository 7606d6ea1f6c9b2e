"""Fitting runs end to end and comparing them by the paper's rule."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from megatron_rl.scaling.bootstrap import BootstrapResult, bootstrap_fit
from megatron_rl.scaling.config import FitConfig
from megatron_rl.scaling.data import RunData
from megatron_rl.scaling.fit import CurveFit, fit_points

logger = logging.getLogger(__name__)

# How a comparison ranks runs: by B after refitting with a common A (A values within the
# tolerance), or by A when the asymptotes differ by more than the tolerance.
RULES = ("fixed_a", "by_a", "single")


@dataclass
class RunFit:
    """A run, which of its points were fitted, the fit and its bootstrap (if any)."""

    run: RunData
    fitted: np.ndarray  # [N] bool, True for points used in the fit
    fit: CurveFit
    bootstrap: BootstrapResult | None = None

    @property
    def name(self) -> str:
        return self.run.name

    def predict(self, x: float) -> float:
        """Fitted R at compute ``x``."""
        return float(self.fit.params.predict(x))

    def prediction_interval(self, x: float) -> tuple[float, float] | None:
        """Bootstrap band of R at ``x`` (None without bootstrap)."""
        if self.bootstrap is None:
            return None
        low, high = self.bootstrap.band(np.array([x]))
        return float(low[0]), float(high[0])


@dataclass
class Comparison:
    """Several runs' fits and their ranking (best first)."""

    fits: list[RunFit]
    rule: str  # one of RULES
    a_spread: float  # max A - min A of the individual fits
    a_common: float | None  # the A all runs were refitted with (rule "fixed_a")
    refits: list[RunFit] | None  # fits with A fixed at a_common (rule "fixed_a")
    ranking: list[int]  # indices into fits, best first


def select_points(run: RunData, config: FitConfig) -> np.ndarray:
    """Mask [N] of the points to fit: min_x <= x (<= fit_until) and x > 0.

    x = 0 is excluded because R(0) = R0 by construction, so it carries no information.
    """
    mask = (run.x >= config.min_x) & (run.x > 0)
    if config.fit_until is not None:
        mask &= run.x <= config.fit_until
    return mask


def _lower(min_x: float) -> str:
    """The lower bound of ``select_points`` as the error message states it."""
    return "> 0" if min_x <= 0 else f">= {min_x:g}"


def fit_run(run: RunData, config: FitConfig) -> RunFit:
    """Fit ``run`` by ``config`` (grid, refinement, bootstrap when ``config.bootstrap > 0``)."""
    config.validate()
    mask = select_points(run, config)
    n_fit = int(mask.sum())
    if n_fit < config.min_points:
        until = (
            f" and {run.x_field} <= {config.fit_until:g}" if config.fit_until is not None else ""
        )
        raise ValueError(
            f"{run.source}: too few points after filtering: {n_fit} of {len(run.x)} records "
            f"with {run.y_field!r} have {run.x_field} {_lower(config.min_x)}{until} (need at least "
            f"{config.min_points}; --min-x drops early points)"
        )
    r0 = config.r0 if config.r0 is not None else run.default_r0()
    positive = run.x[run.x > 0]
    x, y = run.x[mask], run.y[mask]
    fit = fit_points(x, y, r0, config, x_positive_min=float(positive.min()))
    boot = None
    if config.bootstrap > 0:
        # An R0 read off the step-0 point is as noisy as any point: resample it too.
        r0_sd = fit.rmse if config.r0 is None else 0.0
        boot = bootstrap_fit(x, y, fit, config.bootstrap, config.ci, config.seed, r0_sd)
    return RunFit(run, mask, fit, boot)


def compare_runs(runs: list[RunData], config: FitConfig) -> Comparison:
    """Fit every run; if their A lie within ``config.a_tolerance`` refit all with A fixed at
    the mean A and rank by B (higher first), else rank by A (higher first)."""
    if not runs:
        raise ValueError("no runs to compare")
    fits = [fit_run(run, config) for run in runs]
    a_values = np.array([f.fit.params.a for f in fits])
    spread = float(a_values.max() - a_values.min())
    if len(fits) == 1:
        return Comparison(fits, "single", spread, None, None, [0])
    if spread > config.a_tolerance + 1e-12:
        ranking = [int(i) for i in np.argsort(-a_values, kind="stable")]
        return Comparison(fits, "by_a", spread, None, None, ranking)
    a_common = float(a_values.mean())
    if config.fix_a is not None:
        refits = fits
    else:
        fixed = dataclasses.replace(config, fix_a=a_common)
        refits = [fit_run(run, fixed) for run in runs]
    b_values = np.array([f.fit.params.b for f in refits])
    ranking = [int(i) for i in np.argsort(-b_values, kind="stable")]
    return Comparison(fits, "fixed_a", spread, a_common, refits, ranking)
