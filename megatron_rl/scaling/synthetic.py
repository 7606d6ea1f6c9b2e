"""Synthetic runs drawn from a known curve (for tests, demos and benchmarks)."""

from __future__ import annotations

import numpy as np

from megatron_rl.scaling.data import RunData
from megatron_rl.scaling.model import CurveParams


def synthetic_run(
    params: CurveParams,
    budget: float,
    steps: int,
    eval_every: int = 100,
    noise_sd: float = 0.01,
    seed: int = 0,
    name: str = "synthetic",
) -> RunData:
    """A run of ``steps`` steps spending ``budget`` GPU-hours at a constant rate, evaluated at
    step 0 and every ``eval_every`` steps: y = R(x) + N(0, noise_sd^2)."""
    if steps < 1 or eval_every < 1 or budget <= 0 or noise_sd < 0:
        raise ValueError("synthetic_run needs steps, eval_every, budget > 0 and noise_sd >= 0")
    x = np.arange(0, steps + 1, eval_every) * (budget / steps)
    rng = np.random.default_rng(seed)
    y = params.predict(x) + rng.normal(0.0, noise_sd, x.shape)
    return RunData(name, f"<synthetic {name}>", "gpu_hours", "val_pass_rate", x, y)
