"""The ScaleRL algorithm core: advantages, policy losses (CISPO, PPO-clip, GSPO, REINFORCE),
prompt / sample / token aggregation with global normalisers, the train-inference mismatch
correction (TIS, MIS, IcePop) and its k3 KL, and the filters
(zero-variance, No-Positive-Resampling, length penalty).

Names are imported lazily so that ``megatron_rl.algorithms.config`` (the recipe schema)
loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.lazy import lazy_exports

# public name -> defining module
_EXPORTS: dict[str, str] = {
    "AlgorithmConfig": "megatron_rl.algorithms.config",
    "NORMALIZATIONS": "megatron_rl.algorithms.advantages",
    "compute_advantages": "megatron_rl.algorithms.advantages",
    "zero_variance_mask": "megatron_rl.algorithms.advantages",
    "AGGREGATIONS": "megatron_rl.algorithms.aggregation",
    "LossNormalizers": "megatron_rl.algorithms.aggregation",
    "compute_loss_normalizers": "megatron_rl.algorithms.aggregation",
    "LOSSES": "megatron_rl.algorithms.losses",
    "MismatchCorrection": "megatron_rl.algorithms.mismatch",
    "mismatch_kl": "megatron_rl.algorithms.mismatch",
    "LossTerms": "megatron_rl.algorithms.losses",
    "PolicyLoss": "megatron_rl.algorithms.losses",
    "policy_loss": "megatron_rl.algorithms.loss",
    "PassRateTracker": "megatron_rl.algorithms.pass_rate",
    "length_penalty": "megatron_rl.algorithms.length_penalty",
}

__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "NORMALIZATIONS",
    "AlgorithmConfig",
    "LossNormalizers",
    "LossTerms",
    "MismatchCorrection",
    "PassRateTracker",
    "PolicyLoss",
    "compute_advantages",
    "compute_loss_normalizers",
    "length_penalty",
    "mismatch_kl",
    "policy_loss",
    "zero_variance_mask",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from megatron_rl.algorithms.advantages import (
        NORMALIZATIONS,
        compute_advantages,
        zero_variance_mask,
    )
    from megatron_rl.algorithms.aggregation import (
        AGGREGATIONS,
        LossNormalizers,
        compute_loss_normalizers,
    )
    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.algorithms.length_penalty import length_penalty
    from megatron_rl.algorithms.loss import policy_loss
    from megatron_rl.algorithms.losses import LOSSES, LossTerms, PolicyLoss
    from megatron_rl.algorithms.mismatch import MismatchCorrection, mismatch_kl
    from megatron_rl.algorithms.pass_rate import PassRateTracker


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
