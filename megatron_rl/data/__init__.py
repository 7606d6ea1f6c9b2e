"""Prompt data: datasets (Polaris-53K, DeepCoder, local files, synthetic arithmetic),
the held-out validation split, prompt rendering and the resumable training sampler.

Heavy libraries (``datasets``, ``transformers``) are imported only when data is loaded; the
names below but the configs are imported on first use (the run-config schema reads
``data.config`` alone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.data.config import (
    DataConfig,
    DataSourceConfig,
    SyntheticCodeConfig,
    SyntheticConfig,
)
from megatron_rl.lazy import lazy_exports

# public name -> defining module (imported lazily)
_EXPORTS: dict[str, str] = {
    "DataError": "megatron_rl.data.prompts",
    "Prompt": "megatron_rl.data.prompts",
    "PromptData": "megatron_rl.data.prompts",
    "load_prompt_data": "megatron_rl.data.prompts",
    "encode_prompt": "megatron_rl.data.rendering",
    "prompt_token_ids": "megatron_rl.data.rendering",
    "render_prompt": "megatron_rl.data.rendering",
    "sft_example": "megatron_rl.data.rendering",
    "MixedPromptSampler": "megatron_rl.data.sampler",
    "PromptSampler": "megatron_rl.data.sampler",
    "RetirementTracker": "megatron_rl.data.sampler",
    "has_reward_variance": "megatron_rl.data.sampler",
}

if TYPE_CHECKING:
    from megatron_rl.data.prompts import DataError, Prompt, PromptData, load_prompt_data
    from megatron_rl.data.rendering import (
        encode_prompt,
        prompt_token_ids,
        render_prompt,
        sft_example,
    )
    from megatron_rl.data.sampler import (
        MixedPromptSampler,
        PromptSampler,
        RetirementTracker,
        has_reward_variance,
    )


def build_sampler(data: PromptData, config: DataConfig, tracker=None):
    """The training sampler of ``data``: a ``PromptSampler`` for one source (the state
    format of every single-source run), a ``MixedPromptSampler`` for a mixture."""
    from megatron_rl.data.sampler import MixedPromptSampler, PromptSampler

    if len(data.sources) <= 1:
        return PromptSampler(
            data.train_ids, seed=config.sampler_seed, shuffle=config.shuffle, tracker=tracker
        )
    return MixedPromptSampler(
        [(source.name, ids, source.weight) for source, ids in data.train_by_source()],
        seed=config.sampler_seed,
        shuffle=config.shuffle,
        tracker=tracker,
    )


__all__ = [
    "DataConfig",
    "DataError",
    "DataSourceConfig",
    "MixedPromptSampler",
    "Prompt",
    "PromptData",
    "PromptSampler",
    "RetirementTracker",
    "SyntheticCodeConfig",
    "SyntheticConfig",
    "build_sampler",
    "encode_prompt",
    "has_reward_variance",
    "load_prompt_data",
    "prompt_token_ids",
    "render_prompt",
    "sft_example",
]


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
