"""Typed config tree and YAML recipe loading.

The loader names are imported eagerly (they need only PyYAML); the run-config schema is
imported on first use, because the component configs it gathers live in other packages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.config.loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    merge,
    read_recipe,
    to_dict,
)
from megatron_rl.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
