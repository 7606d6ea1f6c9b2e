"""Recipe-facing configuration of a multi-turn environment (``rollout.environment``; imports
no torch). ``rollout.max_turns`` (in ``RolloutConfig``) says how many model turns an episode
may have; an environment is used when it is above 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.config.errors import ConfigError


@dataclass
class EnvironmentConfig:
    """The environment of multi-turn rollouts and the limits of its tool.

    Attributes:
        name: a registered environment (``megatron_rl.environments.registry``: the built-ins
            ``python_tool`` and ``code_feedback``, or a package's ``megatron_rl.environments``
            entry point); empty: single-turn rollouts.
        tool_format: how the model writes a tool call: "llama3" (Llama-3.1), "llama4"
            (Llama-4), "qwen", "markdown" (base models) or "auto" (from the tokenizer:
            ``formats.detect_format``; refused at load for a tokenizer of no known family,
            e.g. a preset's character tokenizer: name the format then).
        max_tool_output_tokens: a tool's output is cut to this many tokens (its head and
            tail, with a marker saying how many were left out) before it is appended.
        tool_timeout_s: wall-clock limit of one program run of a tool call (the sandbox's
            CPU-time limit follows it); ``code_feedback`` runs one per public test.
        tool_memory_mb: address-space limit of the tool's program.
        tool_max_output_bytes: size limit of the program's output (and of its files), before
            the token limit; a program that writes more is cut there.
        public_tests: ``code_feedback``: how many of a problem's tests the model may run its
            candidate on (the first ones; at least one test always stays hidden).
        tool_workers: tool calls running at the same time (each in its own sandbox).
    """

    name: str = ""
    tool_format: str = "auto"
    max_tool_output_tokens: int = 512
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 512
    tool_max_output_bytes: int = 64 * 1024
    public_tests: int = 3
    tool_workers: int = 4

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        from megatron_rl.environments.formats import TOOL_FORMATS
        from megatron_rl.environments.registry import available

        if not isinstance(self.name, str):
            raise ConfigError("name", f"must be a string, got {self.name!r}")
        if self.name and self.name not in available():
            raise ConfigError(
                "name",
                f"unknown environment {self.name!r}; registered: {', '.join(available())}",
            )
        if self.tool_format not in TOOL_FORMATS:
            raise ConfigError(
                "tool_format", f"must be one of {list(TOOL_FORMATS)}, got {self.tool_format!r}"
            )
        for name in ("max_tool_output_tokens", "tool_memory_mb", "tool_max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")
        for name in ("public_tests", "tool_workers"):
            value = getattr(self, name)
            minimum = 0 if name == "public_tests" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(name, f"must be an int >= {minimum}, got {value!r}")
        timeout = self.tool_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or not 0 < timeout <= 3600
        ):
            raise ConfigError(
                "tool_timeout_s", f"must be a number of seconds in (0, 3600], got {timeout!r}"
            )
