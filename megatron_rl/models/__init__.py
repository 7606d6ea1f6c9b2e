"""Model providers: megatron-core GPTModel from HF configs or named presets.

Names are imported on first use, so that ``ModelConfig`` (part of the run-config schema)
loads without transformers (which ``presets`` imports).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
