"""Bootstrap over points: intervals for A, B, C_mid and a band for the curve."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from megatron_rl.scaling.fit import PARAM_NAMES, CurveFit, refine
from megatron_rl.scaling.model import gain_fraction, log_ratio

logger = logging.getLogger(__name__)


@dataclass
class BootstrapResult:
    """Refits on resampled points; ``samples``: [N, 4] columns (a, b, c_mid, r0)."""

    samples: np.ndarray
    level: float
    n_failed: int

    def interval(self, name: str) -> tuple[float, float]:
        """Percentile interval at ``level`` of parameter ``name`` (a, b or c_mid)."""
        column = self.samples[:, PARAM_NAMES.index(name)]
        tail = 100.0 * (1.0 - self.level) / 2.0
        low, high = np.percentile(column, [tail, 100.0 - tail])
        return float(low), float(high)

    def intervals(self) -> dict[str, tuple[float, float]]:
        """Intervals of every parameter."""
        return {name: self.interval(name) for name in PARAM_NAMES}

    def band(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pointwise percentile band of R(x): (low [M], high [M]) for ``x`` [M]."""
        x = np.asarray(x, dtype=np.float64)
        a, b, c_mid, r0 = (self.samples[:, k, None] for k in range(4))
        curves = r0 + (a - r0) * gain_fraction(b, log_ratio(c_mid, x[None, :]))
        tail = 100.0 * (1.0 - self.level) / 2.0
        low, high = np.percentile(curves, [tail, 100.0 - tail], axis=0)
        return low, high


def bootstrap_fit(
    x: np.ndarray,
    y: np.ndarray,
    fit: CurveFit,
    n_resamples: int,
    level: float,
    seed: int,
    r0_sd: float = 0.0,
) -> BootstrapResult:
    """Resample the fitted points ``x``, ``y`` [n] with replacement ``n_resamples`` times and
    refit each from the point estimate inside the same box (a fixed A stays fixed).

    R0 is not among the fitted points; when it is itself one noisy evaluation (the step-0
    point), pass its noise sd as ``r0_sd`` (e.g. the fit's rmse) and every resample draws
    R0 from N(R0, r0_sd^2), so that the intervals carry R0's uncertainty too.
    Resamples with fewer distinct x than free parameters are skipped and counted as failed.
    """
    if n_resamples < 1:
        raise ValueError(f"bootstrap needs n_resamples >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    n = len(x)
    n_free = 2 if fit.a_fixed else 3
    samples, failed = [], 0
    for _ in range(n_resamples):
        idx = rng.integers(0, n, size=n)
        if len(np.unique(x[idx])) <= n_free:
            failed += 1
            continue
        r0 = fit.params.r0 + (rng.normal(0.0, r0_sd) if r0_sd > 0 else 0.0)
        start = dataclasses.replace(fit.params, r0=r0)
        p = refine(x[idx], y[idx], start, fit.box, fix_a=fit.a_fixed)
        samples.append((p.a, p.b, p.c_mid, p.r0))
    if not samples:
        raise ValueError(f"every bootstrap resample of the {n} points was degenerate")
    if failed:
        logger.warning("%d of %d bootstrap resamples were degenerate", failed, n_resamples)
    return BootstrapResult(np.array(samples), level, failed)
