"""MBPP's tests: assert lines read as functional tests, never run.

``assert f(1, (2, 3)) == {4: 5}`` (either side), ``assert f(x) is True`` (``is`` kept: only
the object itself passes, 1 is not True), ``assert f(x)`` / ``assert not f(x)`` (any truthy /
falsy value, as Python's assert) and ``assert math.isclose(f(x), 12.56, rel_tol=0.001)``, with
literal arguments and expectations only (``ast.literal_eval``). Anything else (``set(f(x)) ==
...``, non-literal arguments, ``is`` with anything but None / True / False) is refused with
the line in the error.
"""

from __future__ import annotations

import ast

from megatron_rl.rewards import literals

# ``x is <literal>`` means identity only for these (an int or str literal's identity is an
# interpreter detail).
_SINGLETONS = ("None", "True", "False")


def _literal(node: ast.expr, line: str) -> str:
    try:
        return literals.encode(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, RecursionError) as exc:
        raise ValueError(f"not a literal in {line!r:.200}: {ast.unparse(node)[:100]}") from exc


def _call(node: ast.expr, line: str) -> tuple[str, str] | None:
    """``name(literal, ...)`` as (name, argument list literal); None: not such a call."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords):
        return None
    return node.func.id, _literal(ast.List(elts=node.args, ctx=ast.Load()), line)


def parse_asserts(lines: list[str]) -> list[tuple[str, str, str, str]]:
    """MBPP assert lines as functional tests ``(fn_name, arguments, expected, match)``:
    arguments and expected are Python literals, ``match`` how the returned value is checked
    (``code.CodeTest.match``: "equal", "is", "truthy" or "falsy"); ValueError naming the line
    it cannot read. The float tolerance of a ``math.isclose`` line is ``line_tolerance``'s."""
    cases = []
    for line in lines:
        try:
            statement = ast.parse(line.strip()).body
        except SyntaxError as exc:
            raise ValueError(f"not an assert line: {line!r:.200}") from exc
        if len(statement) != 1 or not isinstance(statement[0], ast.Assert):
            raise ValueError(f"not an assert line: {line!r:.200}")
        test = statement[0].test
        case, expected, match = None, "True", "truthy"
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            case, expected, match = _call(test.operand, line), "False", "falsy"
        elif isinstance(test, ast.Compare) and len(test.ops) == 1:
            left, right = test.left, test.comparators[0]
            if isinstance(test.ops[0], (ast.Eq, ast.Is)):
                match = "is" if isinstance(test.ops[0], ast.Is) else "equal"
                case = _call(left, line)
                if case is not None:
                    expected = _literal(right, line)
                else:
                    case, expected = _call(right, line), _literal(left, line)
                if match == "is" and expected not in _SINGLETONS:
                    raise ValueError(f"'is' compares with None, True or False only: {line!r:.200}")
        elif _isclose(test):
            case, expected, match = _call(test.args[0], line), _literal(test.args[1], line), "equal"
            if _is_int_literal(expected):
                # math.isclose(f(x), 7) holds for 7.000000000000001: an integer written in an
                # isclose is a float reference (an int one compares exactly, and the right
                # float missed). Beyond float range it stays exact.
                try:
                    expected = repr(float(int(expected)))
                except (OverflowError, ValueError):
                    pass
        else:
            case = _call(test, line)
        if case is None:
            raise ValueError(f"unsupported assert (want f(literals) == literal): {line!r:.200}")
        cases.append((case[0], case[1], expected, match))
    return cases


def _is_int_literal(text: str) -> bool:
    body = text[1:] if text.startswith("-") else text
    return body.isdigit() and body.isascii()


def _isclose(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) in ("math.isclose", "isclose")
        and len(node.args) == 2
    )


def line_tolerance(line: str) -> dict[str, float]:
    """The float tolerance of one assert line: a ``math.isclose`` line's ``rel_tol`` /
    ``abs_tol`` (``math.isclose``'s own defaults are rel 1e-9, abs 0), {} for any other line
    (compared under the problem's tolerance). Per line: the loosest isclose of a problem used
    to be its tolerance for every line, so an ``==`` line got an isclose line's ``abs_tol``."""
    test = ast.parse(line.strip()).body[0].test  # type: ignore[attr-defined]
    if not _isclose(test):
        return {}
    found = {"float_rel_tol": 1e-9, "float_abs_tol": 0.0}
    for keyword in test.keywords:
        key = {"rel_tol": "float_rel_tol", "abs_tol": "float_abs_tol"}.get(keyword.arg)
        if key:
            found[key] = float(ast.literal_eval(keyword.value))
    return found
