"""Verifiable rewards: math answers (Math-Verify in killable workers) and sandboxed code tests.

Public entry points: ``RewardPool(config).score_batch(responses, references)``,
``megatron_rl.rewards.math.score(response, answer)`` and
``megatron_rl.rewards.code.score(response, tests)``. ``RewardPool`` is imported on first use,
so that ``RewardConfig`` (part of the run-config schema) loads alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.lazy import lazy_exports
from megatron_rl.rewards.config import RewardConfig

_EXPORTS: dict[str, str] = {"RewardPool": "megatron_rl.rewards.pool"}

__all__ = ["RewardConfig", "RewardPool"]

if TYPE_CHECKING:
    from megatron_rl.rewards.pool import RewardPool


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
