"""``code_feedback``: code with run-and-fix against the problem's public tests.

Public and hidden tests. Code problems carry one list of tests (``data.prompts.Prompt.tests``,
any format of ``rewards.code.parse_problem``). The first ``public_tests`` of them are public
(at most all but one, so that every problem keeps a test the model never sees): a tool call
runs the model's candidate program (the call's code) on them and shows which pass and, for
those that fail, the input, the expected and the actual output. The reward runs every test,
the hidden ones included, through the code reward: the final program is the last fenced
Python block of the model's text (as for single-turn samples), so a candidate that passes
only the public tests is not rewarded.
"""

from __future__ import annotations

import time
from typing import Any

from megatron_rl.environments.protocol import Environment, ToolResult
from megatron_rl.environments.tools import SANDBOX_TIMEOUTS, program_output, truncate_to_tokens
from megatron_rl.rewards import literals
from megatron_rl.rewards.code import CodeProblem, outputs_match, parse_problem, values_match
from megatron_rl.rewards.sandbox import ProgramSession, SandboxResult

# Longest input / expected / actual text shown for one failed test (the token limit then
# applies to the whole feedback).
_SHOWN_CHARS = 400


def public_split(reference: Any, public_tests: int) -> tuple[CodeProblem, CodeProblem]:
    """(public, hidden) tests of a code problem's reference: the first ``min(public_tests,
    n - 1)`` tests are public, the rest hidden. ValueError for tests that cannot be read."""
    problem = parse_problem(reference)
    count = min(public_tests, len(problem.tests) - 1)
    public = CodeProblem(problem.tests[:count], problem.compare)
    hidden = CodeProblem(problem.tests[count:], problem.compare)
    return public, hidden


def _shown(text: str) -> str:
    text = text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
    return text.rstrip("\n")


class CodeFeedbackEnvironment(Environment):
    """Runs the model's candidate on the public tests; the reward runs all of them."""

    tool_name = "run_tests"
    tool_description = (
        "Run a candidate solution (a complete Python program) on the problem's public tests "
        "and return which pass and, for each failure, the input, expected and actual output."
    )

    def reset(self, problem: Any) -> str:
        text = super().reset(problem)
        self.public, _ = public_split(problem.reference, self.context.config.public_tests)
        return text

    def run(self, code: str) -> ToolResult:
        config = self.context.sandbox_config()
        tests = self.public.tests
        if not tests:
            return ToolResult("error", "Error: this problem has no public tests to run\n")
        started = time.monotonic()
        lines: list[str] = []
        passed, outcome = 0, "ok"
        with ProgramSession(code, config, max_tests=len(tests)) as session:
            for i, case in enumerate(tests, 1):
                if case.fn_name is None:
                    result = session.run(case.input)
                else:
                    result = session.run(literals.encode(case.arguments()), case.fn_name)
                verdict, detail = self._verdict(result, case)
                passed += verdict == "passed"
                if verdict == "timed out":
                    outcome = "timeout"
                elif verdict == "error" and outcome == "ok":
                    outcome = "error"
                lines.append(f"Test {i}: {verdict}")
                if verdict != "passed":
                    lines.append(f"  input: {_shown(case.input)}")
                    lines.append(f"  expected: {_shown(case.output)}")
                    lines += [f"  {line}" for line in detail]
        text = f"Passed {passed} of {len(tests)} public tests.\n" + "\n".join(lines) + "\n"
        text, cut = truncate_to_tokens(
            text, self.context.config.max_tool_output_tokens, self.context.tokenizer
        )
        if cut and outcome == "ok":
            outcome = "truncated"
        return ToolResult(outcome, text, time.monotonic() - started)

    def _verdict(self, result: SandboxResult, case: Any) -> tuple[str, list[str]]:
        """("passed" | "failed" | "error" | "timed out", lines of detail)."""
        if result.status in SANDBOX_TIMEOUTS:
            return "timed out", [f"stopped after {self.context.config.tool_timeout_s:g} s"]
        if result.status != "ok":
            return "error", [f"output: {_shown(program_output(result))}"]
        if case.fn_name is None:
            if outputs_match(result.stdout, case.output, self.public.compare):
                return "passed", []
            return "failed", [f"got: {_shown(result.stdout)}"]
        expected = case.expected()
        options = case.options(self.public.compare)
        if values_match(result.result, expected, options, case.encoding, case.match):
            return "passed", []
        return "failed", [f"got: {_shown(repr(result.result))}"]
