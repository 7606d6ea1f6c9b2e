"""Verifiable rewards: math answers (Math-Verify in killable workers) and sandboxed code tests.

Public entry points: ``RewardPool(config).score_batch(responses, references)``,
``megatron_rl.rewards.math.score(response, answer)`` and
``megatron_rl.rewards.code.score(response, tests)``. ``RewardPool`` is imported on first use,
so that ``RewardConfig`` (part of the run-config schema) loads alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_rl.rewards.config import RewardConfig

_EXPORTS: dict[str, str] = {"RewardPool": "megatron_rl.rewards.pool"}

__all__ = ["RewardConfig", "RewardPool"]

if TYPE_CHECKING:
    from megatron_rl.rewards.pool import RewardPool


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
