"""A run's metrics file as the scaling tools read it, and its reward curve (no torch import).

``RUN_DIR/metrics.jsonl`` holds one JSON object per record (written by the trainer's
:class:`~megatron_rl.trainer.metrics.MetricsLogger`); every record carries ``step`` and
``gpu_hours``, training records ``reward_mean``, validation records ``val_pass_rate``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl.scaling.forecast import Forecast

METRICS_FILE = "metrics.jsonl"


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The complete records of a metrics file (a torn last line is ignored)."""
    records = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            records.append(json.loads(line))
    return records


def _series(records: Iterable[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get(x) is not None and r.get(y) is not None:
            xs.append(float(r[x]))
            ys.append(float(r[y]))
    return xs, ys


def plot_reward_curve(
    metrics_path: str | Path,
    out_png: str | Path,
    keys: tuple[str, ...] = ("reward_mean", "val_pass_rate"),
    title: str | None = None,
    forecast: Forecast | None = None,
    domain_forecasts: Mapping[str, Forecast] | None = None,
) -> Path:
    """Plot ``keys`` against ``step`` (left) and ``gpu_hours`` (right) to a PNG.

    Per-domain series of a key (``val_pass_rate/math``, ``val_pass_rate/code`` ...: a
    math+code run) are drawn too, one line per domain, after their key.

    With a ``forecast`` (of ``val_pass_rate``) the right panel also shows the fitted curve
    (solid over the fitted points, dashed beyond), its bootstrap band extrapolated to the
    budget, and the predicted pass rate there; ``domain_forecasts`` (domain -> forecast of
    ``val_pass_rate/<domain>``) add the same per domain, in the colour of its line. The PNG
    is replaced atomically (a reader never sees half a file).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics_path)
    keys = _with_domains(keys, records)
    if not any(r.get(k) is not None for r in records for k in keys):
        raise ValueError(f"{metrics_path}: no records with any of {list(keys)}")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for ax, x in zip(axes, ("step", "gpu_hours")):
        colors = {}
        for key in keys:
            xs, ys = _series(records, x, key)
            if xs:
                (line,) = ax.plot(xs, ys, marker="o" if len(xs) < 50 else None, ms=3, label=key)
                colors[key] = line.get_color()
        if x == "gpu_hours" and forecast is not None:
            _draw_forecast(ax, forecast)
        for domain, f in (domain_forecasts or {}).items() if x == "gpu_hours" else ():
            _draw_forecast(ax, f, colors.get(f"val_pass_rate/{domain}", "0.3"), domain)
        ax.set_xlabel(x if x == "step" else "gpu_hours (training)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or Path(metrics_path).parent.name)
    out_png = Path(out_png)
    tmp = out_png.with_name(f".{out_png.name}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png


def _with_domains(keys: tuple[str, ...], records: list[dict[str, Any]]) -> tuple[str, ...]:
    """``keys``, each followed by its per-domain keys (``key/<domain>``) seen in records."""
    seen = dict.fromkeys(k for r in records for k in r)
    out: list[str] = []
    for key in keys:
        out.append(key)
        out += [k for k in seen if k.startswith(f"{key}/") and k not in keys]
    return tuple(out)


def _draw_forecast(ax: Any, forecast: Forecast, color: str = "C3", domain: str = "") -> None:
    """The forecast on the gpu_hours axis: fit, band to the budget, prediction there (a
    ``domain``'s: labelled with it, without the budget line and unfitted points again)."""
    f, tag = forecast, f" {domain}" if domain else ""
    x, y = f.curve_x, f.curve_y
    inside = x <= f.x_last
    ax.plot(x[inside], y[inside], "-", color=color, lw=2, label=f"fit{tag} (forecast)")
    ax.plot(x[~inside], y[~inside], "--", color=color, lw=1.5, label=f"extrapolation{tag}")
    if f.band_lo is not None and f.band_hi is not None:
        ax.fill_between(x, f.band_lo, f.band_hi, color=color, alpha=0.2, lw=0, label=f"band{tag}")
    if domain:
        ax.plot([f.budget], [f.pass_rate_at_budget], "*", color=color, ms=10,
                label=f"R{tag}(budget) = {f.pass_rate_at_budget:.3f}")  # fmt: skip
        return
    unused = ~f.fitted
    if unused.any():
        ax.plot(f.points_x[unused], f.points_y[unused], "o", mfc="none", color="0.4", ms=4,
                label="not fitted (< min x)")  # fmt: skip
    ax.axvline(f.budget, color="0.4", ls=":", lw=1)
    ax.plot([f.budget], [f.pass_rate_at_budget], "*", color=color, ms=10,
            label=f"R(budget) = {f.pass_rate_at_budget:.3f}")  # fmt: skip
