"""Plots of fitted compute curves (matplotlib, Agg canvas; no pyplot global state)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megatron_rl.scaling.analysis import RunFit

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_GREY = "0.35"


def _curve_x(fits: list[RunFit], extrapolate_to: float | None, logx: bool) -> np.ndarray:
    """Shared x grid [M] covering every run's points and the extrapolation target."""
    x_max = max(float(f.run.x.max()) for f in fits)
    if extrapolate_to is not None:
        x_max = max(x_max, extrapolate_to)
    if logx:
        x_min = min(float(f.run.x[f.run.x > 0].min()) for f in fits)
        return np.geomspace(x_min, x_max, 400)
    return np.linspace(0.0, x_max, 400)


def plot_runs(
    fits: list[RunFit],
    path: str | Path,
    extrapolate_to: float | None = None,
    logx: bool = False,
    title: str | None = None,
) -> Path:
    """Draw every run on one plot and save a PNG at ``path``.

    Per run (one colour each): fitted points filled, held-out points hollow, the fitted curve
    solid over the fitted range and dashed outside it (extrapolation), the bootstrap band
    (if any) shaded, and the asymptote A as a dotted line.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not fits:
        raise ValueError("nothing to plot")
    path = Path(path)
    fig = Figure(figsize=(9, 6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = _curve_x(fits, extrapolate_to, logx)
    colors = [f"C{k % 10}" for k in range(len(fits))]
    for f, color in zip(fits, colors):
        _draw_run(ax, f, xs, color)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(fits[0].run.x_field)
    ax.set_ylabel(fits[0].run.y_field)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)")
    style = _mark_fit_ends_and_style_legend(ax, fits)
    runs_legend = ax.legend(loc="lower right", fontsize=8, title="runs")
    ax.add_artist(runs_legend)
    ax.legend(handles=style, loc="center right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _mark_fit_ends_and_style_legend(ax: Axes, fits: list[RunFit]) -> list:
    """Vertical lines where fitted points end (before held-out ones); legend entries of styles."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    style = [
        Line2D([], [], color=_GREY, marker="o", linestyle="", label="fitted points"),
        Line2D([], [], color=_GREY, marker="o", markerfacecolor="none", linestyle="",
               label="held-out points"),
        Line2D([], [], color=_GREY, linestyle="--", label="extrapolation"),
        Line2D([], [], color=_GREY, linestyle=":", label="asymptote A"),
    ]  # fmt: skip
    ends = set()
    for f in fits:
        end = float(f.run.x[f.fitted].max())
        if np.any(f.run.x[~f.fitted] > end):
            ends.add(end)
    for end in sorted(ends):
        ax.axvline(end, color=_GREY, linestyle="-.", linewidth=0.8, alpha=0.6)
    if ends:
        style.append(Line2D([], [], color=_GREY, linestyle="-.", linewidth=0.8,
                            label="end of fitted points"))  # fmt: skip
    boots = [f.bootstrap for f in fits if f.bootstrap is not None]
    if boots:
        style.append(
            Patch(color=_GREY, alpha=0.2, label=f"{100 * boots[0].level:g}% bootstrap band")
        )
    return style


def _draw_run(ax: Axes, f: RunFit, xs: np.ndarray, color: str) -> None:
    p = f.fit.params
    x, y, fitted = f.run.x, f.run.y, f.fitted
    ax.plot(x[fitted], y[fitted], "o", color=color, markersize=4, alpha=0.8)
    ax.plot(
        x[~fitted], y[~fitted], "o", color=color, markerfacecolor="none", markersize=4, alpha=0.8
    )
    lo, hi = float(x[fitted].min()), float(x[fitted].max())
    inside = (xs >= lo) & (xs <= hi)
    r = p.predict(xs)
    label = (
        f"{f.name}: A={p.a:.3f}{' (fixed)' if f.fit.a_fixed else ''}, B={p.b:.2f}, "
        f"C_mid={p.c_mid:.4g}"
    )
    ax.plot(xs[inside], r[inside], "-", color=color, linewidth=2, label=label)
    for part in (xs <= lo, xs >= hi):
        if part.sum() > 1:
            ax.plot(xs[part], r[part], "--", color=color, linewidth=1.5)
    if f.bootstrap is not None:
        band_lo, band_hi = f.bootstrap.band(xs)
        ax.fill_between(xs, band_lo, band_hi, color=color, alpha=0.2, linewidth=0)
    ax.axhline(p.a, color=color, linestyle=":", linewidth=1)
