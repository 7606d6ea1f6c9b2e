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

What is compared. The spec's ``rank_by``: ``target`` (the default) compares and ranks the
fitted pass rate at the target budget with its bootstrap band; ``asymptote``, the paper's
Section 4 reading, compares A (ranking neighbours within 0.02 of each other by B). At a target
far past every C_mid the two agree (R(target) is about A); at a nearer target a fast variant
with a lower ceiling can be the better recipe for that budget, and ranking by A would then
contradict what running every variant to the target shows.

A variant that does not learn. A curve that never rises above its first validation has no fit
(the sigmoid needs a gain) and so no interval: it is stopped once the leader is comparable and
the variant has made ``points_past_c_mid`` validations past the upper end of the leader's
C_mid interval without any rising above its start: where the leader had gained most of its
way to A, it had gained nothing (a learning rate that diverges, a reward that pays nothing).
One that falls is stopped sooner, without waiting for any C_mid: once its last
``points_past_c_mid`` validations all lie more than ``a_margin`` below its first while another
variant's fitted interval lies wholly above that first value by the margin (the CPU proof's
learning rate of 3e-4 fell from 0.105 to 0.02 within 0.01 CPU-hours and never came back). A
curve that only hesitates (a small learning rate near its start) is not below it by the margin.
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
    points: tuple[list[float], list[float]] | None = None  # its validations (x, y) so far

    def a_interval(self) -> tuple[float, float] | None:
        if self.fit is None or self.fit.bootstrap is None:
            return None
        return self.fit.bootstrap.interval("a")

    def c_mid_high(self) -> float:
        """The upper end of C_mid's interval (its value without one); needs a fit."""
        assert self.fit is not None
        if self.fit.bootstrap is not None:
            return self.fit.bootstrap.interval("c_mid")[1]
        return self.fit.fit.params.c_mid

    def points_past_c_mid(self) -> int:
        """Fitted validations past the upper end of C_mid's interval."""
        if self.fit is None:
            return 0
        x = self.fit.run.x[self.fit.fitted]
        return int((x > self.c_mid_high()).sum())

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
        run = load_run(metrics, name=name, growing=True)
        result.points = ([float(x) for x in run.x], [float(y) for y in run.y])
        result.fit = fit_run(run, config.fit_config())
    except ValueError as err:  # too few points so far, a flat curve ...
        result.why = str(err)
    return result


def score(r: VariantResult, target: float, rank_by: str) -> float:
    """What the tournament ranks by (module docstring): R(target) or A."""
    assert r.fit is not None
    return r.fit.predict(target) if rank_by == "target" else r.fit.fit.params.a


def score_interval(r: VariantResult, target: float, rank_by: str) -> tuple[float, float] | None:
    """The bootstrap interval of ``score`` (None without a bootstrap)."""
    if rank_by == "asymptote":
        return r.a_interval()
    return r.fit.prediction_interval(target) if r.fit is not None else None


def not_learning(r: VariantResult, leader: VariantResult, rule: EarlyStopConfig) -> bool:
    """No fit because no validation rose above the first, after ``points_past_c_mid``
    validations past the upper end of the leader's C_mid interval (module docstring)."""
    if r.fit is not None or r.points is None or leader.fit is None:
        return False
    xs, ys = r.points
    c_mid = leader.c_mid_high()
    past = sum(x > c_mid for x in xs)
    return len(ys) > 1 and max(ys[1:]) <= ys[0] and past >= rule.points_past_c_mid


def diverged(
    r: VariantResult,
    results: list[VariantResult],
    rule: EarlyStopConfig,
    target: float,
    rank_by: str,
) -> str | None:
    """Why ``r`` has fallen (module docstring): no fit, its last ``points_past_c_mid``
    validations all more than ``a_margin`` below its first, while another variant's fitted
    interval lies wholly above that first value by the margin. None otherwise."""
    if r.fit is not None or r.points is None:
        return None
    ys, k, margin = r.points[1], rule.points_past_c_mid, rule.a_margin
    if len(ys) <= k or not all(y < ys[0] - margin for y in ys[-k:]):
        return None
    for other in results:
        band = score_interval(other, target, rank_by) if other.fit is not None else None
        if other is not r and band is not None and band[0] > ys[0] + margin:
            return (
                f"its last {k} validations ({', '.join(f'{y:.3f}' for y in ys[-k:])}) lie more "
                f"than {margin:g} below its first ({ys[0]:.3f}), while {other.name}'s interval "
                f"starts at {band[0]:.3f}, at {r.spent:.4g} GPU-hours"
            )
    return None


def early_stops(
    results: list[VariantResult], rule: EarlyStopConfig, target: float, rank_by: str = "target"
) -> dict[str, str]:
    """Variants (running ones: stopping a finished run saves nothing) to stop now, with why
    (module docstring). Empty when fewer than two variants are comparable, or when no
    variant is comparable and none fails to learn."""
    if not rule.enabled:
        return {}
    out = {}
    for r in results:
        why = diverged(r, results, rule, target, rank_by) if r.status == RUNNING else None
        if why is not None:
            out[r.name] = why
    ready = [r for r in results if r.comparable(rule)]
    if not ready:
        return out
    what = f"R({target:.4g})" if rank_by == "target" else "A"
    leader = max(ready, key=lambda r: score_interval(r, target, rank_by)[0])  # type: ignore[index]
    low_leader = score_interval(leader, target, rank_by)[0]  # type: ignore[index]
    for r in results:
        if r is leader or r.status != RUNNING or r.name in out:
            continue
        if not_learning(r, leader, rule):
            out[r.name] = (
                f"no validation above its first ({r.points[1][0]:.3f}) after "  # type: ignore[index]
                f"{rule.points_past_c_mid} past {leader.name}'s C_mid, at {r.spent:.4g} GPU-hours"
            )
            continue
        if r not in ready:
            continue
        low, high = score_interval(r, target, rank_by)  # type: ignore[misc]
        if high < low_leader - rule.a_margin:
            out[r.name] = (
                f"{what} {score(r, target, rank_by):.3f} [{low:.3f}, {high:.3f}] is more than "
                f"{rule.a_margin:g} below the lower end {low_leader:.3f} of {leader.name}'s, "
                f"at {r.spent:.4g} GPU-hours"
            )
    return out


def ranking(
    results: list[VariantResult],
    target: float,
    rank_by: str = "target",
    a_tolerance: float = PAPER_A_TOLERANCE,
) -> list:
    """Variants best first (module docstring): by R(target), or by A where neighbours
    within ``a_tolerance`` (the paper's rule) go by B (the faster one first). Variants
    without a fit come last."""
    fitted = sorted(
        (r for r in results if r.fit is not None), key=lambda r: -score(r, target, rank_by)
    )
    changed = rank_by == "asymptote"
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
    results: list[VariantResult],
    target: float,
    budget: float,
    a_tolerance: float = PAPER_A_TOLERANCE,
    rank_by: str = "target",
) -> str:
    """The ranking table (A, B, C_mid with intervals; compute spent; R at the target; status)
    and the compute spent: against every variant run to its budget (what early stopping
    saved) and, for a target beyond the budget, to the target."""
    header = ["rank", "variant", "A", "B", "C_mid", "GPU-h spent", f"R({target:.4g})", "status"]
    rows = [header]
    for k, r in enumerate(ranking(results, target, rank_by, a_tolerance), start=1):
        if r.fit is None:  # last: no fit yet, or a curve that never rose
            rows.append([str(k), r.name, "-", "-", "-", f"{r.spent:.4g}", "-", _status(r)])
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
    if target > budget:
        full = target * len(results)
        lines.append(
            f"against running every variant to the target ({target:.4g} each): "
            f"{100 * s.spent / full:.0f}% of {full:.4g}"
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
