"""Rollouts: a pool of vLLM engines with in-flight weight pushes from Megatron.

``RolloutConfig`` (no torch import) configures it; ``GeneratorPool`` runs it and returns
``Sample`` s; ``push_megatron_weights`` streams a Megatron model's weights into it. Everything
but the config is imported on first use, so that reading configs stays light (no numpy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.lazy import lazy_exports
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


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS, cache=False)
