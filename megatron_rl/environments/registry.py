"""Environments by name: the built-ins, and those of installed packages' entry points.

A package adds an environment with an entry point in the group ``megatron_rl.environments``
naming an ``Environment`` subclass, as this project's own setup.py does for the built-ins
(the same mechanism that registers our weight-transfer backend with vLLM,
``vllm.general_plugins``)::

    entry_points={"megatron_rl.environments": ["my_env = my_pkg.envs:MyEnvironment"]}

The built-ins are also listed here in code, so that they are found where the installed
metadata is another checkout's (an editable install of a different worktree) or absent.
A recipe names one with ``rollout.environment.name``.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.environments.config import EnvironmentConfig
    from megatron_rl.environments.formats import ToolFormat
    from megatron_rl.environments.protocol import Environment, EnvironmentContext

ENTRY_POINT_GROUP = "megatron_rl.environments"
BUILTIN: dict[str, str] = {
    "python_tool": "megatron_rl.environments.python_tool:PythonToolEnvironment",
    "code_feedback": "megatron_rl.environments.code_feedback:CodeFeedbackEnvironment",
}


def _installed() -> dict[str, str]:
    """Entry points of the group: name -> "module:attribute"."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered() -> dict[str, str]:
    """Every environment: name -> "module:attribute". An installed entry point may not
    reuse a built-in's name for another class (a silent swap of ``python_tool`` would change
    what every recipe runs)."""
    found = dict(BUILTIN)
    for name, value in _installed().items():
        if name in BUILTIN and value != BUILTIN[name]:
            raise ValueError(
                f"entry point {name} = {value} ({ENTRY_POINT_GROUP}) reuses the name of the "
                f"built-in {BUILTIN[name]}"
            )
        found[name] = value
    return found


def available() -> list[str]:
    """Names of the registered environments, sorted."""
    return sorted(registered())


def environment_class(name: str) -> type[Environment]:
    """The ``Environment`` subclass registered as ``name``."""
    from megatron_rl.environments.protocol import Environment

    found = registered()
    if name not in found:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(sorted(found))}")
    value = found[name]
    if name in BUILTIN:
        module, _, attribute = value.partition(":")
        target = getattr(importlib.import_module(module), attribute)
    else:
        target = EntryPoint(name, value, ENTRY_POINT_GROUP).load()
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise TypeError(f"environment {name!r} ({value}) is not an Environment subclass")
    return target


def make_environment(name: str, context: EnvironmentContext) -> Environment:
    """A new environment ``name`` (one per episode)."""
    return environment_class(name)(context)


def tool_format(config: EnvironmentConfig, tokenizer: object = None) -> ToolFormat:
    """The tool-call format of ``config`` (``tool_format``, "auto" read from ``tokenizer``)
    for its environment's tool (the name JSON calls use)."""
    from megatron_rl.environments.formats import format_for

    return format_for(config.tool_format, tokenizer, environment_class(config.name).tool_name)


def template_kwargs(config: EnvironmentConfig, tokenizer: object = None) -> dict:
    """The chat-template arguments that offer ``config``'s tool in a prompt
    (``ToolFormat.template_kwargs`` of its format, with its environment's tool schema)."""
    schema = environment_class(config.name).tool_schema()
    return tool_format(config, tokenizer).template_kwargs(schema)
