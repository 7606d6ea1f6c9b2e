"""Typed config tree and YAML recipe loading.

The loader names are imported eagerly (they need only PyYAML); the run-config schema is
imported on first use, because the component configs it gathers live in other packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_rl.config.loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    merge,
    read_recipe,
    to_dict,
)

# public name -> defining module (imported lazily)
_SECTIONS = (
    "BatchConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "LoggingConfig",
    "OffPolicyConfig",
    "OptimizerConfig",
    "TrainingConfig",
    "ValidationConfig",
    "WarmStartConfig",
)
_SCHEMA = (
    "RunConfig",
    "diff_keys",
    "load_run_config",
    "run_config_from_dict",
    "save_run_config",
    "to_yaml",
)
_LAZY: dict[str, str] = {
    **{name: "megatron_rl.config.sections" for name in _SECTIONS},
    **{name: "megatron_rl.config.schema" for name in _SCHEMA},
}
_LAZY["check_model_shapes"] = "megatron_rl.config.checks"

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "LoggingConfig",
    "OffPolicyConfig",
    "OptimizerConfig",
    "RunConfig",
    "TrainingConfig",
    "ValidationConfig",
    "WarmStartConfig",
    "apply_overrides",
    "check_model_shapes",
    "diff_keys",
    "from_dict",
    "load_run_config",
    "merge",
    "read_recipe",
    "run_config_from_dict",
    "save_run_config",
    "to_dict",
    "to_yaml",
]
assert set(_LAZY) <= set(__all__)

if TYPE_CHECKING:
    from megatron_rl.config.checks import check_model_shapes
    from megatron_rl.config.schema import (
        RunConfig,
        diff_keys,
        load_run_config,
        run_config_from_dict,
        save_run_config,
        to_yaml,
    )
    from megatron_rl.config.sections import (
        BatchConfig,
        CheckpointConfig,
        ClusterConfig,
        LoggingConfig,
        OffPolicyConfig,
        OptimizerConfig,
        TrainingConfig,
        ValidationConfig,
        WarmStartConfig,
    )


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
