"""Rollouts: a pool of vLLM engines with in-flight weight pushes from Megatron.

``RolloutConfig`` (no torch import) configures it; ``GeneratorPool`` runs it and returns
``Sample`` s; ``push_megatron_weights`` streams a Megatron model's weights into it. Everything
but the config is imported on first use, so that reading configs stays light (no numpy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_rl.rollout.config import InterruptionConfig, RolloutConfig

# public name -> defining module
_EXPORTS: dict[str, str] = {
    "GeneratorPool": "megatron_rl.rollout.pool",
    "PushStats": "megatron_rl.rollout.samples",
    "Sample": "megatron_rl.rollout.samples",
    "push_megatron_weights": "megatron_rl.rollout.weights.push",
}

__all__ = [
    "GeneratorPool",
    "InterruptionConfig",
    "PushStats",
    "RolloutConfig",
    "Sample",
    "push_megatron_weights",
]

if TYPE_CHECKING:
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.samples import PushStats, Sample
    from megatron_rl.rollout.weights.push import push_megatron_weights


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
