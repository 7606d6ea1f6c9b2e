"""``python_tool``: math with a Python interpreter (tool-integrated reasoning).

Each call runs the model's code as a fresh script in its own sandbox box (nothing carries over
between calls: a call that needs an earlier result recomputes it, or the model copies the
printed value); the model is shown its stdout and stderr, cut to
``max_tool_output_tokens``. The episode's reward is the math reward of the model's own text
(tool output excluded) against the problem's answer.
"""

from __future__ import annotations

from megatron_rl.environments.protocol import Environment, ToolResult
from megatron_rl.environments.tools import run_python


class PythonToolEnvironment(Environment):
    """Runs the model's Python; scores its final answer with the math reward."""

    tool_name = "python"

    def run(self, code: str) -> ToolResult:
        context = self.context
        return run_python(
            code,
            context.sandbox_config(),
            context.config.max_tool_output_tokens,
            context.tokenizer,
        )
