"""GSPO (Qwen): PPO-clip on a sequence-level, length-normalised importance ratio."""

from __future__ import annotations

import torch

from megatron_rl.algorithms.aggregation import LossNormalizers
from megatron_rl.algorithms.losses.base import LossTerms, PolicyLoss, check_clip_range
from megatron_rl.algorithms.losses.ppo_clip import clipped_surrogate


class GSPOLoss(PolicyLoss):
    """Per token of sample i: min(s_i * A, clip(s_i, 1 - eps_low, 1 + eps_high) * A), where
    s_i = exp(mean over i's masked tokens of (logprobs - gen_logprobs)).

    The gradient through s_i reaches every token of sample i, so all tokens of a sample
    must be in the same micro-batch (the trainer splits by samples); a split sample raises
    ValueError.
    """

    def __init__(self, eps_low: float = 3e-3, eps_high: float = 4e-3) -> None:
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
        _, index = torch.unique(sample_ids, return_inverse=True)
        num = int(index.max().item()) + 1 if index.numel() else 0
        log_ratio = torch.where(loss_mask, logprobs - gen_logprobs, torch.zeros_like(logprobs))
        sums = log_ratio.new_zeros(num).index_add(0, index, log_ratio)
        local = torch.zeros(num, dtype=torch.int64, device=index.device)
        local.index_add_(0, index, loss_mask.to(torch.int64))
        global_counts = normalizers.sample_token_counts(sample_ids, loss_mask)
        if not bool(((local[index] == global_counts) | ~loss_mask).all()):
            raise ValueError(
                "gspo needs all masked tokens of a sample in one micro-batch: split the "
                "batch by samples"
            )
        seq_ratio = torch.exp(sums / local.clamp(min=1).to(sums.dtype))
        terms = clipped_surrogate(seq_ratio[index], advantages, self.eps_low, self.eps_high)
        terms.clipped &= loss_mask
        return terms
