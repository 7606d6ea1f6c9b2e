"""Post-hoc compute-curve tool (docs/paper.md section 1). Imports no torch.

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

Names are imported on first use: the run-config schema reads ``scaling.config`` without
numpy or scipy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.lazy import lazy_exports

# public name -> defining module
_EXPORTS: dict[str, str] = {
    "Comparison": "megatron_rl.scaling.analysis",
    "RunFit": "megatron_rl.scaling.analysis",
    "compare_runs": "megatron_rl.scaling.analysis",
    "fit_run": "megatron_rl.scaling.analysis",
    "select_points": "megatron_rl.scaling.analysis",
    "BootstrapResult": "megatron_rl.scaling.bootstrap",
    "bootstrap_fit": "megatron_rl.scaling.bootstrap",
    "AUTO": "megatron_rl.scaling.config",
    "FitConfig": "megatron_rl.scaling.config",
    "RunData": "megatron_rl.scaling.data",
    "load_run": "megatron_rl.scaling.data",
    "CurveFit": "megatron_rl.scaling.fit",
    "FitBox": "megatron_rl.scaling.fit",
    "fit_points": "megatron_rl.scaling.fit",
    "grid_search": "megatron_rl.scaling.fit",
    "refine": "megatron_rl.scaling.fit",
    "CurveParams": "megatron_rl.scaling.model",
    "sigmoid_curve": "megatron_rl.scaling.model",
    "synthetic_run": "megatron_rl.scaling.synthetic",
}

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
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from megatron_rl.scaling.analysis import (
        Comparison,
        RunFit,
        compare_runs,
        fit_run,
        select_points,
    )
    from megatron_rl.scaling.bootstrap import BootstrapResult, bootstrap_fit
    from megatron_rl.scaling.config import AUTO, FitConfig
    from megatron_rl.scaling.data import RunData, load_run
    from megatron_rl.scaling.fit import CurveFit, FitBox, fit_points, grid_search, refine
    from megatron_rl.scaling.model import CurveParams, sigmoid_curve
    from megatron_rl.scaling.synthetic import synthetic_run


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
