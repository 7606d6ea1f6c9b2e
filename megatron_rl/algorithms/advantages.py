"""Group advantages, their normalisation and the zero-variance filter.

All functions work on one sample per entry: ``rewards [S]``, ``group_ids [S]`` (the samples
generated from one prompt share a group id). They are computed once per step on the whole
global batch (a few thousand floats), so no distributed variant is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl.algorithms.config import NORMALIZATION_NAMES


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group index ``[S]`` in [0, num_groups) and the number of groups."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    return inverse, num_groups


def _group_mean(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Mean of ``values [S]`` within each group, broadcast back to ``[S]``."""
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    counts = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    sums.index_add_(0, index, values)
    counts.index_add_(0, index, torch.ones_like(values))
    return (sums / counts)[index]


def _normalize_none(
    centered: torch.Tensor, index: torch.Tensor, num_groups: int, keep: torch.Tensor, eps: float
) -> torch.Tensor:
    return centered


def _normalize_group(
    centered: torch.Tensor, index: torch.Tensor, num_groups: int, keep: torch.Tensor, eps: float
) -> torch.Tensor:
    # Population std of the rewards of each group = sqrt(mean of centered^2 in the group).
    std = _group_mean(centered * centered, index, num_groups).sqrt()
    return centered / (std + eps)


def _normalize_batch(
    centered: torch.Tensor, index: torch.Tensor, num_groups: int, keep: torch.Tensor, eps: float
) -> torch.Tensor:
    kept = centered[keep]
    if kept.numel() == 0:
        return centered
    std = kept.std(correction=0)
    return centered / (std + eps)


NormalizationFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, float], torch.Tensor]

# advantage normalisation by name (recipes select with `advantage_normalization: <name>`)
NORMALIZATIONS: dict[str, NormalizationFn] = {
    "batch": _normalize_batch,
    "group": _normalize_group,
    "none": _normalize_none,
}
assert tuple(NORMALIZATIONS) == NORMALIZATION_NAMES


def _check_samples(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "rewards and group_ids must be 1-D tensors of the same length [S], got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    normalization: str = "batch",
    keep: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages ``[S]``.

    A_i = r_i - mean of r over all samples of i's group, then
    "group": A_i / (population std of r in i's group + eps) (GRPO);
    "batch": A_i / (population std of A over the kept samples + eps) (ScaleRL);
    "none": unchanged. Samples with ``keep`` False get advantage 0 (and do not enter the
    batch std).

    Args:
        rewards: ``[S]`` float rewards.
        group_ids: ``[S]`` integer ids; the samples of one prompt share an id.
        normalization: a key of ``NORMALIZATIONS``.
        keep: ``[S]`` bool, the effective batch (e.g. ``zero_variance_mask``); None keeps all.
        eps: added to the std before dividing.

    Returns:
        ``[S]`` advantages, in the rewards' dtype (float32 for integer rewards).
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {list(NORMALIZATIONS)}, got {normalization!r}"
        )
    _check_samples(rewards, group_ids)
    if keep is None:
        keep = torch.ones_like(rewards, dtype=torch.bool)
    elif keep.shape != rewards.shape or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool tensor of shape {tuple(rewards.shape)}")
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    values = rewards.to(torch.float64)
    index, num_groups = _group_index(group_ids)
    centered = values - _group_mean(values, index, num_groups)
    advantages = NORMALIZATIONS[normalization](centered, index, num_groups, keep, eps)
    return torch.where(keep, advantages, torch.zeros_like(advantages)).to(out_dtype)


def zero_variance_mask(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[S]`` bool: False for every sample of a group whose rewards are all equal.

    Such groups have zero advantage everywhere, so ScaleRL drops them from the loss and its
    normalisers (without refilling the batch). A group of one sample counts as zero-variance.
    """
    _check_samples(rewards, group_ids)
    index, num_groups = _group_index(group_ids)
    high = torch.full((num_groups,), float("-inf"), dtype=torch.float64, device=rewards.device)
    low = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=rewards.device)
    values = rewards.to(torch.float64)
    high = high.scatter_reduce(0, index, values, reduce="amax")
    low = low.scatter_reduce(0, index, values, reduce="amin")
    return (high != low)[index]
