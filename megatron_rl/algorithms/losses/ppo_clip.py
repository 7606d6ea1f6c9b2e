"""PPO-clip with an asymmetric range (GRPO 0.2 / 0.2, DAPO 0.2 / 0.28)."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.aggregation import LossNormalizers
from megatron_rl.algorithms.losses.base import LossTerms, PolicyLoss, check_clip_range


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> LossTerms:
    """min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), elementwise.

    ``clipped`` marks the elements where the clipped term is strictly smaller, i.e. where
    the objective is constant in the ratio (no gradient).
    """
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    return LossTerms(objective=torch.minimum(unclipped, clipped), clipped=clipped < unclipped)


class PPOClipLoss(PolicyLoss):
    """Per token: min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)."""

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2) -> None:
        self.eps_low, self.eps_high = check_clip_range(eps_low, eps_high)

    def terms(
        self,
        logprobs: torch.Tensor,
        gen_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        sample_ids: torch.Tensor,
        normalizers: LossNormalizers,
    ) -> LossTerms:
        rho = torch.exp(logprobs - gen_logprobs)
        terms = clipped_surrogate(rho, advantages, self.eps_low, self.eps_high)
        terms.clipped &= loss_mask
        return terms
