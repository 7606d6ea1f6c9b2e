"""Overlong length penalty (DAPO), the paper's alternative to forced interruptions."""

from __future__ import annotations

import torch


def length_penalty(
    lengths: torch.Tensor, correct: torch.Tensor, l_max: int, l_cache: int
) -> torch.Tensor:
    """``[S]`` penalty added to the rewards: clip((l_max - len) / l_cache - 1, -1, 0) on
    correct samples, 0 on the others.

    It is 0 up to ``l_max - l_cache`` tokens, falls linearly to -1 at ``l_max`` and stays
    there.

    Args:
        lengths: ``[S]`` generated tokens per sample.
        correct: ``[S]`` bool, samples whose answer was verified correct.
        l_max: maximum length L_max (paper: 14k).
        l_cache: length of the penalty ramp L_cache (paper: 2k).
    """
    if l_cache <= 0:
        raise ValueError(f"l_cache must be > 0, got {l_cache!r}")
    if l_max < l_cache:
        raise ValueError(f"l_max must be >= l_cache, got l_max={l_max!r}, l_cache={l_cache!r}")
    if lengths.dim() != 1 or correct.shape != lengths.shape or correct.dtype != torch.bool:
        raise ValueError(
            "lengths must be 1-D [S] and correct a bool tensor of the same shape, got "
            f"{tuple(lengths.shape)} and {correct.dtype} {tuple(correct.shape)}"
        )
    ramp = ((l_max - lengths.to(torch.float64)) / l_cache - 1.0).clamp(-1.0, 0.0)
    dtype = lengths.dtype if lengths.dtype.is_floating_point else torch.float32
    return torch.where(correct, ramp, torch.zeros_like(ramp)).to(dtype)
