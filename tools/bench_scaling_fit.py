"""Time the paper's full grid fit (71 A x 100 C_mid values, B fitted at each) on 100 points.

Usage: python tools/bench_scaling_fit.py [--points 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_rl.scaling import CurveParams, FitConfig, fit_points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    true = CurveParams(a=0.610, b=1.92, c_mid=2542.0, r0=0.35)  # ScaleRL 8B, Table 1
    x = np.linspace(1500.0, 100_000.0, args.points)
    y = true.predict(x) + np.random.default_rng(0).normal(0.0, 0.01, x.shape)
    config = FitConfig()
    fit_points(x, y, true.r0, config)  # warm-up (imports, allocations)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        fit = fit_points(x, y, true.r0, config)
        times.append(time.perf_counter() - start)
    p = fit.params
    print(
        f"paper grid ({len(fit.box.a_grid)} A x {len(fit.box.c_mid_grid)} C_mid, B fitted at "
        f"each) + refinement on {args.points} points: best {min(times):.3f} s, median "
        f"{float(np.median(times)):.3f} s over {args.repeats} runs; "
        f"fit A={p.a:.4f} B={p.b:.3f} C_mid={p.c_mid:.1f} (true 0.610, 1.92, 2542)"
    )


if __name__ == "__main__":
    main()
