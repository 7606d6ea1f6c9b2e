"""Prompt data: datasets (Polaris-53K, DeepCoder, local files, synthetic arithmetic),
the held-out validation split, prompt rendering and the resumable training sampler.

Heavy libraries (``datasets``, ``transformers``) are imported only when data is loaded.
"""

from megatron_rl.data.config import DataConfig, SyntheticConfig
from megatron_rl.data.prompts import Prompt, PromptData, load_prompt_data
from megatron_rl.data.rendering import render_prompt, sft_example
from megatron_rl.data.sampler import (
    PromptSampler,
    RetirementTracker,
    has_reward_variance,
    refill_until,
)

__all__ = [
    "DataConfig",
    "Prompt",
    "PromptData",
    "PromptSampler",
    "RetirementTracker",
    "SyntheticConfig",
    "has_reward_variance",
    "load_prompt_data",
    "refill_until",
    "render_prompt",
    "sft_example",
]
