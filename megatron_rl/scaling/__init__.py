"""Post-hoc compute-curve tool: fit R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B) to RL runs,
extrapolate, compare runs by the paper's rule, bootstrap intervals, plots. Imports no torch."""

from megatron_rl.scaling.analysis import Comparison, RunFit, compare_runs, fit_run, select_points
from megatron_rl.scaling.bootstrap import BootstrapResult, bootstrap_fit
from megatron_rl.scaling.config import AUTO, FitConfig
from megatron_rl.scaling.data import RunData, load_run
from megatron_rl.scaling.fit import CurveFit, FitBox, fit_points, grid_search, refine
from megatron_rl.scaling.model import CurveParams, sigmoid_curve
from megatron_rl.scaling.synthetic import synthetic_run

__all__ = [
    "AUTO",
    "BootstrapResult",
    "Comparison",
    "CurveFit",
    "CurveParams",
    "FitBox",
    "FitConfig",
    "RunData",
    "RunFit",
    "bootstrap_fit",
    "compare_runs",
    "fit_points",
    "fit_run",
    "grid_search",
    "load_run",
    "refine",
    "select_points",
    "sigmoid_curve",
    "synthetic_run",
]
