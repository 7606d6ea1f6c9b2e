"""Model providers: megatron-core GPTModel from HF configs or named presets."""

from megatron_rl.models.config import ModelConfig
from megatron_rl.models.presets import PRESETS, make_hf_model, preset_hf_config

__all__ = ["PRESETS", "ModelConfig", "make_hf_model", "preset_hf_config"]
