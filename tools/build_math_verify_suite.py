"""Convert Math-Verify's own test cases into realistic responses (tests/data/math_verify_suite.jsonl).

Source: https://github.com/huggingface/Math-Verify (Apache-2.0). Its tests are
``(gold, prediction, expected)`` triples checked with ``parse`` + ``verify``. Each becomes a
reference (the gold, verbatim) and a response:

- a prediction that is only an answer (math, no prose) goes into ``\\boxed{}`` after a
  ``<think>`` block, as a reasoning model would write it;
- a prediction that is prose (or already holds a ``\\boxed{}``) is kept verbatim after a
  ``<think>`` block (verbatim when it has its own ``</think>``).

Cases that ask ``verify`` for options our reward does not use (another float precision,
``strict=False``, ``allow_set_relation_comp=True``) are left out; string-choice, timeout
and config tests are not answer-equivalence cases. ``answer_form`` says whether the
response carries a ``\\boxed{}`` answer ("boxed"), an answer stated after the word "answer"
("stated"), or neither ("none").

Usage: python tools/build_math_verify_suite.py GIT_DIR [--out tests/data/math_verify_suite.jsonl]
(GIT_DIR: a clone or mirror of huggingface/Math-Verify; HEAD is converted).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPOSITORY = "https://github.com/huggingface/Math-Verify"
THINK = "<think>\nLet me work through the problem step by step and check the result.\n</think>\n\n"
# Test functions of Math-Verify whose cases are answer comparisons, and how each calls
# compare_strings (None: parse/verify with Math-Verify's defaults).
MODULES = (
    "test_all",
    "test_boxed",
    "test_numina_cases",
    "test_open_thoughts",
    "test_strict",
    "test_yujianll",
)
DEFAULT_OPTIONS = {"precision": 6, "strict": True, "allow_set_relation_comp": False}
_OPTION_RE = re.compile(r"(precision|strict|allow_set_relation_comp)\s*=\s*(\w+)")
_MATH_SPAN_RE = re.compile(r"\$\$.*?\$\$|\\\[.*?\\\]|\\\(.*?\\\)|\$[^$]*\$", re.DOTALL)
_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_ANSWER_WORD_RE = re.compile(r"(?i)\banswer\b")


def _export_tests(git_dir: str, into: Path) -> str:
    commit = subprocess.run(
        ["git", "--git-dir", git_dir, "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "--git-dir", git_dir, "archive", "HEAD", "tests"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


def _options(function) -> dict | None:
    """compare_strings' keyword options in a test's body (literal ones), None if it has none."""
    import inspect

    source = inspect.getsource(function)
    if "compare_strings" not in source:
        return None
    found = dict(_OPTION_RE.findall(source.split("compare_strings", 1)[1]))
    options = {}
    for key, value in found.items():
        options[key] = value  # a literal or the name of a parameter
    return options


def _cases(module_name: str):
    module = importlib.import_module(f"tests.{module_name}")
    for name in sorted(dir(module)):
        function = getattr(module, name)
        if not name.startswith("test_") or not callable(function):
            continue
        marks = [m for m in getattr(function, "pytestmark", []) if m.name == "parametrize"]
        if not marks:
            continue
        argnames, argvalues = marks[0].args[:2]
        if isinstance(argnames, str):
            argnames = [a.strip() for a in argnames.split(",")]
        options = _options(function)
        for index, values in enumerate(argvalues):
            row = dict(zip(argnames, values))
            expected = row.get("expected", row.get("result"))
            resolved = dict(DEFAULT_OPTIONS)
            for key, value in (options or {}).items():
                literal = row.get(value, value)
                resolved[key] = {"True": True, "False": False}.get(literal, literal)
                if isinstance(resolved[key], str) and resolved[key].isdigit():
                    resolved[key] = int(resolved[key])
            for key in DEFAULT_OPTIONS:
                if key in row:
                    resolved[key] = row[key]
            yield {
                "id": f"{module_name}.py::{name}[{index}]",
                "gold": row["gold"],
                "prediction": row["pred"],
                "expected": int(expected),
                "options": resolved,
            }


def _is_answer_only(prediction: str) -> bool:
    if "\\boxed" in prediction or "\\fbox" in prediction or "</think>" in prediction:
        return False
    outside = _MATH_SPAN_RE.sub(" ", prediction)
    return len(prediction) <= 200 and not _WORD_RE.search(outside)


def _strip_delimiters(prediction: str) -> str:
    """The answer without its math delimiters: ``$28$ %`` -> ``28 %``."""

    def inner(span: re.Match) -> str:
        text = span.group(0)
        for opener, closer in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
            if text.startswith(opener) and text.endswith(closer):
                return text[len(opener) : -len(closer)]
        return text

    return _MATH_SPAN_RE.sub(inner, prediction).strip().strip("$").strip()


def to_response(prediction: str) -> tuple[str, str]:
    """(response, conversion) of one Math-Verify prediction."""
    if "</think>" in prediction:
        return prediction, "verbatim"
    if _is_answer_only(prediction):
        answer = _strip_delimiters(prediction)
        return f"{THINK}The final answer is $\\boxed{{{answer}}}$.", "boxed"
    return THINK + prediction, "prose"


def answer_form(response: str) -> str:
    """ "boxed", "stated" or "none": how the text after the thinking gives its answer."""
    section = response[response.rfind("</think>") + len("</think>") :]
    if "\\boxed" in section or "\\fbox" in section:
        return "boxed"
    return "stated" if _ANSWER_WORD_RE.search(section) else "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("git_dir")
    parser.add_argument("--out", default="tests/data/math_verify_suite.jsonl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        commit = _export_tests(args.git_dir, Path(tmp))
        sys.path.insert(0, tmp)
        rows, skipped = [], []
        for module_name in MODULES:
            for case in _cases(module_name):
                if case["options"] != DEFAULT_OPTIONS:
                    skipped.append(case["id"])
                    continue
                response, conversion = to_response(case["prediction"])
                rows.append(
                    {
                        "id": case["id"],
                        "reference": case["gold"],
                        "response": response,
                        "expected": case["expected"],
                        "conversion": conversion,
                        "answer_form": answer_form(response),
                    }
                )
    header = {
        "source": REPOSITORY,
        "license": "Apache-2.0",
        "commit": commit,
        "files": [f"tests/{m}.py" for m in MODULES],
        "cases": len(rows),
        "left_out_for_non_default_options": skipped,
        "built_by": "tools/build_math_verify_suite.py",
    }
    with open(args.out, "w") as f:
        f.write("# " + json.dumps(header) + "\n")
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    forms = {k: sum(r["answer_form"] == k for r in rows) for k in ("boxed", "stated", "none")}
    print(
        f"{len(rows)} cases ({len(skipped)} left out for non-default options): {forms} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
