"""Rollouts: a pool of vLLM engines with in-flight weight pushes from Megatron.

``RolloutConfig`` (no torch import) configures it; ``GeneratorPool`` runs it and returns
``Sample`` s; ``push_megatron_weights`` streams a Megatron model's weights into it. The heavy
modules are imported on first use, so that reading configs stays light.
"""

from megatron_rl.rollout.config import InterruptionConfig, RolloutConfig
from megatron_rl.rollout.samples import PushStats, Sample

__all__ = [
    "GeneratorPool",
    "InterruptionConfig",
    "PushStats",
    "RolloutConfig",
    "Sample",
    "push_megatron_weights",
]


def __getattr__(name: str):
    if name == "GeneratorPool":
        from megatron_rl.rollout.pool import GeneratorPool

        return GeneratorPool
    if name == "push_megatron_weights":
        from megatron_rl.rollout.weights.push import push_megatron_weights

        return push_megatron_weights
    raise AttributeError(name)
