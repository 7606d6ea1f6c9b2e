"""CISPO (MiniMax-M1; the ScaleRL loss): truncated, detached importance weight on log pi."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.aggregation import LossNormalizers
from megatron_rl.algorithms.losses.base import LossTerms, PolicyLoss, check_positive


class CISPOLoss(PolicyLoss):
    """Per token: sg(min(rho, eps_max)) * A * logprobs, rho = exp(logprobs - gen_logprobs).

    The gradient flows through ``logprobs`` only; every token keeps a gradient (no lower
    clip), its weight truncated at ``eps_max``.
    """

    def __init__(self, eps_max: float = 4.0) -> None:
        self.eps_max = check_positive("eps_max", eps_max)

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
        weight = rho.clamp(max=self.eps_max)
        return LossTerms(objective=weight * advantages * logprobs, clipped=rho > self.eps_max)
