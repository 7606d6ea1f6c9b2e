"""Code reward (DeepCoder-style): the response's program must pass every test.

The program is the last fenced Python block after the thinking. Each test runs in its own
sandboxed subprocess (``megatron_rl.rewards.sandbox``); the first failure, crash or timeout
ends the evaluation. Two test kinds: stdin/stdout (output compared line by line, then token
by token with a float tolerance) and functional (``fn_name`` called with JSON arguments,
as a method of ``Solution`` when that class defines it, else as a function).

Accepted test formats (``parse_tests``): the data loaders' ``{"tests": ..., "fn_name": ...}``
wrapper around any of the others; the canonical list of ``{"input", "output", "fn_name"}``; LiveCodeBench / DeepCoder lists of ``{"input", "output", "testtype",
"metadata"}``; TACO / APPS dicts ``{"inputs": [...], "outputs": [...], "fn_name"?}``; and
JSON strings of any of these.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.extraction import extract_code
from megatron_rl.rewards.sandbox import run_program

logger = logging.getLogger(__name__)

_FUNCTIONAL_TYPES = ("functional", "function_call", "call_based")


@dataclass(frozen=True)
class CodeTest:
    """One test. Functional tests (``fn_name`` set) hold JSON: ``input`` a list of args."""

    input: str
    output: str
    fn_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form (what the data loaders store as the reference)."""
        return asdict(self)


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _metadata_fn_name(test: dict[str, Any]) -> str | None:
    metadata = test.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except ValueError:
            metadata = {}
    name = test.get("fn_name") or (
        metadata.get("func_name") if isinstance(metadata, dict) else None
    )
    return str(name) if name else None


def _functional_args(raw: Any) -> str:
    if isinstance(raw, list):
        return json.dumps(raw)
    # LiveCodeBench: one JSON value per line, one line per argument.
    return json.dumps([json.loads(line) for line in str(raw).split("\n") if line.strip()])


def _functional_output(raw: Any) -> str:
    if isinstance(raw, str):
        try:
            json.loads(raw)
            return raw
        except ValueError:
            return json.dumps(raw)
    return json.dumps(raw)


def _from_list(tests: list[Any], fn_name: str | None) -> list[CodeTest]:
    cases = []
    for i, test in enumerate(tests):
        if not isinstance(test, dict) or "input" not in test or "output" not in test:
            raise ValueError(
                f"test {i} must be a dict with 'input' and 'output', got {test!r:.200}"
            )
        kind = str(test.get("testtype") or test.get("type") or "")
        name = _metadata_fn_name(test) or fn_name
        if kind in _FUNCTIONAL_TYPES or (not kind and test.get("fn_name")):
            if not name:
                raise ValueError(f"functional test {i} has no function name")
            args, output = _functional_args(test["input"]), _functional_output(test["output"])
            cases.append(CodeTest(args, output, name))
        else:
            cases.append(CodeTest(_as_text(test["input"]), _as_text(test["output"])))
    return cases


def _from_columns(tests: dict[str, Any], fn_name: str | None) -> list[CodeTest]:
    inputs, outputs = tests["inputs"], tests["outputs"]
    if len(inputs) != len(outputs):
        raise ValueError(f"tests have {len(inputs)} inputs but {len(outputs)} outputs")
    name = tests.get("fn_name") or fn_name
    if name:
        return [
            CodeTest(_functional_args(i), _functional_output(o), str(name))
            for i, o in zip(inputs, outputs)
        ]
    return [CodeTest(_as_text(i), _as_text(o)) for i, o in zip(inputs, outputs)]


def parse_tests(tests: Any, fn_name: str | None = None) -> list[CodeTest]:
    """Normalise the test formats listed in the module docstring; ValueError when unknown."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise ValueError(f"tests are not valid JSON: {exc}") from exc
    if isinstance(tests, dict) and "tests" in tests:
        # The data loaders' reference: {"tests": raw tests, "fn_name": name or None}.
        return parse_tests(tests["tests"], tests.get("fn_name") or fn_name)
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        cases = _from_columns(tests, fn_name)
    elif isinstance(tests, list):
        cases = _from_list(tests, fn_name)
    else:
        raise ValueError(f"unknown test format: {type(tests).__name__} {str(tests)[:200]!r}")
    if not cases:
        raise ValueError("no tests")
    return cases


def _close(a: str, b: str) -> bool:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)


def outputs_match(actual: str, expected: str) -> bool:
    """Stdout comparison: equal lines (trailing spaces and blank tail ignored), else equal
    whitespace-separated tokens where numbers may differ by 1e-6."""
    lines = [line.rstrip() for line in actual.strip().splitlines()]
    if lines == [line.rstrip() for line in expected.strip().splitlines()]:
        return True
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(g == w or _close(g, w) for g, w in zip(got, want))


def values_match(actual: Any, expected: Any) -> bool:
    """Functional comparison (JSON values): equal, numbers within 1e-6, or the expected
    value wrapped in a one-element list (APPS convention)."""
    if _values_equal(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_equal(actual, expected[0])


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    return a == b


def run_tests(program: str, cases: list[CodeTest], config: RewardConfig) -> bool:
    """True when ``program`` passes every test (stops at the first failure)."""
    for case in cases:
        result = run_program(program, case.input, config, fn_name=case.fn_name)
        if result.status != "ok":
            return False
        if case.fn_name is None:
            passed = outputs_match(result.stdout, case.output)
        else:
            passed = values_match(result.result, json.loads(case.output))
        if not passed:
            return False
    return True


def score_code(response: str, tests: Any, config: RewardConfig) -> float:
    """Reward of one code response: ``correct_reward`` when all tests pass."""
    program = extract_code(response, config)
    if program is None:
        return config.incorrect_reward
    try:
        cases = parse_tests(tests)
    except ValueError as exc:
        logger.warning("unusable tests, scored incorrect: %s", exc)
        return config.incorrect_reward
    return config.correct_reward if run_tests(program, cases, config) else config.incorrect_reward


def score(response: str, tests: Any) -> float:
    """Reward of one code response with the default ``RewardConfig`` (+1 / -1)."""
    return score_code(response, tests, RewardConfig(kind="code"))
