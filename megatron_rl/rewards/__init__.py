"""Verifiable rewards: math answers (Math-Verify in killable workers) and sandboxed code tests.

Public entry points: ``RewardPool(config).score_batch(responses, references)``,
``megatron_rl.rewards.math.score(response, answer)`` and
``megatron_rl.rewards.code.score(response, tests)``.
"""

from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.pool import RewardPool

__all__ = ["RewardConfig", "RewardPool"]
