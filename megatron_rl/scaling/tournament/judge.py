"""Judging a tournament from its variants' validations: fits with bootstrap intervals (the
live forecast's), the early-stop rule, the ranking table, the plot and the compute saved.
Pure functions of metrics files and fits: no processes, no torch.

The early-stop rule. A variant is stopped when the upper end of its A interval lies more than
``a_margin`` (0.02) below the lower end of the leader's (the leader: the variant with the
highest lower end of A), once
both have at least ``points_past_c_mid`` fitted validations past the upper end of their
C_mid interval, and neither fit has A on the edge of its grid. Why past C_mid: the paper's
fits need points beyond the midpoint. Before it R(C) is near-linear; any A above the points
fits them about as well, and A's bootstrap interval reflects the grid, not the run. After
it the curve has bent towards A, and the intervals mean what they say. Compared at their
own C_mid, not at equal compute: a variant that bends early is judged early. Why the
margin: the bootstrap resamples one run's points; it does not see how A moves between
seeds (the paper: +-0.015 over three runs of the same recipe, hence its 0.02 tolerance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.scaling.analysis import RunFit, fit_run
from megatron_rl.scaling.config import PAPER_A_TOLERANCE, ForecastConfig
from megatron_rl.scaling.data import load_run
from megatron_rl.scaling.records import read_records
from megatron_rl.scaling.tournament.spec import EarlyStopConfig

# A variant's status in the tournament's state (tournament.json)
PENDING, RUNNING, FINISHED, STOPPED, FAILED = "pending", "running", "finished", "stopped", "failed"


@dataclass
class VariantResult:
    """What the judge knows of one variant: its fit (None: none yet, ``why``), the training
    compute it spent (its last record's ``gpu_hours``) and its status."""

    name: str
    status: str
    spent: float
    fit: RunFit | None = None
    why: str = ""
    stopped_at: float | None = None  # compute when stopped early

    def a_interval(self) -> tuple[float, float] | None:
        if self.fit is None or self.fit.bootstrap is None:
            return None
        return self.fit.bootstrap.interval("a")

    def points_past_c_mid(self) -> int:
        """Fitted validations past the upper end of C_mid's interval (its value without one)."""
        if self.fit is None:
            return 0
        c_mid = self.fit.fit.params.c_mid
        if self.fit.bootstrap is not None:
            c_mid = self.fit.bootstrap.interval("c_mid")[1]
        x = self.fit.run.x[self.fit.fitted]
        return int((x > c_mid).sum())

    def comparable(self, rule: EarlyStopConfig) -> bool:
        """Whether the rule may compare this variant (module docstring)."""
        return (
            self.a_interval() is not None
            and "a" not in self.fit.fit.at_bound  # type: ignore[union-attr]
            and self.points_past_c_mid() >= rule.points_past_c_mid
        )


def spent_gpu_hours(metrics: Path) -> float:
    """The training compute of a run so far: its last record's ``gpu_hours`` (0: none)."""
    if not metrics.is_file():
        return 0.0
    spent = 0.0
    for record in read_records(metrics):
        value = record.get("gpu_hours")
        if isinstance(value, (int, float)) and math.isfinite(value):
            spent = float(value)
    return spent


def finished(metrics: Path) -> bool:
    """Whether the run ended normally (its ``run_finished`` record)."""
    return metrics.is_file() and any(r.get("run_finished") for r in read_records(metrics))


def fit_variant(name: str, metrics: Path, status: str, config: ForecastConfig) -> VariantResult:
    """The variant's fit of its validations so far (the live forecast's settings)."""
    result = VariantResult(name, status, spent_gpu_hours(metrics))
    if not metrics.is_file():
        result.why = "no metrics yet"
        return result
    try:
        result.fit = fit_run(load_run(metrics, name=name, growing=True), config.fit_config())
    except ValueError as err:  # too few points so far, a flat curve ...
        result.why = str(err)
    return result


def early_stops(results: list[VariantResult], rule: EarlyStopConfig) -> dict[str, str]:
    """Variants (running ones: stopping a finished run saves nothing) to stop now, with why
    (module docstring). Empty when fewer than two variants are comparable."""
    if not rule.enabled:
        return {}
    ready = [r for r in results if r.comparable(rule)]
    if len(ready) < 2:
        return {}
    leader = max(ready, key=lambda r: r.a_interval()[0])  # type: ignore[index]
    a_low = leader.a_interval()[0]  # type: ignore[index]
    out = {}
    for r in ready:
        if r is leader or r.status != RUNNING:
            continue
        low, high = r.a_interval()  # type: ignore[misc]
        if high < a_low - rule.a_margin:
            out[r.name] = (
                f"A {r.fit.fit.params.a:.3f} [{low:.3f}, {high:.3f}] is more than "
                f"{rule.a_margin:g} below the lower end {a_low:.3f} of {leader.name}'s A, "
                f"at {r.spent:.4g} GPU-hours"
            )
    return out


def ranking(results: list[VariantResult], a_tolerance: float = PAPER_A_TOLERANCE) -> list:
    """Variants best first: by A; where two neighbours' A lie within ``a_tolerance`` (the
    paper's rule), by B (the faster one first). Variants without a fit come last."""
    fitted = sorted((r for r in results if r.fit is not None), key=lambda r: -r.fit.fit.params.a)
    changed = True
    while changed:  # order neighbours with about equal A by B
        changed = False
        for k in range(len(fitted) - 1):
            one, two = fitted[k].fit.fit.params, fitted[k + 1].fit.fit.params
            if abs(one.a - two.a) <= a_tolerance and two.b > one.b + 1e-12:
                fitted[k], fitted[k + 1] = fitted[k + 1], fitted[k]
                changed = True
    return fitted + [r for r in results if r.fit is None]


@dataclass
class Savings:
    """Compute of the tournament against running every variant to its budget."""

    spent: float  # training GPU-hours spent by all variants
    full: float  # every variant to its budget
    saved: float  # by the variants stopped early: budget - spent

    @property
    def fraction_spent(self) -> float:
        return self.spent / self.full if self.full > 0 else float("nan")


def savings(results: list[VariantResult], budget: float) -> Savings:
    spent = sum(min(r.spent, budget) for r in results)
    saved = sum(budget - min(r.spent, budget) for r in results if r.status == STOPPED)
    return Savings(spent, budget * len(results), saved)


def format_table(
    results: list[VariantResult], target: float, budget: float, a_tolerance: float
) -> str:
    """The ranking table (A, B, C_mid with intervals; compute spent; R at the target; status)
    and the compute early stopping saved."""
    header = ["rank", "variant", "A", "B", "C_mid", "GPU-h spent", f"R({target:.4g})", "status"]
    rows = [header]
    for k, r in enumerate(ranking(results, a_tolerance), start=1):
        if r.fit is None:
            rows.append(["-", r.name, "-", "-", "-", f"{r.spent:.4g}", "-", _status(r)])
            continue
        p, boot = r.fit.fit.params, r.fit.bootstrap
        iv = boot.intervals() if boot is not None else {}
        band = r.fit.prediction_interval(target)
        rows.append(
            [
                str(k),
                r.name,
                _value(p.a, iv.get("a"), ".3f"),
                _value(p.b, iv.get("b"), ".2f"),
                _value(p.c_mid, iv.get("c_mid"), ".3g"),
                f"{r.spent:.4g}",
                _value(r.fit.predict(target), band, ".3f"),
                _status(r),
            ]
        )
    widths = [max(len(row[k]) for row in rows) for k in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    s = savings(results, budget)
    lines.append(
        f"compute: {s.spent:.4g} of {s.full:.4g} training GPU-hours "
        f"({100 * s.fraction_spent:.0f}% of running every variant to its budget); "
        f"early stopping saved {s.saved:.4g}"
    )
    for r in results:
        if r.fit is None and r.why:
            lines.append(f"{r.name}: no fit ({r.why})")
    return "\n".join(lines)


def _status(r: VariantResult) -> str:
    if r.status == STOPPED and r.stopped_at is not None:
        return f"stopped early at {r.stopped_at:.4g}"
    return r.status


def _value(v: float, interval: tuple[float, float] | None, fmt: str) -> str:
    text = format(v, fmt)
    if interval is not None:
        text += f" [{format(interval[0], fmt)}, {format(interval[1], fmt)}]"
    return text


def plot(results: list[VariantResult], png: Path, target: float, title: str) -> Path | None:
    """Every fitted variant's points, fit and band on one plot, extrapolated to ``target``."""
    from megatron_rl.scaling.plot import plot_runs

    fits = [r.fit for r in results if r.fit is not None]
    if not fits:
        return None
    return plot_runs(fits, png, target, title=title)
