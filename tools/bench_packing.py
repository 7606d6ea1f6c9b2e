"""Micro-batch fill: padded micro-batches (``batch.plan_micro_batches``) vs packed ones
(``trainer.packing.plan_packed``, ``batch.pack``) on lognormal reasoning lengths.

Each draw is one data-parallel rank's share of a step: ``--samples`` sequences (prompt +
response), responses lognormal (median from ``--mean`` and ``--sigma``, as the simulator's
``median_for_mean``) clipped at the budget less the prompt (a sequence must fit the budget).
Per plan and budget it prints, as medians over ``--draws`` draws:

- micro-batches, and the fewest any plan can have (ceil(tokens / budget));
- fill: real tokens / (micro-batches x budget), and the same without the least-filled
  micro-batch (the remainder every plan has: what the budget's micro-batches hold);
- padded tokens: slots computed that hold no sequence (padded: ``b x longest`` less the
  tokens; packed: 0; the rounding of a packed micro-batch to a ``--multiple`` at most
  ``multiple - 1`` each) as a share of the slots.

No model runs: the plans alone (the update's equality with padding is tested in
``tests/unit/trainer/test_packing.py``).

Usage:
    python tools/bench_packing.py [--samples 48] [--budgets 16384 32768] [--mean 4000]
        [--sigma 1.0] [--prompt 512] [--multiple 1] [--draws 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics

import numpy as np

from megatron_rl.simulation.calibration import median_for_mean
from megatron_rl.trainer.batch import padded_length, plan_micro_batches
from megatron_rl.trainer.packing import plan_packed

log = logging.getLogger("bench_packing")


def plan_stats(lengths: list[int], budget: int, packed: bool, multiple: int) -> dict[str, float]:
    """Micro-batches, fill (all, and without the least filled) and padded share of a plan."""
    if packed:
        plan = plan_packed(lengths, budget - (multiple - 1))
        slots = [padded_length(sum(lengths[i] for i in part), multiple) for part in plan]
    else:
        plan = plan_micro_batches(lengths, tokens=budget, multiple=multiple)
        slots = [
            len(part) * padded_length(max(lengths[i] for i in part), multiple) for part in plan
        ]
    real = [sum(lengths[i] for i in part) for part in plan]
    total = sum(real)
    rest = sorted(real)[1:]
    return {
        "micro_batches": len(plan),
        "fewest": math.ceil(total / budget),
        "fill": total / (len(plan) * budget),
        "fill_full": sum(rest) / (len(rest) * budget) if rest else total / budget,
        "padded": 1 - total / sum(slots),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--mean", type=float, default=4000.0, help="mean response tokens")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--multiple", type=int, default=1)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rng = np.random.default_rng(args.seed)
    log.info(
        "%d samples a rank, responses lognormal (mean %.0f, sigma %.2f, clipped to the budget), "
        "prompt %d, %d draws: medians",
        args.samples, args.mean, args.sigma, args.prompt, args.draws,
    )  # fmt: skip
    header = (
        f"{'budget':>7} {'plan':>7} {'mbs':>5} {'fewest':>6} {'fill':>6} {'fill*':>6} {'padded':>7}"
    )
    log.info("%s   (fill*: without the least-filled micro-batch)", header)
    for budget in args.budgets:
        cap = budget - args.prompt
        median = median_for_mean(args.mean, args.sigma, cap)
        draws = [
            [args.prompt + int(x) for x in np.minimum(rng.lognormal(math.log(median), args.sigma, args.samples), cap)]
            for _ in range(args.draws)
        ]  # fmt: skip
        for packed in (False, True):
            stats = [plan_stats(lengths, budget, packed, args.multiple) for lengths in draws]
            med = {k: statistics.median(s[k] for s in stats) for k in stats[0]}
            log.info(
                "%7d %7s %5.1f %6.1f %5.1f%% %5.1f%% %6.2f%%",
                budget, "packed" if packed else "padded", med["micro_batches"], med["fewest"],
                100 * med["fill"], 100 * med["fill_full"], 100 * med["padded"],
            )  # fmt: skip


if __name__ == "__main__":
    main()
