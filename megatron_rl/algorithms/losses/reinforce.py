"""Plain importance-weighted policy gradient (no clipping)."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.aggregation import LossNormalizers
from megatron_rl.algorithms.losses.base import LossTerms, PolicyLoss


class ReinforceLoss(PolicyLoss):
    """Per token: sg(rho) * A * logprobs, rho = exp(logprobs - gen_logprobs)."""

    def terms(
        self,
        logprobs: torch.Tensor,
        gen_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        sample_ids: torch.Tensor,
        normalizers: LossNormalizers,
    ) -> LossTerms:
        rho = torch.exp(logprobs.detach() - gen_logprobs)
        return LossTerms(objective=rho * advantages * logprobs, clipped=torch.zeros_like(loss_mask))
