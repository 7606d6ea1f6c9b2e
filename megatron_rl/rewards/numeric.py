"""Numbers as the math reward compares them, in place of Math-Verify's numeric rule.

Math-Verify (``math_verify.grader.sympy_numeric_eq``) rounds both numbers to 6 decimals when
one is a float, so ``0.0`` equalled every reference below 5e-7 (14 of 272 real Minerva
references accept it), and compares floats at 15 digits, so ``1.0\\times10^{17}`` equalled
100000000000000007. Here integers and exact rationals compare exactly, and a tolerance is
relative to the reference's magnitude and applies only where the reference is inexact (a
decimal). An answer's variables must be the reference's (``new_variables``: ``7 + 0x`` is
not 7). ``install_numeric_rule`` puts the rules into Math-Verify's grader; it runs in the
reward workers (``megatron_rl.rewards.math.verify``), under their CPU-time limit.
"""

from __future__ import annotations

from typing import Any

_NUMERIC_RULE_INSTALLED = False
# How far an answer may be from an inexact (decimal) reference, relative to the reference.
_RELATIVE_TOLERANCE = 1e-6


def numbers_equal(gold: Any, pred: Any) -> bool | None:
    """Math-Verify's numeric comparison for two constant numbers, tightened: against an
    exact rational reference (an integer, ``\\frac{1}{3}``, ``3\\times 10^{-7}``) the answer
    must be exactly equal, its decimals read as the rational they write (``0.3333333`` is not
    1/3); against an irrational one (``\\sqrt{2}``) equal, or to the 15 digits of the floats
    that a decimal inside it was computed in (``10\\sqrt{10.5}`` for ``5\\sqrt{42}``);
    against an inexact one (a decimal) within ``_RELATIVE_TOLERANCE`` of it, relative to its
    magnitude.
    Math-Verify rounded both to 6 decimals (``0.0`` equalled any reference below 5e-7) and
    compared floats at 15 digits (``1.0\\times10^{17}`` equalled 100000000000000007).
    An infinity equals only the same infinity once evaluated; an undefined value (nan)
    nothing. None when the two are not both constant numbers: Math-Verify's own rule then."""
    from sympy import Basic, Float, Mul, Rational, S, UnevaluatedExpr

    if not (isinstance(gold, Basic) and isinstance(pred, Basic)):
        return None
    for value in (gold, pred):
        if isinstance(value, Mul) and UnevaluatedExpr(Rational(1, 100)) in value.args:
            return None  # a percentage: Math-Verify's rule (``math._equal_percent`` decides first)
    try:
        if gold.free_symbols or pred.free_symbols or not (gold.is_number and pred.is_number):
            return None
        g, p = gold.doit(), pred.doit()
        if g.has(S.NaN) or p.has(S.NaN):
            return False  # undefined (``\\frac{0}{0}``) equals nothing
        if g.is_infinite or p.is_infinite:
            # The same infinity (``\\infty^{\\infty}`` is ``\\infty``), never a number.
            return bool(g == p)
        if not (g.is_finite and p.is_finite):
            return None
        if g.has(Float):
            distance = abs((g - p).evalf(30))
            return bool(distance <= _RELATIVE_TOLERANCE * abs(g.evalf(30)))
        decimal = p.has(Float)
        if g.is_Rational:
            return bool(g == (_written_rational(p) if decimal else p))
        # An irrational reference: a decimal answer was computed in 15-digit floats
        # (``\sqrt{10.5}``), and must agree to their precision.
        distance = abs((g - p).evalf(30))
        scale = max(abs(g.evalf(30)), abs(p.evalf(30)))
        return bool(distance == 0 or distance <= (1e-13 if decimal else 1e-25) * scale)
    except Exception:
        return None


def _written_rational(value: Any) -> Any:
    """``value`` with each decimal read as the rational its digits write: ``3.0000000001`` is
    30000000001/10000000000. (sympy's ``nsimplify(rational=True)`` gave 3 for it: a decimal
    within about 1e-9 of an integer reference was paid.)"""
    from sympy import Float, Rational

    return value.xreplace({f: Rational(str(f)) for f in value.atoms(Float)})


def new_variables(gold: Any, pred: Any) -> bool:
    """The answer ``pred`` holds a variable (a free symbol, or an undefined function such as
    ``f(1)``) that the reference ``gold`` does not: ``\\frac{7x}{x}``, ``7 + 0x``,
    ``6 + \\sin^2 x + \\cos^2 x`` are not the constant 7 written out, though a CAS simplifies
    them to it. Read on the parse as written (latex2sympy builds it unevaluated)."""
    from sympy.core.function import AppliedUndef

    try:
        gold_symbols = getattr(gold, "free_symbols", set())
        if not getattr(pred, "free_symbols", set()) <= gold_symbols:
            return True
        gold_functions = (
            {f.func for f in gold.atoms(AppliedUndef)} if hasattr(gold, "atoms") else set()
        )
        predicted = pred.atoms(AppliedUndef) if hasattr(pred, "atoms") else set()
        return any(f.func not in gold_functions for f in predicted)
    except Exception:  # an object without symbols: nothing to say
        return False


def install_numeric_rule() -> None:
    """Math-Verify compares numbers with ``_numbers_equal`` (once per process); its symbolic
    fallback is skipped for two constants of which one is a decimal (``simplify`` of their
    difference is done in 15-digit floats), and for any two of which one holds an infinity
    or nan: those are equal only when the same once evaluated (``doit``); and an answer with
    a variable that the reference does not have (``new_variables``) equals nothing."""
    global _NUMERIC_RULE_INSTALLED
    if _NUMERIC_RULE_INSTALLED:
        return
    from math_verify import grader
    from sympy import Basic, Float, S

    infinities = (S.Infinity, S.NegativeInfinity, S.ComplexInfinity, S.NaN)

    numeric, symbolic = grader.sympy_numeric_eq, grader.sympy_symbolic_eq
    expression = grader.sympy_expr_eq

    def numeric_eq(a: Any, b: Any, float_rounding: int, numeric_precision: int) -> bool:
        decided = numbers_equal(a, b)
        return numeric(a, b, float_rounding, numeric_precision) if decided is None else decided

    def symbolic_eq(a: Any, b: Any) -> bool:
        if any(isinstance(x, Basic) and x.has(*infinities) for x in (a, b)):
            # No ``simplify`` of a difference with an infinity in it: sympy 1.14 simplified
            # ``7 - oo**oo`` (unevaluated, as parsed) to 0 in some processes and to -oo in
            # others, which paid the answer \infty^{\infty} against the reference 7.
            # Equal only when the same once evaluated (``numbers_equal`` for constants).
            try:
                return bool(a.doit() == b.doit())
            except Exception:
                return False
        if numbers_equal(a, b) is not None and any(
            isinstance(x, Basic) and x.has(Float) for x in (a, b)
        ):
            return False
        return symbolic(a, b)

    def expr_eq(gold: Any, pred: Any, *args: Any, **kwargs: Any) -> bool:
        # Before any of Math-Verify's comparisons, which evaluate (``y - (7 + z - z)`` of two
        # relations, sympy's set equality): the answer's value as Math-Verify takes it, the
        # right side of its equation against a reference that is none.
        value = pred
        if grader.is_equation(pred) and not grader.is_equation(gold):
            value = grader.take_last_relation(pred).rhs
        return not new_variables(gold, value) and expression(gold, pred, *args, **kwargs)

    grader.sympy_numeric_eq, grader.sympy_symbolic_eq = numeric_eq, symbolic_eq
    grader.sympy_expr_eq = expr_eq
    _NUMERIC_RULE_INSTALLED = True
