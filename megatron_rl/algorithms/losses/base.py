"""Interface of a policy loss: per-token objectives to be maximised, before aggregation."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from megatron_rl.algorithms.aggregation import LossNormalizers


@dataclass
class LossTerms:
    """Per-token output of a policy loss.

    Attributes:
        objective: ``[T]`` objective of each token (maximised; the loss is minus its
            aggregate). Values on tokens outside the loss mask are ignored.
        clipped: ``[T]`` bool, tokens whose ratio was clipped (PPO-clip, GSPO: the clipped
            term is the active one, so the token has no gradient) or truncated (CISPO:
            rho > eps_max).
    """

    objective: torch.Tensor
    clipped: torch.Tensor


class PolicyLoss(ABC):
    """A policy-gradient objective; one subclass per file, registered in ``LOSSES``.

    Subclasses take their hyper-parameters as keyword arguments of ``__init__`` (raising
    ValueError for invalid values) and implement ``terms``.
    """

    @abstractmethod
    def terms(
        self,
        logprobs: torch.Tensor,
        gen_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        sample_ids: torch.Tensor,
        normalizers: LossNormalizers,
    ) -> LossTerms:
        """Per-token objective.

        Args:
            logprobs: ``[T]`` trainer log-probs of the sampled tokens (with grad); 0 where
                ``loss_mask`` is False.
            gen_logprobs: ``[T]`` generator log-probs (no grad); 0 where not masked.
            advantages: ``[T]`` advantage of each token's sample (no grad); 0 where not masked.
            loss_mask: ``[T]`` bool.
            sample_ids: ``[T]`` long.
            normalizers: global counts of the step (see ``compute_loss_normalizers``).
        """


def check_positive(name: str, value: float) -> float:
    """Return ``value`` as float, raising ValueError unless it is finite and > 0."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_clip_range(eps_low: float, eps_high: float) -> tuple[float, float]:
    """Validate a clip range [1 - eps_low, 1 + eps_high]; ValueError naming the bad bound."""
    if not isinstance(eps_low, (int, float)) or not 0 <= eps_low < 1:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low!r}")
    if not isinstance(eps_high, (int, float)) or not math.isfinite(eps_high) or eps_high < 0:
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high!r}")
    return float(eps_low), float(eps_high)
