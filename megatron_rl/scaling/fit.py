"""Fitting the sigmoid compute curve: the paper's grid search, vectorised, then joint refinement.

Grid search (docs/paper.md section 1): for every (A, C_mid) grid point, B is fitted by least
squares and the grid point with the least squared residual wins. For a fixed (C_mid, B) the
curve is linear in the gain g = A - R0, so the residual of every A is a closed-form quadratic
in g; this scores all (A, C_mid, B) triples on a coarse log-spaced B grid at the cost of the
(C_mid, B) pairs, and a golden-section search in log B between the neighbours of each grid
point's best coarse B then fits B at all grid points at once. The best grid point starts a
bounded ``scipy.optimize.least_squares`` refinement of (A, log B, log C_mid) inside the box.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from megatron_rl.scaling.config import AUTO, FitConfig
from megatron_rl.scaling.model import CurveParams, gain_fraction, log_ratio

logger = logging.getLogger(__name__)

PARAM_NAMES = ("a", "b", "c_mid")
_GOLDEN = (np.sqrt(5.0) - 1.0) / 2.0
_GOLDEN_ITERS = 20
# Elements per temporary array in the vectorised search (8 MB; cache-friendlier than more).
_CHUNK_ELEMS = 1_000_000


@dataclass(frozen=True)
class FitBox:
    """The search box: grids of A and C_mid, and bounds of every parameter."""

    a_grid: np.ndarray  # [nA]
    c_mid_grid: np.ndarray  # [nC]
    b_grid: np.ndarray  # [nB], log-spaced

    def bounds(self) -> dict[str, tuple[float, float]]:
        """(low, high) of a, b and c_mid: the refinement stays inside."""
        return {
            "a": (float(self.a_grid.min()), float(self.a_grid.max())),
            "b": (float(self.b_grid.min()), float(self.b_grid.max())),
            "c_mid": (float(self.c_mid_grid.min()), float(self.c_mid_grid.max())),
        }


@dataclass
class CurveFit:
    """A fitted curve and how it was obtained."""

    params: CurveParams
    sse: float  # sum of squared residuals over the fitted points
    n_points: int
    a_fixed: bool
    at_bound: tuple[str, ...]  # parameters that ended on an edge of the box
    grid_best: CurveParams  # the winning grid point (B fitted), before refinement
    box: FitBox

    @property
    def rmse(self) -> float:
        """Root mean squared residual."""
        return float(np.sqrt(self.sse / self.n_points))


def build_box(
    x: np.ndarray, y: np.ndarray, r0: float, config: FitConfig, x_positive_min: float | None = None
) -> FitBox:
    """Grids for fitted points ``x``, ``y`` [n]; ``x_positive_min``: smallest positive x of the
    whole run (for the automatic C_mid range; default ``x.min()``)."""
    if config.fix_a is not None:
        a_grid = np.array([float(config.fix_a)])
    elif config.a_range == AUTO:
        a_grid = np.linspace(*_auto_a_range(y, r0), 71)
    else:
        low, high = config.a_range
        a_grid = np.arange(round((high - low) / config.a_step) + 1) * config.a_step + low
        a_grid = np.clip(a_grid, low, high)
    if config.c_mid_range == AUTO:
        low = (x_positive_min if x_positive_min is not None else float(x.min())) / 4.0
        c_grid = np.geomspace(low, 4.0 * float(x.max()), config.c_mid_num)
    else:
        low, high = config.c_mid_range
        space = np.linspace if config.c_mid_spacing == "linear" else np.geomspace
        c_grid = space(low, high, config.c_mid_num)
    b_grid = np.geomspace(config.b_range[0], config.b_range[1], config.b_num)
    return FitBox(a_grid, c_grid, b_grid)


def _auto_a_range(y: np.ndarray, r0: float) -> tuple[float, float]:
    top = float(y.max())
    gain = top - r0
    if gain <= 0:
        raise ValueError(
            f"automatic A range needs a rising curve, but no fitted y exceeds R0 = {r0:.4g}; "
            "give an explicit A range"
        )
    low, high = r0 + 0.5 * gain, top + gain
    if float(y.min()) >= 0.0 and top <= 1.0 and r0 >= 0.0:
        low, high = max(low, 0.0), min(high, 1.0)
    return low, high


def grid_search(x: np.ndarray, y: np.ndarray, r0: float, box: FitBox) -> tuple[CurveParams, float]:
    """Best grid point (B fitted at each) and its squared residual; ``x``, ``y``: [n], x > 0."""
    d = y - r0  # [n]
    gains = box.a_grid - r0  # [nA]
    log_r = log_ratio(box.c_mid_grid[:, None], x[None, :])  # [nC, n]
    coarse_k = _coarse_b_index(d, gains, log_r, box.b_grid)  # [nA, nC]
    log_b = np.log(box.b_grid)
    lo = log_b[np.maximum(coarse_k - 1, 0)]
    hi = log_b[np.minimum(coarse_k + 1, len(log_b) - 1)]
    best_log_b, best_sse = _golden_log_b(d, gains, log_r, lo, hi)  # [nA, nC] each
    coarse_sse = _sse_at(d, gains, log_r, log_b[coarse_k])
    use_coarse = coarse_sse < best_sse
    best_log_b = np.where(use_coarse, log_b[coarse_k], best_log_b)
    best_sse = np.minimum(coarse_sse, best_sse)
    i, j = np.unravel_index(int(np.argmin(best_sse)), best_sse.shape)
    params = CurveParams(
        a=float(box.a_grid[i]),
        b=float(np.exp(best_log_b[i, j])),
        c_mid=float(box.c_mid_grid[j]),
        r0=r0,
    )
    return params, float(best_sse[i, j])


def _coarse_b_index(
    d: np.ndarray, gains: np.ndarray, log_r: np.ndarray, b_grid: np.ndarray
) -> np.ndarray:
    """argmin over the B grid of the residual at every (A, C_mid): [nA, nC] indices.

    For fixed (C_mid, B) with s = gain_fraction: sse(g) = d.d - 2 g s.d + g^2 s.s.
    """
    n_c, n = log_r.shape
    out = np.empty((len(gains), n_c), dtype=np.int64)
    step = max(1, _CHUNK_ELEMS // (len(b_grid) * n))
    for start in range(0, n_c, step):
        s = gain_fraction(b_grid[None, :, None], log_r[start : start + step, None, :])
        sd = s @ d  # [c, nB]
        ss = np.einsum("cbn,cbn->cb", s, s)
        sse = -2.0 * gains[:, None, None] * sd[None] + (gains**2)[:, None, None] * ss[None]
        out[:, start : start + step] = np.argmin(sse, axis=2)
    return out


def _sse_at(d: np.ndarray, gains: np.ndarray, log_r: np.ndarray, log_b: np.ndarray) -> np.ndarray:
    """Squared residual at every (A, C_mid) with its own B = exp(log_b) [nA, nC]: [nA, nC].

    Hot loop of the grid search: computed in place in one reused buffer per chunk of A.
    """
    n_a, n_c = log_b.shape
    n = log_r.shape[1]
    out = np.empty((n_a, n_c))
    step = max(1, _CHUNK_ELEMS // (n_c * n))
    buf = np.empty((min(step, n_a), n_c, n))
    b_all = np.exp(log_b)
    for start in range(0, n_a, step):
        stop = min(start + step, n_a)
        t = buf[: stop - start]
        np.multiply(b_all[start:stop, :, None], log_r[None], out=t)
        with np.errstate(over="ignore"):
            np.exp(t, out=t)
        t += 1.0
        np.reciprocal(t, out=t)  # gain fraction s
        t *= -gains[start:stop, None, None]
        t += d  # residual d - g s
        out[start:stop] = np.einsum("acn,acn->ac", t, t)
    return out


def _golden_log_b(
    d: np.ndarray, gains: np.ndarray, log_r: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Golden-section minimisation in log B over [lo, hi] ([nA, nC] each), all at once."""
    lo, hi = lo.copy(), hi.copy()
    x1 = hi - _GOLDEN * (hi - lo)
    x2 = lo + _GOLDEN * (hi - lo)
    f1, f2 = _sse_at(d, gains, log_r, x1), _sse_at(d, gains, log_r, x2)
    for _ in range(_GOLDEN_ITERS):
        left = f1 < f2  # minimum in [lo, x2]: drop (x2, hi]
        hi = np.where(left, x2, hi)
        lo = np.where(left, lo, x1)
        new = np.where(left, hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo))
        f_new = _sse_at(d, gains, log_r, new)
        x2, f2, x1, f1 = (
            np.where(left, x1, new),
            np.where(left, f1, f_new),
            np.where(left, new, x2),
            np.where(left, f_new, f2),
        )
    better1 = f1 < f2
    return np.where(better1, x1, x2), np.where(better1, f1, f2)


def refine(
    x: np.ndarray, y: np.ndarray, start: CurveParams, box: FitBox, fix_a: bool
) -> CurveParams:
    """Least-squares refinement of (A, log B, log C_mid) from ``start`` inside ``box``.

    Parameters whose box is a single value (and A when ``fix_a``) stay fixed.
    """
    bounds = box.bounds()
    lows = np.array([bounds["a"][0], np.log(bounds["b"][0]), np.log(bounds["c_mid"][0])])
    highs = np.array([bounds["a"][1], np.log(bounds["b"][1]), np.log(bounds["c_mid"][1])])
    theta0 = np.array([start.a, np.log(start.b), np.log(start.c_mid)])
    free = highs > lows
    if fix_a:
        free[0] = False
    if not free.any():
        return start
    r0 = start.r0

    def unpack(sub: np.ndarray) -> np.ndarray:
        theta = theta0.copy()
        theta[free] = sub
        return theta

    def residual(sub: np.ndarray) -> np.ndarray:
        a, log_b, log_c = unpack(sub)
        s = gain_fraction(np.exp(log_b), log_c - np.log(x))
        return r0 + (a - r0) * s - y

    def jacobian(sub: np.ndarray) -> np.ndarray:
        a, log_b, log_c = unpack(sub)
        b = np.exp(log_b)
        log_r = log_c - np.log(x)
        s = gain_fraction(b, log_r)
        ds = -(a - r0) * s * (1.0 - s) * b  # d R / d log C_mid
        return np.stack([s, ds * log_r, ds], axis=1)[:, free]

    x0 = np.clip(theta0, lows, highs)[free]
    result = least_squares(
        residual,
        x0,
        jac=jacobian,
        bounds=(lows[free], highs[free]),
        method="trf",
        x_scale=np.array([0.05, 0.2, 0.2])[free],
        xtol=1e-10,
        ftol=1e-12,
        gtol=1e-12,
    )
    a, log_b, log_c = unpack(result.x)
    return CurveParams(a=float(a), b=float(np.exp(log_b)), c_mid=float(np.exp(log_c)), r0=r0)


def sse_of(params: CurveParams, x: np.ndarray, y: np.ndarray) -> float:
    """Sum of squared residuals of ``params`` on points ``x``, ``y`` [n]."""
    r = params.predict(x) - y
    return float(r @ r)


def fit_points(
    x: np.ndarray,
    y: np.ndarray,
    r0: float,
    config: FitConfig,
    x_positive_min: float | None = None,
) -> CurveFit:
    """Fit the curve to points ``x``, ``y`` [n] (already filtered; x > 0) with R0 = ``r0``."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    assert x.shape == y.shape and x.ndim == 1
    if len(x) < config.min_points:
        raise ValueError(f"too few points to fit: {len(x)} < min_points {config.min_points}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.isfinite(r0)):
        raise ValueError("x, y and R0 must be finite (NaN or inf found)")
    if np.any(x <= 0):
        raise ValueError("fitted compute values must be > 0")
    box = build_box(x, y, r0, config, x_positive_min)
    grid_best, grid_sse = grid_search(x, y, r0, box)
    params, sse = grid_best, grid_sse
    if config.refine:
        refined = refine(x, y, grid_best, box, fix_a=config.fix_a is not None)
        refined_sse = sse_of(refined, x, y)
        if refined_sse <= grid_sse:
            params, sse = refined, refined_sse
    at_bound = _at_bound(params, box, config.fix_a is not None)
    if at_bound:
        logger.warning(
            "fit ended on the edge of the search box for %s (box %s); widen the range",
            ", ".join(at_bound),
            {k: box.bounds()[k] for k in at_bound},
        )
    return CurveFit(params, sse, len(x), config.fix_a is not None, at_bound, grid_best, box)


def _at_bound(params: CurveParams, box: FitBox, a_fixed: bool) -> tuple[str, ...]:
    edges = []
    for name, (low, high) in box.bounds().items():
        if high <= low or (name == "a" and a_fixed):
            continue
        value = getattr(params, name)
        if name != "a":
            value, low, high = np.log(value), np.log(low), np.log(high)
        if min(value - low, high - value) <= 1e-6 * (high - low):
            edges.append(name)
    return tuple(edges)
