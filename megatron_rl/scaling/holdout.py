"""The paper's hold-out protocol: fit a run's curve on the first part of its training
compute, extrapolate to its end with the bootstrap band, and measure the prediction against
the validations the run made after the cut (overall and per domain). No torch.

    megatron-rl fit runs/a/metrics.jsonl --holdout 0.5 --bootstrap 100

``holdout`` is the fraction of the run's compute held out: with x_end the compute of the
run's last validation, points with x <= (1 - holdout) * x_end are fitted (within the usual
``min_x`` filter) and every later validation is predicted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rl.scaling.analysis import RunFit, fit_run
from megatron_rl.scaling.config import FitConfig
from megatron_rl.scaling.data import RunData, domain_fields, load_run


@dataclass
class HoldoutResult:
    """One curve's hold-out test (``field``: ``val_pass_rate`` or ``val_pass_rate/<domain>``).

    ``held_x`` / ``held_y`` [K] are the validations after ``cut``; ``predicted`` [K] the fit
    there and ``band_lo`` / ``band_hi`` [K] its bootstrap band (None without bootstrap).
    """

    field: str
    holdout: float
    cut: float
    x_end: float
    fit: RunFit
    held_x: np.ndarray
    held_y: np.ndarray
    predicted: np.ndarray
    band_lo: np.ndarray | None
    band_hi: np.ndarray | None

    @property
    def errors(self) -> np.ndarray:
        """Prediction minus measurement at each held-out validation [K]."""
        return self.predicted - self.held_y

    @property
    def mean_abs_error(self) -> float:
        return float(np.mean(np.abs(self.errors)))

    @property
    def max_abs_error(self) -> float:
        return float(np.max(np.abs(self.errors)))

    @property
    def final_error(self) -> float:
        """Prediction minus measurement at the run's last validation."""
        return float(self.errors[-1])

    @property
    def coverage(self) -> float | None:
        """Fraction of the held-out validations inside the band (None without a band)."""
        if self.band_lo is None or self.band_hi is None:
            return None
        inside = (self.held_y >= self.band_lo) & (self.held_y <= self.band_hi)
        return float(np.mean(inside))

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the cut, the fit, every held-out point and the error statistics."""
        p = self.fit.fit.params
        band = self.fit.prediction_interval(self.x_end)
        out: dict[str, Any] = {
            "field": self.field,
            "holdout": self.holdout,
            "cut": self.cut,
            "x_end": self.x_end,
            "fit": {"A": p.a, "B": p.b, "C_mid": p.c_mid, "R0": p.r0},
            "n_fitted": self.fit.fit.n_points,
            "prediction_at_end": self.fit.predict(self.x_end),
            "prediction_at_end_interval": list(band) if band else None,
            "measured_at_end": float(self.held_y[-1]),
            "final_error": self.final_error,
            "mean_abs_error": self.mean_abs_error,
            "max_abs_error": self.max_abs_error,
            "coverage": self.coverage,
            "points": [
                {
                    "x": float(x),
                    "measured": float(y),
                    "predicted": float(pr),
                    "band": None if self.band_lo is None else [float(lo), float(hi)],
                }
                for x, y, pr, lo, hi in zip(
                    self.held_x,
                    self.held_y,
                    self.predicted,
                    self.band_lo if self.band_lo is not None else self.held_x,
                    self.band_hi if self.band_hi is not None else self.held_x,
                )
            ],
        }
        return out


def holdout_fit(run: RunData, config: FitConfig, holdout: float) -> HoldoutResult:
    """Fit ``run`` on its compute up to ``(1 - holdout) * x_end`` and predict the rest.

    Raises ValueError naming the run when ``holdout`` is not in (0, 1), when no validation
    lies after the cut, or when too few lie before it to fit (``config.min_points``).
    """
    if not (isinstance(holdout, (int, float)) and 0 < holdout < 1):
        raise ValueError(f"--holdout must be a fraction in (0, 1), got {holdout!r}")
    if config.fit_until is not None:
        raise ValueError("--holdout sets the fit's range itself: drop --fit-until")
    x_end = float(run.x.max())
    cut = (1.0 - holdout) * x_end
    held = run.x > cut
    if not held.any() or x_end <= 0:
        raise ValueError(f"{run.source} ({run.y_field}): no validation after the cut at {cut:g}")
    config = dataclasses.replace(config, fit_until=max(cut, config.min_x))
    run_fit = fit_run(run, config)
    held_x, held_y = run.x[held], run.y[held]
    band = run_fit.bootstrap.band(held_x) if run_fit.bootstrap is not None else (None, None)
    return HoldoutResult(
        field=run.y_field,
        holdout=float(holdout),
        cut=cut,
        x_end=x_end,
        fit=run_fit,
        held_x=held_x,
        held_y=held_y,
        predicted=run_fit.fit.params.predict(held_x),
        band_lo=band[0],
        band_hi=band[1],
    )


@dataclass
class RunHoldout:
    """A run's hold-out test: overall and per domain (``skipped``: domain -> why none)."""

    name: str
    source: str
    overall: HoldoutResult
    domains: dict[str, HoldoutResult]
    skipped: dict[str, str]

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "overall": self.overall.summary(),
            "domains": {d: r.summary() for d, r in self.domains.items()},
            "skipped": dict(self.skipped),
        }


def holdout_metrics(
    path: str | Path, config: FitConfig, holdout: float, name: str | None = None
) -> RunHoldout:
    """:func:`holdout_fit` of a metrics file's ``config.y_field`` and of each of its domains
    (``<y_field>/<domain>``: a mixture of sources). A domain that cannot be tested (too few
    points ...) is listed in ``skipped``; the overall curve raises ValueError."""
    run = load_run(path, config.x_field, config.y_field, name)
    overall = holdout_fit(run, config, holdout)
    domains: dict[str, HoldoutResult] = {}
    skipped: dict[str, str] = {}
    for field in domain_fields(path, config.y_field):
        domain = field.split("/", 1)[1]
        try:
            sub = load_run(path, config.x_field, field, name)
            domains[domain] = holdout_fit(sub, dataclasses.replace(config, y_field=field), holdout)
        except ValueError as err:
            skipped[domain] = str(err)
    return RunHoldout(run.name, run.source, overall, domains, skipped)


def format_holdout(results: list[RunHoldout]) -> str:
    """A readable table: per run and curve, the fit on the first part, the prediction at the
    end with its band, the measurement, and the errors over the held-out validations."""
    lines = []
    for r in results:
        o = r.overall
        lines.append(
            f"{r.name}: fitted on {o.fit.run.x_field} <= {o.cut:.5g} "
            f"({100 * (1 - o.holdout):g}% of {o.x_end:.5g}), predicting {len(o.held_x)} later "
            "validations"
        )
        header = ["curve", "n fit", "A", "B", "C_mid", "R(end) predicted", "measured"]
        header += ["error at end", "mean |error|", "max |error|", "in band"]
        rows = [header]
        for label, res in [("all", o), *r.domains.items()]:
            rows.append(_row(label, res))
        widths = [max(len(row[k]) for row in rows) for k in range(len(header))]
        lines += [
            "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows
        ]
        for domain, why in r.skipped.items():
            lines.append(f"  {domain}: no hold-out test ({why})")
    return "\n".join(lines)


def _row(label: str, res: HoldoutResult) -> list[str]:
    p = res.fit.fit.params
    pred = f"{res.fit.predict(res.x_end):.3f}"
    band = res.fit.prediction_interval(res.x_end)
    if band is not None:
        pred += f" [{band[0]:.3f}, {band[1]:.3f}]"
    coverage = res.coverage
    return [
        label,
        str(res.fit.fit.n_points),
        f"{p.a:.3f}",
        f"{p.b:.2f}",
        f"{p.c_mid:.4g}",
        pred,
        f"{res.held_y[-1]:.3f}",
        f"{res.final_error:+.3f}",
        f"{res.mean_abs_error:.3f}",
        f"{res.max_abs_error:.3f}",
        "-" if coverage is None else f"{round(coverage * len(res.held_x))}/{len(res.held_x)}",
    ]
