"""Post-hoc compute-curve tool (SCALERL.md section 1). Imports no torch.

Fits R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B) to a run's validation pass rate against
training GPU-hours by the paper's procedure (grid over A and C_mid, B fitted at each grid
point, best residual wins, then a joint refinement), extrapolates, compares several runs by
the paper's rule (A within 0.02: refit with a common A and rank by B), gives bootstrap
intervals and plots.

    megatron-rl fit runs/a/metrics.jsonl runs/b/metrics.jsonl --fit-until 50000 \\
        --extrapolate-to 100000 --bootstrap 200 --plot curves.png
    megatron-rl fit tiny/metrics.jsonl --min-x 0 --auto-grid      # CPU-scale runs

    from megatron_rl.scaling import FitConfig, compare_runs, fit_run, load_run
    fit = fit_run(load_run("runs/a/metrics.jsonl"), FitConfig(fit_until=50_000)).fit
"""

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
