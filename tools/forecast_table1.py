"""Does a forecast made at half the budget predict the final pass rate? Per Table-1 row of
docs/paper.md: synthetic runs (R0 = 0.35, a point every 100 steps, noise as given), fitted by
the paper's protocol on the points up to half the budget, against R(budget).

Usage: python tools/forecast_table1.py [--seeds 20] [--noise-sd 0.015] [--ar1 0.0]
           [--bootstrap 0]

Columns: actual = the curve's R(budget) (the final pass rate without evaluation noise);
predicted = mean forecast over the seeds; max|err| and the share of seeds within 0.02; with
--bootstrap, the share of seeds whose 95% prediction interval holds the actual value.
"""

from __future__ import annotations

import argparse

import numpy as np

from megatron_rl.scaling.table1 import TABLE1, half_budget_check

TOLERANCE = 0.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--noise-sd", type=float, default=0.015)
    parser.add_argument("--ar1", type=float, default=0.0, help="lag-1 noise correlation")
    parser.add_argument("--bootstrap", type=int, default=0)
    args = parser.parse_args()
    print(
        f"noise sd {args.noise_sd}, AR(1) {args.ar1}, {args.seeds} seeds; forecast from the "
        f"points <= budget/2 (paper grid, points >= 1.5k GPU-h)"
    )
    header = f"{'row':34s} {'budget':>7s} {'actual':>7s} {'predicted':>9s} {'mean err':>9s}"
    header += f" {'max|err|':>8s} {'<0.02':>6s} {'last pt':>7s}"
    if args.bootstrap:
        header += f" {'covered':>7s}"
    print(header)
    for row in TABLE1:
        checks = [
            half_budget_check(row, seed, args.noise_sd, args.ar1, args.bootstrap)
            for seed in range(args.seeds)
        ]
        err = np.array([c.error for c in checks])
        line = (
            f"{row.name:34s} {row.budget:7.0f} {checks[0].actual:7.3f} "
            f"{np.mean([c.predicted for c in checks]):9.3f} {err.mean():+9.4f} "
            f"{np.abs(err).max():8.4f} {np.mean(np.abs(err) < TOLERANCE):6.0%} "
            f"{np.mean([c.last_measured for c in checks]):7.3f}"
        )
        if args.bootstrap:
            covered = [c.interval[0] <= c.actual <= c.interval[1] for c in checks if c.interval]
            line += f" {np.mean(covered):7.0%}"
        print(line)


if __name__ == "__main__":
    main()
