"""Code reward (DeepCoder-style): the response's program must pass every test.

The program is a fenced Python block after the thinking (``select_program``: the last one
that defines the tests' entry point, so that an example-usage block after the solution is not
what is graded). All tests of a program run
in one sandbox (``megatron_rl.rewards.sandbox.ProgramSession``), each with its own time
limit; the first failure, crash or timeout ends the evaluation. Two test kinds:
stdin/stdout (compared under the problem's ``CompareOptions``) and functional (``fn_name``
called with the test's arguments, as a method of ``Solution`` when that class defines it,
else as a function).

Functional values are carried as text in one of two encodings (``CodeTest.encoding``):
"json" (the datasets' JSON: a returned tuple matches an expected list, dict keys compare as
strings, as JSON would store them) or "python" (``ast.literal_eval``-safe literals, exact
types: tuples, sets, non-string keys; see ``megatron_rl.rewards.literals``). Nothing is
ever ``eval``-ed, and nothing of the program's (its objects' ``__eq__`` or ``__bool__``) is
ever called in the trainer: results cross the sandbox as literals.

Numbers: integers (stdout tokens of ASCII digits, returned ints) compare exactly; only an
inexact expected number (a float, a decimal token) has a tolerance, relative to the expected
value (``CompareOptions``). ``inf`` / ``nan`` never equal a finite expected value, and
Python-only spellings in program output (``1_000``, non-ASCII digits, ``infinity``) are not
numbers.

Accepted test formats (``parse_problem`` / ``parse_tests``):

- the data loaders' wrapper ``{"tests": <any format>, "fn_name": name, "compare": {...},
  "special_judge": bool}`` (only "tests" is required);
- canonical (``CodeTest.to_dict``, what ``CodeProblem.to_dict`` stores): a list of
  ``{"input", "output", "fn_name", "encoding"}``; for a functional test ``input`` is the
  whole argument list (one literal, or a JSON array) and ``output`` the returned value;
- LiveCodeBench / DeepCoder: lists of ``{"input", "output", "testtype", "metadata"}``
  (functional ``input``: one JSON value per line, one line per argument);
- PrimeIntellect / DeepCoder: lists of ``{"input", "output", "type": "function_call" |
  "stdin_stdout", "fn_name"}`` (functional ``input``: a JSON array of the arguments);
- TACO / APPS columns ``{"inputs": [...], "outputs": [...], "fn_name"?}``;
- MBPP (``megatron_rl.rewards.mbpp``): a list of assert lines, ``assert f(1, (2, 3)) == {4: 5}``,
  ``assert math.isclose(f(2.0), 12.56, rel_tol=0.001)``, ``assert f(x)`` / ``assert not
  f(x)`` (literal arguments and expectations only; "python" encoding);
- JSON strings of any of these.

Special-judge problems (several valid outputs, ``"special_judge": true`` or a
``"checker"``) are refused with ``SpecialJudgeError``: scoring them by comparison would
mark right answers wrong. The data loaders drop them with a count.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field, fields
from decimal import Decimal
from typing import Any

from megatron_rl.rewards import literals
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.extraction import PYTHON_TAGS, answer_section, extract_code, fenced_blocks
from megatron_rl.rewards.mbpp import line_tolerance, parse_asserts
from megatron_rl.rewards.sandbox import ProgramSession

logger = logging.getLogger(__name__)

_FUNCTIONAL_TYPES = ("functional", "function_call", "call_based")
_ENCODINGS = ("json", "python")
_WHITESPACE = ("tokens", "lines", "exact")
# How a functional test's returned value is checked (``CodeTest.match``).
_MATCHES = ("equal", "equal_or_only_element", "is", "truthy", "falsy")
# A number in program output: ASCII digits only (Python's float() also reads "1_000",
# non-ASCII digits, "infinity" and "nan", which no judge reads as numbers); exponents of at
# most 4 digits (beyond that no judge's answer is written so, and Decimal arithmetic would
# overflow).
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,4})?")
_INTEGER_RE = re.compile(r"[+-]?[0-9]+")
# Digits with a leading zero ("0011", "007", "09", "05.50"): a binary string, a padded
# number, a time; the zeros are part of the answer, so only the same text matches.
_ZERO_PADDED_RE = re.compile(r"[+-]?0[0-9]+(?:\.[0-9]*)?")


class SpecialJudgeError(ValueError):
    """The problem needs its own checker (several valid outputs): not scorable by comparison."""


@dataclass(frozen=True)
class CompareOptions:
    """How outputs are compared (per problem, ``"compare"`` in the test data).

    Defaults follow the default checkers of Codeforces (testlib ``wcmp``) and AtCoder:
    whitespace-insensitive tokens, case-sensitive. ICPC-style problem packages (Kattis,
    DOMjudge) compare case-insensitively by default: their data sets
    ``case_sensitive: false``.

    Attributes:
        float_abs_tol / float_rel_tol: two numeric tokens (or returned numbers) match when
            either error is within its tolerance (``math.isclose``); 0 / 0: exact.
        case_sensitive: letters must match in case (stdin/stdout tests).
        whitespace: "tokens" (any whitespace between tokens), "lines" (the same lines,
            tokens within each line; trailing spaces and blank lines at the end ignored) or
            "exact" (the same text up to a final newline).
    """

    float_abs_tol: float = 1e-6
    float_rel_tol: float = 1e-6
    case_sensitive: bool = True
    whitespace: str = "tokens"

    @classmethod
    def from_dict(cls, raw: Any) -> CompareOptions:
        """Options from test data; ValueError naming the bad key."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"compare must be a dict, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"compare has unknown keys {unknown} (known: {sorted(known)})")
        options = cls(**raw)
        for name in ("float_abs_tol", "float_rel_tol"):
            value = getattr(options, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"compare.{name} must be a number >= 0, got {value!r}")
        if not isinstance(options.case_sensitive, bool):
            raise ValueError(
                f"compare.case_sensitive must be a bool, got {options.case_sensitive!r}"
            )
        if options.whitespace not in _WHITESPACE:
            raise ValueError(
                f"compare.whitespace must be one of {_WHITESPACE}, got {options.whitespace!r}"
            )
        return options

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CodeTest:
    """One test. Functional tests (``fn_name`` set) hold text in ``encoding``: ``input`` the
    argument list, ``output`` the returned value, and ``match`` says how the returned value
    is checked against it:

    - "equal": equal under ``values_match`` (LiveCodeBench's grader: ``prediction ==
      gt_out``, lcb_runner/evaluation/testing_util.py ``grade_call_based``);
    - "equal_or_only_element": equal, or equal to the only element of an expected
      one-element list (TACO / APPS / PrimeIntellect, whose call-based grader also accepts
      ``exec_outputs == outputs[0]``: rllm/rewards/code_utils/taco.py ``execute_cb_code``,
      which PrimeIntellect rows are converted to in rllm/rewards/code_reward.py; its check
      of ``outputs[0]`` for longer lists is not followed: that pays a list's first element);
    - "is": MBPP's ``assert f(x) is True`` (None / True / False themselves only: 1 is not
      True);
    - "truthy" / "falsy": MBPP's ``assert f(x)`` / ``assert not f(x)`` (a returned literal's
      truth value; a value with no literal, whose truth the program would define, fails).
    """

    input: str
    output: str
    fn_name: str | None = None
    encoding: str = "json"
    match: str = "equal"
    # This test's own float tolerance (``CompareOptions``' float_rel_tol / float_abs_tol),
    # over the problem's: an MBPP ``math.isclose`` line's, which its ``==`` lines do not get.
    tolerance: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form; ``parse_tests`` reads it back to an equal test."""
        raw = asdict(self)
        if raw["tolerance"] is None:
            del raw["tolerance"]
        return raw

    def options(self, compare: CompareOptions) -> CompareOptions:
        """The comparison of this test in a problem compared under ``compare``."""
        if not self.tolerance:
            return compare
        return CompareOptions.from_dict({**compare.to_dict(), **self.tolerance})

    def arguments(self) -> list[Any]:
        """The functional test's positional arguments."""
        args = _decode(self.input, self.encoding)
        if not isinstance(args, (list, tuple)):
            raise ValueError(
                f"functional test input must be a list of arguments: {self.input!r:.200}"
            )
        return list(args)

    def expected(self) -> Any:
        """The functional test's expected return value."""
        return _decode(self.output, self.encoding)


@dataclass(frozen=True)
class CodeProblem:
    """The tests of one problem and how to compare outputs."""

    tests: list[CodeTest]
    compare: CompareOptions = field(default_factory=CompareOptions)

    def to_dict(self) -> dict[str, Any]:
        """The canonical wrapper form (``parse_problem`` reads it back to an equal problem)."""
        return {"tests": [t.to_dict() for t in self.tests], "compare": self.compare.to_dict()}


def _decode(text: str, encoding: str) -> Any:
    if encoding == "json":
        try:
            return json.loads(text)
        except ValueError:
            pass  # e.g. text written by a Python-literal source
    return literals.decode(text)


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


def _json_args(raw: Any) -> str:
    if isinstance(raw, list):
        return json.dumps(raw)
    # LiveCodeBench: one JSON value per line, one line per argument.
    return json.dumps([json.loads(line) for line in str(raw).split("\n") if line.strip()])


def _json_value(raw: Any) -> str:
    if isinstance(raw, str):
        try:
            json.loads(raw)
            return raw
        except ValueError:
            return json.dumps(raw)  # a bare string answer
    return json.dumps(raw)


def _canonical(test: dict[str, Any], name: str) -> CodeTest:
    """A canonical functional test: ``input`` is the whole argument list."""
    encoding = test.get("encoding", "json")
    if encoding not in _ENCODINGS:
        raise ValueError(f"encoding must be one of {_ENCODINGS}, got {encoding!r}")
    match = test.get("match", "equal")
    if match not in _MATCHES:
        raise ValueError(f"match must be one of {_MATCHES}, got {match!r}")
    raw_in, raw_out = test["input"], test["output"]
    if encoding == "json":
        args = raw_in if isinstance(raw_in, str) else json.dumps(raw_in)
        if isinstance(raw_in, str) and "\n" in raw_in.strip():
            try:
                json.loads(raw_in)
            except ValueError:
                # Not one JSON value: LiveCodeBench's one argument per line, without its
                # "testtype" (no single-value reading of the text exists to confuse it with).
                args = _json_args(raw_in)
        case = CodeTest(args, _json_value(raw_out), name, "json", match)
    else:
        if not isinstance(raw_in, str) or not isinstance(raw_out, str):
            raise ValueError("a 'python' test holds its input and output as literal text")
        tolerance = test.get("tolerance")
        if tolerance is not None:
            known = {"float_rel_tol", "float_abs_tol"}
            if not isinstance(tolerance, dict) or not set(tolerance) <= known:
                raise ValueError(f"tolerance must be a dict of {sorted(known)}: {tolerance!r}")
            CompareOptions.from_dict(tolerance)  # the values' checks
        case = CodeTest(raw_in, raw_out, name, "python", match, tolerance or None)
    case.arguments()  # fails here, at parse time, on a malformed input
    return case


def _from_list(tests: list[Any], fn_name: str | None) -> list[CodeTest]:
    if tests and all(isinstance(t, str) for t in tests):
        return [
            CodeTest(args, out, name, "python", match, line_tolerance(line) or None)
            for (name, args, out, match), line in zip(parse_asserts(tests), tests)
        ]
    cases = []
    for i, test in enumerate(tests):
        if not isinstance(test, dict) or "input" not in test or "output" not in test:
            raise ValueError(
                f"test {i} must be a dict with 'input' and 'output', got {test!r:.200}"
            )
        kind = str(test.get("testtype") or test.get("type") or "")
        name = _metadata_fn_name(test) or fn_name
        try:
            if kind in _FUNCTIONAL_TYPES:
                if not name:
                    raise ValueError("no function name")
                args, output = _json_args(test["input"]), _json_value(test["output"])
                # LiveCodeBench's "functional" compares exactly; PrimeIntellect's
                # "function_call" and TACO's "call_based" are graded by TACO's grader.
                match = "equal" if kind == "functional" else "equal_or_only_element"
                cases.append(CodeTest(args, output, name, "json", match))
            elif not kind and test.get("fn_name"):
                cases.append(_canonical(test, str(test["fn_name"])))
            else:
                cases.append(CodeTest(_as_text(test["input"]), _as_text(test["output"])))
        except ValueError as exc:
            raise ValueError(f"test {i}: {exc}") from exc
    return cases


def _from_columns(tests: dict[str, Any], fn_name: str | None) -> list[CodeTest]:
    inputs, outputs = tests["inputs"], tests["outputs"]
    if len(inputs) != len(outputs):
        raise ValueError(f"tests have {len(inputs)} inputs but {len(outputs)} outputs")
    name = tests.get("fn_name") or fn_name
    if name:
        # TACO / APPS: graded by TACO's call-based grader (see ``CodeTest``).
        return [
            CodeTest(_json_args(i), _json_value(o), str(name), "json", "equal_or_only_element")
            for i, o in zip(inputs, outputs)
        ]
    return [CodeTest(_as_text(i), _as_text(o)) for i, o in zip(inputs, outputs)]


def needs_special_judge(tests: Any) -> bool:
    """Whether test data declares a special judge (``special_judge`` true or a ``checker``),
    in the wrapper or in the tests dict; False for data that cannot be read."""
    if isinstance(tests, str):
        if '"special_judge"' not in tests and '"checker"' not in tests:
            return False  # the common case, without parsing a large test file
        try:
            tests = json.loads(tests)
        except ValueError:
            return False
    if not isinstance(tests, dict):
        return False
    if tests.get("special_judge") or tests.get("checker"):
        return True
    return "tests" in tests and needs_special_judge(tests["tests"])


def parse_problem(tests: Any, fn_name: str | None = None) -> CodeProblem:
    """Normalise the test formats listed in the module docstring; ValueError when unknown,
    ``SpecialJudgeError`` when the problem needs its own checker."""
    return _parse(tests, fn_name, None)


def _parse(tests: Any, fn_name: str | None, compare: Any) -> CodeProblem:
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise ValueError(f"tests are not valid JSON: {exc}") from exc
    if isinstance(tests, dict) and (tests.get("special_judge") or tests.get("checker")):
        raise SpecialJudgeError(
            "the problem needs a special judge (several valid outputs); it cannot be scored "
            "by comparing outputs (the data loaders drop such problems)"
        )
    if isinstance(tests, dict) and "compare" in tests:
        compare = tests["compare"]
    if isinstance(tests, dict) and "tests" in tests:
        # The data loaders' reference: {"tests": raw tests, "fn_name": name or None, ...}.
        return _parse(tests["tests"], tests.get("fn_name") or fn_name, compare)
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        cases = _from_columns(tests, fn_name)
    elif isinstance(tests, list):
        cases = _from_list(tests, fn_name)
    else:
        raise ValueError(f"unknown test format: {type(tests).__name__} {str(tests)[:200]!r}")
    if not cases:
        raise ValueError("no tests")
    for i, case in enumerate(cases):
        if case.fn_name is not None:
            try:
                literals.encode(case.arguments())
                case.expected()
            except ValueError as exc:
                raise ValueError(f"test {i}: {exc}") from exc
    return CodeProblem(cases, CompareOptions.from_dict(compare))


def parse_tests(tests: Any, fn_name: str | None = None) -> list[CodeTest]:
    """The tests of ``parse_problem(tests, fn_name)``."""
    return parse_problem(tests, fn_name).tests


def _within(got: float, want: float, options: CompareOptions) -> bool:
    """Finite ``got`` within the tolerance of the expected, finite and inexact, ``want``
    (relative to ``want``, or absolute)."""
    bound = max(options.float_rel_tol * abs(want), options.float_abs_tol)
    return math.isfinite(got) and abs(got - want) <= bound


def _tokens_equal(got: str, want: str, options: CompareOptions) -> bool:
    if got == want or (not options.case_sensitive and got.lower() == want.lower()):
        return True
    if not (_NUMBER_RE.fullmatch(got) and _NUMBER_RE.fullmatch(want)):
        return False
    if _ZERO_PADDED_RE.fullmatch(want):
        return False  # "11" is not "0011" (not equal as text, checked above)
    if Decimal(got) == Decimal(want):  # exact at any length (no int() digit limit)
        return True
    if _INTEGER_RE.fullmatch(want):
        return False  # an integer answer is exact
    expected = float(want)
    return math.isfinite(expected) and _within(float(got), expected, options)


def _tokens_match(got: list[str], want: list[str], options: CompareOptions) -> bool:
    return len(got) == len(want) and all(_tokens_equal(g, w, options) for g, w in zip(got, want))


def outputs_match(actual: str, expected: str, options: CompareOptions | None = None) -> bool:
    """Stdout comparison under ``options`` (default ``CompareOptions()``): tokens equal
    (case as configured), or numbers equal: exactly where the expected token is an integer,
    within the float tolerance where it is inexact (see the module docstring)."""
    options = options or CompareOptions()
    if options.whitespace == "exact":
        if not options.case_sensitive:
            actual, expected = actual.lower(), expected.lower()
        return actual.removesuffix("\n") == expected.removesuffix("\n")
    if options.whitespace == "lines":
        got = actual.rstrip().splitlines()
        want = expected.rstrip().splitlines()
        return len(got) == len(want) and all(
            _tokens_match(g.split(), w.split(), options) for g, w in zip(got, want)
        )
    return _tokens_match(actual.split(), expected.split(), options)


def values_match(
    actual: Any,
    expected: Any,
    options: CompareOptions | None = None,
    encoding: str = "json",
    match: str = "equal",
) -> bool:
    """Functional comparison of a returned value (a decoded literal, or ``Unrepresentable``)
    with the expected one, as ``match`` says (``CodeTest.match``). "json": the returned value
    as JSON would store it (tuples as lists, keys as strings) equals the expected one.
    "python": Python's ``==`` (a tuple never equals a list). Numbers: ints exactly, an
    expected float within the float tolerance."""
    options = options or CompareOptions()
    try:
        return _values_match(actual, expected, options, encoding, match)
    except RecursionError:  # nested deeper than the comparison can go: no verdict to pay
        return False


def _values_match(
    actual: Any, expected: Any, options: CompareOptions, encoding: str, match: str
) -> bool:
    if match in ("is", "truthy", "falsy"):
        if not isinstance(actual, _LITERAL_TYPES):
            return False  # no literal: its truth would be the program's own __bool__
        if match == "is":
            return type(actual) is type(expected) and actual == expected
        return bool(actual) == (match == "truthy")
    if encoding == "python":
        return _equal(actual, expected, options, strict_bool=False)
    try:
        actual = json.loads(json.dumps(actual, default=_json_default))
    except (TypeError, ValueError, RecursionError):
        return False  # no JSON form (tuple keys): cannot equal a JSON expectation
    if _equal(actual, expected, options, strict_bool=True):
        return True
    return (
        match == "equal_or_only_element"
        and isinstance(expected, list)
        and len(expected) == 1
        and _equal(actual, expected[0], options, strict_bool=True)
    )


_LITERAL_TYPES = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set)


def _json_default(value: Any) -> Any:
    # A set has no JSON form either: the datasets' graders compare ``set == list`` (False),
    # and a set written as a list in some order (by repr: [10, 9]) matched an expected list
    # that happened to be in that order.
    raise TypeError(f"{type(value).__name__} has no JSON form")


def _numbers_equal(got: int | float, want: int | float, options: CompareOptions) -> bool:
    if got == want:  # exact for ints of any size against ints and floats alike
        return True
    if isinstance(want, int) or not math.isfinite(want):
        return False  # an integer answer is exact; inf / nan only equal themselves
    try:
        got = float(got)
    except OverflowError:  # an int beyond float range: far from any finite float
        return False
    return _within(got, want, options)


def _equal(a: Any, b: Any, options: CompareOptions, strict_bool: bool) -> bool:
    """``a`` (returned) equals ``b`` (expected)."""
    if isinstance(a, bool) or isinstance(b, bool):
        if strict_bool or not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
            return type(a) is type(b) and a == b
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return _numbers_equal(a, b, options)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        same = len(a) == len(b) and isinstance(a, tuple) == isinstance(b, tuple)
        return same and all(_equal(x, y, options, strict_bool) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], options, strict_bool) for k in a)
    return a == b


# Outcomes of a code response (``CodeOutcome.status``); only CORRECT scores correct_reward.
# TIMEOUT_CPU is a verdict (the program is too slow, as a judge's time limit says);
# TIMEOUT_WALL is none (the program waited, or the machine is past its capacity): counted
# apart from wrong answers in the metrics.
CORRECT, WRONG, TIMEOUT_CPU, TIMEOUT_WALL = "correct", "wrong", "timeout_cpu", "timeout_wall"
NO_PROGRAM, BAD_TESTS, ERROR = "no_program", "bad_tests", "error"


@dataclass(frozen=True)
class CodeOutcome:
    """How a program did on its tests.

    Attributes:
        status: CORRECT, WRONG (an output differs, or the program failed), TIMEOUT_CPU,
            TIMEOUT_WALL, ERROR (the sandbox failed), NO_PROGRAM (nothing to run was
            extracted) or BAD_TESTS (the tests cannot be read).
        tests_run: tests started (the first that fails ends the evaluation).
        cpu_s: CPU time of the tests run, as the harness measured it.
        wall_s: wall-clock time of the tests run (starting boxes not counted).
        detail: the failing test's stderr tail or the reason, for diagnostics.
    """

    status: str
    tests_run: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    detail: str = ""


def evaluate_program(
    program: str, problem: CodeProblem | list[CodeTest], config: RewardConfig
) -> CodeOutcome:
    """Run ``program`` on every test of ``problem`` (stops at the first that does not pass)."""
    if not isinstance(problem, CodeProblem):
        problem = CodeProblem(list(problem))
    cpu = wall = 0.0
    with ProgramSession(program, config, max_tests=len(problem.tests)) as session:
        for n, case in enumerate(problem.tests, 1):
            if case.fn_name is None:
                result = session.run(case.input)
            else:
                result = session.run(literals.encode(case.arguments()), case.fn_name)
            cpu += result.cpu_s or 0.0
            wall += result.elapsed_s
            if result.status != "ok":
                status = result.status if result.status in (TIMEOUT_CPU, TIMEOUT_WALL) else WRONG
                status = ERROR if result.status == "error" else status
                return CodeOutcome(status, n, cpu, wall, result.stderr[-500:])
            if case.fn_name is None:
                passed = outputs_match(result.stdout, case.output, problem.compare)
            else:
                options = case.options(problem.compare)
                passed = values_match(
                    result.result, case.expected(), options, case.encoding, case.match
                )
            if not passed:
                return CodeOutcome(WRONG, n, cpu, wall, f"test {n - 1}: output differs")
    return CodeOutcome(CORRECT, len(problem.tests), cpu, wall)


def run_tests(program: str, problem: CodeProblem | list[CodeTest], config: RewardConfig) -> bool:
    """True when ``program`` passes every test (stops at the first failure)."""
    return evaluate_program(program, problem, config).status == CORRECT


# A program that reads its test's input (stdin problems).
_READS_INPUT_RE = re.compile(
    r"\binput\s{0,8}\(|\bstdin\b|\bopen\s{0,8}\(\s{0,8}0\b|\bfileinput\b"
    r"|\bos\s{0,8}\.\s{0,8}read\s{0,8}\(\s{0,8}0\b"
)


def _python_blocks(section: str) -> list[str]:
    """The fenced blocks ``extract_code`` chooses among: the ```python (py, python3) blocks,
    or without any, the untagged ones (other languages never)."""
    blocks = list(fenced_blocks(section))
    tagged = [body for language, body in blocks if language in PYTHON_TAGS]
    return tagged or [body for language, body in blocks if language == ""]


def _defines(block: str, name: str) -> bool:
    """Whether ``block`` defines ``name`` at the start of a line (a def, a class, or an
    assignment), or a method of that name in a ``Solution`` class."""
    names = re.escape(name)
    own = re.compile(rf"(?m)^(?:async\s+)?def\s+{names}\s*\(|^class\s+{names}\b|^{names}\s*=")
    if own.search(block):
        return True
    method = re.compile(rf"(?m)^[ \t]+(?:async\s+)?def\s+{names}\s*\(")
    return re.search(r"(?m)^class\s+Solution\b", block) is not None and bool(method.search(block))


def select_program(response: str, problem: CodeProblem, config: RewardConfig) -> str | None:
    """The block of ``response`` that is graded: among the blocks ``extract_code`` chooses
    from, the last that defines the tests' entry point (functional tests: ``fn_name``; stdin
    tests: the last that reads its input), else the last block (``extract_code``'s choice).
    A solution followed by an example-usage block (``print(solve(3))``, which defines
    nothing) is graded on the solution. None when there is no program (``extract_code``)."""
    last = extract_code(response, config)
    if last is None:
        return None
    section = answer_section(response, config.think_end_tag, config.require_think_end)
    blocks = _python_blocks(section or "")
    names = {case.fn_name for case in problem.tests}
    if None in names:
        chosen = [b for b in blocks if _READS_INPUT_RE.search(b)]
    else:
        chosen = [b for b in blocks if all(_defines(b, name) for name in names)]
    if chosen and chosen[-1].strip() and len(chosen[-1]) <= config.code_max_chars:
        return chosen[-1]
    return last


def code_outcome(response: str, tests: Any, config: RewardConfig) -> CodeOutcome:
    """The outcome of one code response (see ``CodeOutcome``).

    Raises ``SpecialJudgeError`` for a problem that needs its own checker (never scored
    wrong silently: the data loaders drop them)."""
    if extract_code(response, config) is None:
        return CodeOutcome(NO_PROGRAM)
    try:
        problem = parse_problem(tests)
    except SpecialJudgeError:
        raise
    except ValueError as exc:
        logger.warning("unusable tests, scored incorrect: %s", exc)
        return CodeOutcome(BAD_TESTS, detail=str(exc)[:500])
    program = select_program(response, problem, config)
    assert program is not None  # extract_code found one above
    return evaluate_program(program, problem, config)


def score_code(response: str, tests: Any, config: RewardConfig) -> float:
    """Reward of one code response: ``correct_reward`` when all tests pass.

    Raises ``SpecialJudgeError`` for a problem that needs its own checker (never scored
    wrong silently: the data loaders drop them)."""
    outcome = code_outcome(response, tests, config)
    return config.correct_reward if outcome.status == CORRECT else config.incorrect_reward


def score(response: str, tests: Any) -> float:
    """Reward of one code response with the default ``RewardConfig`` (+1 / -1)."""
    return score_code(response, tests, RewardConfig(kind="code"))
