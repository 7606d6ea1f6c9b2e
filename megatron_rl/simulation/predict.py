"""A recipe's cost on the physical limit, on the calibrated ("expected") model with a range, and
under the what-if switches of issue 31 items 2-4 (no torch import).

- physical limit: ``cost_model(config)`` as it is (the roofline);
- expected: ``CostModel.calibrated()`` with this project's code as it would be with items 2-4
  (weight push at link speed, groups balanced over DP ranks, fused kernels); the range runs the
  calibrated factors scaled by the calibration's worst residual either way and the length
  model's median thinking at ``THINK_MEDIANS``;
- our code today: the calibrated model with the host-path push, groups balanced over DP ranks
  by tokens (item 3, ``trainer/balance.py``) and unfused kernels; each item switched on alone
  (item 3's row: from ``group % DP``, as before it) and all together.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.simulation.costs import (
    CALIBRATED,
    HOST_PUSH_BYTES_PER_S,
    UNFUSED_KERNEL_SLOWDOWN,
    CostModel,
)
from megatron_rl.simulation.run import SimResult, settings_from_config, simulate
from megatron_rl.simulation.workload import length_model

# assumption: median thinking tokens the range spans (ours: 4,000 is the length model's
# default; the paper gives budgets, not lengths; a long-thinking SFT model sits nearer 8,000)
THINK_MEDIANS = (4000.0, 8000.0)


@dataclass(frozen=True)
class Switches:
    """Issue 31 items 2-4: True where the item is done."""

    push_at_link_speed: bool = True
    dp_balanced: bool = True
    fused_kernels: bool = True

    def apply(self, costs: CostModel) -> tuple[CostModel, str]:
        """The cost model and the DP assignment under these switches."""
        costs = costs.with_(
            push_bytes_per_s=None if self.push_at_link_speed else HOST_PUSH_BYTES_PER_S,
            kernel_slowdown=1.0 if self.fused_kernels else UNFUSED_KERNEL_SLOWDOWN,
        )
        return costs, "balanced" if self.dp_balanced else "modulo"


TODAY = Switches(False, True, False)
BEFORE = Switches(False, False, False)  # before item 3 landed
WHAT_IFS = {
    "before DP balancing (host push, group % DP, unfused)": BEFORE,
    "+ DP balancing (item 3): our code today": TODAY,
    "+ push at link speed (item 2)": Switches(True, True, False),
    "+ fused kernels (item 4)": Switches(False, True, True),
    "items 2-4 done": Switches(),
}


def run(
    config,
    costs: CostModel,
    *,
    switches: Switches = Switches(),
    think_median: float = THINK_MEDIANS[0],
    k: int | None = None,
    steps: int = 24,
    trained_fraction: float = 1.0,
) -> SimResult:
    """PipelineRL-k (default: the recipe's max_lag) of ``config`` under ``costs``."""
    costs, assignment = switches.apply(costs)
    dp = config.cluster.trainer_gpus // max(
        1, config.parallel.tensor * config.parallel.pipeline * config.parallel.context
    )
    settings = settings_from_config(
        config,
        "pipeline_rl",
        k or config.off_policy.max_lag,
        steps=steps,
        warmup=5,
        trained_fraction=trained_fraction,
        dp=dp,
        dp_assignment=assignment,
    )
    return simulate(costs, length_model(config, think_median=think_median), settings)


def scaled(costs: CostModel, factor: float) -> CostModel:
    """The calibrated model with its fitted factors multiplied by ``factor``."""
    mfu = CALIBRATED["train_mfu_moe" if costs.moe else "train_mfu_dense"]
    return costs.with_(
        generation_efficiency=CALIBRATED["generation_efficiency"] * factor,
        train_mfu=mfu * factor,
    )


def expected_range(config, base: CostModel, residual: float, **kw) -> tuple[float, float]:
    """Lowest and highest seconds a step of the calibrated model over the factors scaled by
    (1 +- ``residual``) and the length model's ``THINK_MEDIANS``."""
    seconds = [
        run(config, scaled(base, f), think_median=t, **kw).seconds_per_step
        for f in (1 / (1 + residual), 1 + residual)
        for t in THINK_MEDIANS
    ]
    return min(seconds), max(seconds)
