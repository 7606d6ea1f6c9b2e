"""`megatron-rl fit`: fit, extrapolate and compare compute curves of RL runs.

Defaults reproduce the paper's procedure (GPU-hours, points from 1.5k GPU-hours, A grid
0.450..0.800 step 0.005, 100 C_mid values in [100, 40000]). For small runs (e.g. CPU runs
with ~1e-3 GPU-hours) use ``--min-x 0 --auto-grid`` (ranges derived from the data).

``--holdout 0.5`` is the paper's hold-out test: fit on the first half of each run's compute,
predict the rest with the bootstrap band, report the errors against the later validations
(overall and per domain).

``--watch RUN_DIR`` follows a running run instead: every ``--interval`` seconds it refits the
run's forecast (its recipe's ``forecast`` settings), redraws RUN_DIR/reward_curve.png and
prints one line, until the run finishes (or Ctrl-C, or ``--max-refreshes``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter

from megatron_rl.scaling.analysis import compare_runs
from megatron_rl.scaling.config import AUTO, C_MID_SPACINGS, FitConfig
from megatron_rl.scaling.data import load_run
from megatron_rl.scaling.plot import plot_runs
from megatron_rl.scaling.report import comparison_summary, format_report

logger = logging.getLogger(__name__)
_DEFAULTS = FitConfig()
HOLDOUT_BOOTSTRAP = 100  # --holdout reports the band: bootstrap resamples unless given


def _range(text: str) -> tuple[float, float] | str:
    if text.strip().lower() == AUTO:
        return AUTO
    parts = text.split(",")
    try:
        low, high = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH or 'auto', got {text!r}") from None
    return low, high


def _pair(text: str) -> tuple[float, float]:
    value = _range(text)
    if value == AUTO:
        raise argparse.ArgumentTypeError("expected LOW,HIGH")
    return value  # type: ignore[return-value]


def _fmt(r: tuple[float, float] | str) -> str:
    return r if isinstance(r, str) else f"{r[0]:g},{r[1]:g}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``megatron-rl fit``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("metrics", nargs="*", help="metrics.jsonl or CSV file, one per run")
    _add_watch_arguments(parser.add_argument_group("following a running run"))
    _add_data_arguments(parser.add_argument_group("data"))
    _add_grid_arguments(parser.add_argument_group("fit"))
    _add_output_arguments(parser.add_argument_group("uncertainty, comparison and output"))


def _add_watch_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--watch", metavar="RUN_DIR", help="follow a running run's forecast")
    group.add_argument(
        "--interval", type=float, default=30.0, help="seconds between refreshes (30)"
    )
    group.add_argument(
        "--max-refreshes", type=int, default=0, help="stop after this many refreshes (0: none)"
    )
    group.add_argument("--budget", type=float, help="forecast at this compute (default: the run's)")


def _add_data_arguments(group: argparse._ArgumentGroup) -> None:
    d = _DEFAULTS
    group.add_argument("--x", default=d.x_field, help=f"compute field (default {d.x_field})")
    group.add_argument("--y", default=d.y_field, help=f"metric field (default {d.y_field})")
    group.add_argument("--label", action="append", help="run name (repeat, one per file)")
    group.add_argument("--r0", type=float, help="R0 (default: y at the smallest x)")
    group.add_argument(
        "--min-x", type=float, default=None,
        help=f"fit points with x >= this ({d.min_x:g}, the paper's; when no run reaches it and "
        "neither --min-x nor a grid is given, every point x > 0 with a grid from the data)",
    )  # fmt: skip
    group.add_argument("--fit-until", type=float, help="fit only points with x <= this")
    group.add_argument("--extrapolate-to", type=float, help="report (and plot) R at this x")
    group.add_argument(
        "--holdout", type=float, metavar="FRACTION",
        help="the paper's hold-out test: fit each run on the first 1 - FRACTION of its "
        "compute, predict its later validations (overall and per domain) with the band "
        f"(--bootstrap, default {HOLDOUT_BOOTSTRAP} here) and report the errors",
    )  # fmt: skip


def _add_grid_arguments(group: argparse._ArgumentGroup) -> None:
    d = _DEFAULTS
    group.add_argument("--fix-a", type=float, help="fix the asymptote A")
    group.add_argument(
        "--a-range", type=_range, default=None,
        help=f"A grid LOW,HIGH or 'auto' (default {_fmt(d.a_range)})",
    )  # fmt: skip
    group.add_argument("--a-step", type=float, default=d.a_step, help=f"A step ({d.a_step:g})")
    group.add_argument(
        "--c-mid-range", type=_range, default=None,
        help=f"C_mid grid LOW,HIGH or 'auto' (default {_fmt(d.c_mid_range)})",
    )  # fmt: skip
    group.add_argument(
        "--c-mid-num", type=int, default=d.c_mid_num, help=f"C_mid values ({d.c_mid_num})"
    )
    group.add_argument(
        "--c-mid-spacing", choices=C_MID_SPACINGS, default=d.c_mid_spacing,
        help=f"spacing of an explicit C_mid grid ({d.c_mid_spacing}; 'auto' is log-spaced)",
    )  # fmt: skip
    group.add_argument(
        "--auto-grid", action="store_true", help="shorthand for --a-range auto --c-mid-range auto"
    )
    group.add_argument(
        "--b-range", type=_pair, default=d.b_range,
        help=f"B search range LOW,HIGH (default {_fmt(d.b_range)})",
    )  # fmt: skip
    group.add_argument(
        "--no-refine", action="store_true", help="keep the best grid point (no joint refinement)"
    )
    group.add_argument(
        "--min-points", type=int, default=d.min_points, help=f"fewest points ({d.min_points})"
    )


def _add_output_arguments(group: argparse._ArgumentGroup) -> None:
    d = _DEFAULTS
    group.add_argument(
        "--bootstrap", type=int, default=None, metavar="N",
        help="bootstrap resamples for intervals and band (default 0: none; with --watch: "
        "the run's forecast.bootstrap)",
    )  # fmt: skip
    group.add_argument("--ci", type=float, default=d.ci, help=f"interval level ({d.ci:g})")
    group.add_argument("--seed", type=int, default=d.seed, help="bootstrap seed")
    group.add_argument(
        "--a-tolerance", type=float, default=d.a_tolerance,
        help=f"refit with a common A when the As lie within this ({d.a_tolerance:g})",
    )  # fmt: skip
    group.add_argument("--json", action="store_true", help="print JSON instead of a table")
    group.add_argument("--plot", metavar="FILE.png", help="save a plot of all runs")
    group.add_argument("--logx", action="store_true", help="log-scale x axis in the plot")
    group.add_argument("--title", help="plot title")


def config_from_args(args: argparse.Namespace, from_data: bool = False) -> FitConfig:
    """The FitConfig named by the command-line options (validated); ``from_data``: every
    point x > 0 and a grid from the data where the options leave the range unset."""
    d = _DEFAULTS
    auto = args.auto_grid or from_data
    return FitConfig(
        x_field=args.x,
        y_field=args.y,
        min_x=args.min_x if args.min_x is not None else (0.0 if from_data else d.min_x),
        fit_until=args.fit_until,
        r0=args.r0,
        fix_a=args.fix_a,
        a_range=AUTO if auto else (args.a_range if args.a_range is not None else d.a_range),
        a_step=args.a_step,
        c_mid_range=AUTO
        if auto
        else (args.c_mid_range if args.c_mid_range is not None else d.c_mid_range),
        c_mid_num=args.c_mid_num,
        c_mid_spacing=args.c_mid_spacing,
        b_range=args.b_range,
        refine=not args.no_refine,
        min_points=args.min_points,
        bootstrap=args.bootstrap if args.bootstrap is not None else _DEFAULTS.bootstrap,
        ci=args.ci,
        seed=args.seed,
        a_tolerance=args.a_tolerance,
    ).validate()


def _labels(args: argparse.Namespace) -> list[str | None]:
    if args.label is None:
        return [None] * len(args.metrics)
    if len(args.label) != len(args.metrics):
        raise ValueError(f"--label given {len(args.label)} times for {len(args.metrics)} files")
    return list(args.label)


def _range_from_data(args: argparse.Namespace, runs: list) -> bool:
    """True (and a note on stderr) when no run reaches the paper's cutoff (1.5k GPU-hours: a
    CPU run, a short one) and no option sets the range: the fit then takes every point x > 0
    and a grid from the data, as ``--min-x 0 --auto-grid`` would."""
    unset = args.min_x is None and args.a_range is None and args.c_mid_range is None
    largest = max((float(r.x.max()) for r in runs if len(r.x)), default=0.0)
    if not unset or largest >= _DEFAULTS.min_x:
        return False
    sys.stderr.write(
        f"megatron-rl fit: note: no point reaches {_DEFAULTS.min_x:g} {args.x} (the paper's "
        f"cutoff; the largest here is {largest:.4g}): fitting every point with {args.x} > 0 "
        "on a grid from the data, as --min-x 0 --auto-grid (set --min-x to choose)\n"
    )
    return True


def _holdout(args: argparse.Namespace) -> int:
    """``--holdout``: the hold-out test of every run (table or JSON; the plot of the fits
    on the first part, the held-out points hollow)."""
    from megatron_rl.scaling.holdout import format_holdout, holdout_metrics

    if args.bootstrap is None:
        args.bootstrap = HOLDOUT_BOOTSTRAP
    runs = [load_run(path, args.x, args.y, name) for path, name in zip(args.metrics, _labels(args))]
    config = config_from_args(args, from_data=_range_from_data(args, runs))
    results = [
        holdout_metrics(path, config, args.holdout, name)
        for path, name in zip(args.metrics, _labels(args))
    ]
    if args.json:
        sys.stdout.write(json.dumps([r.summary() for r in results], indent=2) + "\n")
    else:
        sys.stdout.write(format_holdout(results) + "\n")
    sys.stdout.flush()
    if args.plot:
        end = max(r.overall.x_end for r in results)
        fits = [r.overall.fit for r in results]
        path = plot_runs(fits, args.plot, end, args.logx, args.title or "hold-out test")
        logger.info("plot saved to %s", path)
    return 0


def run(args: argparse.Namespace) -> int:
    """Fit every file, print the table (or JSON), save the plot; 2 with a message on bad input."""
    try:
        if args.watch is not None:
            if args.metrics:
                raise ValueError("give either metrics files or --watch RUN_DIR, not both")
            from megatron_rl.scaling.watch import watch

            return watch(
                args.watch,
                args.interval,
                args.max_refreshes,
                args.plot,
                args.budget,
                args.bootstrap,
            )
        if not args.metrics:
            raise ValueError("no metrics files given (or --watch RUN_DIR)")
        if args.holdout is not None:
            return _holdout(args)
        config = config_from_args(args)
        runs = [
            load_run(path, config.x_field, config.y_field, name)
            for path, name in zip(args.metrics, _labels(args))
        ]
        if _range_from_data(args, runs):
            config = config_from_args(args, from_data=True)
        counts = Counter(r.name for r in runs)
        for r in runs:
            if counts[r.name] > 1:
                r.name = r.source
        comparison = compare_runs(runs, config)
        if args.json:
            summary = comparison_summary(comparison, args.extrapolate_to, config.a_tolerance)
            sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        else:
            text = format_report(comparison, args.extrapolate_to, config.a_tolerance)
            sys.stdout.write(text + "\n")
        sys.stdout.flush()
        if args.plot:
            path = plot_runs(comparison.fits, args.plot, args.extrapolate_to, args.logx, args.title)
            logger.info("plot saved to %s", path)
    except (ValueError, OSError) as err:  # bad input or an unwritable plot path
        sys.stderr.write(f"megatron-rl fit: error: {err}\n")
        return 2
    return 0
