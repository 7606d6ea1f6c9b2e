"""Readable table and JSON summary of fits and comparisons."""

from __future__ import annotations

from typing import Any

from megatron_rl.scaling.analysis import Comparison, RunFit

_KEYS = {"a": "A", "b": "B", "c_mid": "C_mid"}


def fit_summary(run_fit: RunFit, extrapolate_to: float | None) -> dict[str, Any]:
    """JSON-ready summary of one fit (parameters, residual, intervals, prediction)."""
    fit, boot = run_fit.fit, run_fit.bootstrap
    p = fit.params
    out: dict[str, Any] = {
        "A": p.a,
        "B": p.b,
        "C_mid": p.c_mid,
        "R0": p.r0,
        "residual": fit.sse,
        "rmse": fit.rmse,
        "n_points": fit.n_points,
        "a_fixed": fit.a_fixed,
        "at_bound": [_KEYS[k] for k in fit.at_bound],
        "fit_x_range": [
            float(run_fit.run.x[run_fit.fitted].min()),
            float(run_fit.run.x[run_fit.fitted].max()),
        ],
        "search_box": {_KEYS[k]: list(v) for k, v in fit.box.bounds().items()},
        "intervals": None,
        "ci": None,
        "bootstrap": None,
    }
    if boot is not None:
        out["intervals"] = {_KEYS[k]: list(v) for k, v in boot.intervals().items()}
        out["ci"] = boot.level
        out["bootstrap"] = {"resamples": len(boot.samples) + boot.n_failed, "failed": boot.n_failed}
    if extrapolate_to is not None:
        out["extrapolate_to"] = extrapolate_to
        out["prediction"] = run_fit.predict(extrapolate_to)
        interval = run_fit.prediction_interval(extrapolate_to)
        out["prediction_interval"] = list(interval) if interval else None
    return out


def comparison_summary(
    comparison: Comparison, extrapolate_to: float | None, a_tolerance: float
) -> dict[str, Any]:
    """JSON-ready summary of every run and, with several runs, of the comparison."""
    runs = [
        {
            "name": f.name,
            "source": f.run.source,
            "x_field": f.run.x_field,
            "y_field": f.run.y_field,
            "n_records": len(f.run.x),
            "fit": fit_summary(f, extrapolate_to),
        }
        for f in comparison.fits
    ]
    out: dict[str, Any] = {"runs": runs}
    if comparison.rule != "single":
        refits = comparison.refits
        out["comparison"] = {
            "rule": comparison.rule,
            "a_spread": comparison.a_spread,
            "a_tolerance": a_tolerance,
            "a_common": comparison.a_common,
            "refits": [fit_summary(f, extrapolate_to) for f in refits] if refits else None,
            "ranking": [comparison.fits[i].name for i in comparison.ranking],
        }
    return out


def _value(v: float, interval: tuple[float, float] | None, fmt: str) -> str:
    text = format(v, fmt)
    if interval is not None:
        text += f" [{format(interval[0], fmt)}, {format(interval[1], fmt)}]"
    return text


def _row(f: RunFit, extrapolate_to: float | None) -> list[str]:
    p, boot = f.fit.params, f.bootstrap
    iv = boot.intervals() if boot is not None else {}
    a_text = f"{p.a:.4f} (fixed)" if f.fit.a_fixed else _value(p.a, iv.get("a"), ".4f")
    row = [
        f.name,
        str(f.fit.n_points),
        f"{p.r0:.4f}",
        a_text,
        _value(p.b, iv.get("b"), ".3f"),
        _value(p.c_mid, iv.get("c_mid"), ".4g"),
        f"{f.fit.rmse:.4f}",
    ]
    if extrapolate_to is not None:
        row.append(_value(f.predict(extrapolate_to), f.prediction_interval(extrapolate_to), ".4f"))
    if f.fit.at_bound:
        row[-1] += "  (edge: " + ", ".join(_KEYS[k] for k in f.fit.at_bound) + ")"
    return row


def _table(fits: list[RunFit], extrapolate_to: float | None) -> list[str]:
    header = ["run", "n", "R0", "A", "B", "C_mid", "rmse"]
    if extrapolate_to is not None:
        header.append(f"R({extrapolate_to:g})")
    rows = [header] + [_row(f, extrapolate_to) for f in fits]
    widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def format_report(comparison: Comparison, extrapolate_to: float | None, a_tolerance: float) -> str:
    """A readable table of every fit, and the comparison of several runs."""
    fits = comparison.fits
    level = next((f.bootstrap.level for f in fits if f.bootstrap is not None), None)
    lines = [f"R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B), C = {fits[0].run.x_field}"]
    if level is not None:
        lines.append(f"[low, high]: {100 * level:g}% bootstrap intervals")
    lines += _table(fits, extrapolate_to)
    if comparison.rule == "by_a":
        lines += [
            "",
            f"A values differ by {comparison.a_spread:.4f} > {a_tolerance:g}: ranked by A",
        ]
    elif comparison.rule == "fixed_a":
        lines += [
            "",
            f"A values lie within {a_tolerance:g} (spread {comparison.a_spread:.4f}): refitted "
            f"with A fixed at their mean {comparison.a_common:.4f}, ranked by B",
        ]
        lines += _table(comparison.refits or [], extrapolate_to)
    if comparison.rule != "single":
        lines.append("ranking: " + " > ".join(fits[i].name for i in comparison.ranking))
    return "\n".join(lines)
