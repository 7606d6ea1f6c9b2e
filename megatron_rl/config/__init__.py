"""Typed config tree and YAML recipe loading (no torch import)."""

from megatron_rl.config.loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    merge,
    read_recipe,
    to_dict,
)

__all__ = ["ConfigError", "apply_overrides", "from_dict", "merge", "read_recipe", "to_dict"]
