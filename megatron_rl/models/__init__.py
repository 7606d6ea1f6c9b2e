"""Model providers: megatron-core GPTModel from HF configs or named presets.

Names are imported on first use, so that ``ModelConfig`` (part of the run-config schema)
loads without transformers (which ``presets`` imports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.lazy import lazy_exports

# public name -> defining module
_EXPORTS: dict[str, str] = {
    "ModelConfig": "megatron_rl.models.config",
    "PRESETS": "megatron_rl.models.presets",
    "make_hf_model": "megatron_rl.models.presets",
    "preset_hf_config": "megatron_rl.models.presets",
}

__all__ = ["PRESETS", "ModelConfig", "make_hf_model", "preset_hf_config"]

if TYPE_CHECKING:
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.presets import PRESETS, make_hf_model, preset_hf_config


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
