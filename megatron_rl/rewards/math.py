"""Math reward: final answer after the thinking vs the reference, verified by Math-Verify.

Safety (model text is hostile input):

- The trainer process only runs the linear-time extraction and the static checks of
  ``megatron_rl.rewards.extraction``; anything long, deeply nested or with huge powers
  scores incorrect there, without parsing.
- Verification runs in worker processes (``megatron_rl.rewards.workers``) with a hard time
  limit measured by the parent, which SIGKILLs and replaces a stuck worker; this works from
  any thread of the trainer. Inside the worker a softer first limit counts CPU time
  (``ITIMER_PROF``; workers run tasks on their main thread, where signals work), so that
  load on the machine does not change verdicts; running out of it is the verdict TIMEOUT,
  counted apart from wrong answers. Math-Verify's own wall-clock limits stay off: they
  report running out as a silent ``False``.
- Only ``LatexExtractionConfig`` is used. Math-Verify's ``ExprExtractionConfig`` hands the
  text to ``sympy.parse_expr``, which calls ``eval``, so it is never enabled. LaTeX goes
  through the ANTLR grammar of latex2sympy2; the one ``sympify`` on that path receives
  NUMBER tokens of the grammar (digits and a decimal point), never free text.
- Workers run under an audit-hook guard that refuses process creation, sockets and file
  writes, and records any attempt (``TaskResult.blocked``).

Rules beyond Math-Verify's (issues 37 and 45; docs/rewards.md lists them): answers are read
as they render and with multiplier words as factors (``prepare``); numbers compare exactly
unless the reference is a decimal, and an answer's variable must be the reference's
(``numeric``); units, percent signs, false equations (``=``, ``\\equiv``, a closing
``(= 7)``), logarithms that evaluate away, degrees, ``i``, ``\\ln`` / ``\\log`` and
hyperbolic functions in ``verify``. Every rule has wrong answers and their correct controls
in ``tests/data/math_adversarial_suite.jsonl``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import signal
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.extraction import (
    extract_math_answer,
    final_answer,
    integer_answer,
    unevaluated_operator,
    unsafe_reason,
)
from megatron_rl.rewards.forms import (
    base_numeral,
    chosen_option,
    interval_of,
    normalise_string,
    option_hedge,
    option_letter,
    option_text,
    ordering,
    repeating_decimal,
    scientific_notation,
    time_of_day,
    visible_answer,
)
from megatron_rl.rewards.numeric import install_numeric_rule
from megatron_rl.rewards.stated import unwrap_math
from megatron_rl.rewards.units import (
    conversion,
    kept_against_bare,
    scaled,
    split_unit,
    unit_key,
    unit_value,
)

logger = logging.getLogger(__name__)

# Verdicts of ``verify``. TIMEOUT: the verification ran out of CPU time, which says nothing
# about the answer; it is never reported as WRONG.
CORRECT, WRONG, TIMEOUT, BAD_REFERENCE = "correct", "wrong", "timeout", "bad_reference"
# Share of ``timeout_s`` that each of the two CPU-time budgets of a task gets (the reference
# parse; the prediction parse and the comparisons), so that they run out before the
# parent's wall-clock kill when the machine is not overloaded.
_CPU_SHARE = 0.4
_REFERENCE_CACHE_SIZE = 4096

_DEFAULT_POOL: Any = None
_DEFAULT_POOL_LOCK = threading.Lock()
_REFERENCES: OrderedDict[str, list] = OrderedDict()
_EXTRACTION: Any = None


def reference_answer(answer: str) -> str:
    """The reference as the verifier sees it: its final answer as a response's is read
    (``extraction.final_answer``: several boxes that end it form one set), else all of it
    without math delimiters."""
    found = final_answer(answer)
    return (found if found is not None else unwrap_math(answer)).strip()


def prepare(response: str, answer: str, config: RewardConfig) -> float | tuple[str, str]:
    """Decide a response in the trainer process when that is safe and cheap.

    Both answers are read as they render (``forms.visible_answer``), with repeating
    decimals as fractions (``forms.repeating_decimal``) and multiplier words as factors
    (``units.scaled``). Returns the reward when it is decided here (no answer, an
    unsafe answer, digits set apart by spacing, an operator left unevaluated (``\\int``,
    ``\\sum``, ``\\gcd``...) that the reference does not hold, a reference that is a time of
    day or a numeral in a base, an option letter opening the answer against a letter or
    several options offered, an ordering written as a chain, or both answers plain
    integers), else the ``(prediction, reference)`` pair a worker must verify.
    """
    prediction = extract_math_answer(response, config)
    if prediction is None:
        return config.incorrect_reward
    reason = unsafe_reason(prediction, config)
    if reason is not None:
        logger.debug("answer rejected before parsing: %s", reason)
        return config.incorrect_reward
    # As it renders (``\\phantom``, colour, thin spaces between digit groups); None for
    # digits set apart by spacing, which read as no number.
    prediction = visible_answer(prediction)
    if not prediction:
        return config.incorrect_reward
    # After the checks, on a short answer; its exponent has at most 3 digits.
    prediction = scaled(scientific_notation(repeating_decimal(prediction)))
    reference = reference_answer(answer)
    reference = visible_answer(reference) or reference
    reference = scaled(scientific_notation(repeating_decimal(reference)))
    operator = unevaluated_operator(prediction)
    if operator is not None and unevaluated_operator(reference) is None:
        # The question restated (an integral, a sum, a limit left undone): no final answer.
        logger.debug("answer holds the unevaluated operator %s", operator)
        return config.incorrect_reward
    reference_time = time_of_day(reference)
    if reference_time is not None:
        # am / pm is part of the answer: 7 p.m. is not 7 a.m. (``forms.time_of_day``).
        same = time_of_day(prediction, marker_required=False) == reference_time
        return config.correct_reward if same else config.incorrect_reward
    reference_numeral = base_numeral(reference)
    if reference_numeral is not None and reference_numeral[1] is not None:
        # "40_9": the digits and the base (Math-Verify dropped the subscript); bare digits
        # take the reference's base, as Math-Verify took them. Anything else is wrong.
        numeral = base_numeral(prediction)
        same = numeral is not None and numeral[0] == reference_numeral[0]
        same = same and numeral[1] in (None, reference_numeral[1])
        return config.correct_reward if same else config.incorrect_reward
    reference_option = option_letter(reference)
    if reference_option is not None:
        # "(D) (2,0)": the letter with its option's text is the letter.
        chosen = chosen_option(prediction)
        if chosen is not None:
            return config.correct_reward if chosen == reference_option else config.incorrect_reward
        if option_hedge(prediction):  # "C) 12; D) 14": several options offered
            return config.incorrect_reward
    else:
        # "C) 12" against the reference 12: the option's text is the answer.
        prediction = option_text(prediction) or prediction
    prediction = interval_of(prediction, reference)
    order = ordering(prediction, reference)
    if order is not None:
        # "b > a > c" for the ordering "b, a, c": the same items in the same order.
        return config.correct_reward if order else config.incorrect_reward
    predicted_int, reference_int = integer_answer(prediction), integer_answer(reference)
    if predicted_int is not None and reference_int is not None:
        return config.correct_reward if predicted_int == reference_int else config.incorrect_reward
    return prediction, reference


def load_verifier() -> None:
    """Worker initialiser: import Math-Verify and warm up its parser and sympy paths.

    The warm-up imports the modules that sympy loads lazily, before the worker's guard is
    installed and outside any task's time. Math-Verify's own (wall-clock, ``signal.alarm``)
    limits are never armed (``verify`` runs under CPU-time limits instead), so its logger
    only has the "timeout is disabled" notice to say, which is silenced.
    """
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for prediction, reference in (
        ("\\frac{1}{2}", "0.5"),
        ("(1,2]", "(1, 2]"),
        ("\\{1,2\\}", "\\{2,1\\}"),
        ("1,-2", "-2,1"),
        ("x^2+2x+1", "(x+1)^2"),
        ("30^\\circ", "\\sqrt{2}\\pi"),
    ):
        verify(prediction, reference, 0)
    _REFERENCES.clear()


_ALARM_REPEAT_S = 0.05


class _OutOfTime(BaseException):
    """Raised by the CPU-time alarm; a BaseException so that Math-Verify's and sympy's
    ``except Exception`` handlers let it through (as Math-Verify's own TimeoutException)."""


@contextlib.contextmanager
def _cpu_time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``_OutOfTime`` in the block once it has used ``seconds`` of CPU time (user +
    system, ``ITIMER_PROF``). CPU time, unlike wall-clock time, does not grow when other
    processes load the machine, so the same answer gets the same verdict under load.
    Main thread only (workers run tasks there). None: no limit."""
    if seconds is None:
        yield
        return

    active = True

    def expire(signum: int, frame: Any) -> None:
        if active:
            raise _OutOfTime

    previous = signal.signal(signal.SIGPROF, expire)
    # Then again every 50 ms of CPU: a Python signal handler that runs inside a finaliser
    # (``__del__``, a weakref callback) has its exception printed and dropped, and a one-shot
    # alarm lost that way left the block running until the pool's wall-clock limit.
    signal.setitimer(signal.ITIMER_PROF, seconds, _ALARM_REPEAT_S)
    try:
        yield
    finally:
        active = False  # first: an alarm from here on is a no-op
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def _extraction_config() -> Any:
    """Math-Verify's LaTeX extraction with its unit stripping off (see ``units``: it dropped
    letters inside expressions, ``8 + 3d`` became ``11`` and ``5pm`` equalled ``5am``); the
    rest of its normalisation as by default."""
    global _EXTRACTION
    if _EXTRACTION is None:
        from latex2sympy2_extended.math_normalization import NormalizationConfig
        from math_verify import LatexExtractionConfig

        _EXTRACTION = LatexExtractionConfig(
            boxed_match_priority=0,
            normalization_config=NormalizationConfig(
                basic_latex=True,
                units=False,
                malformed_operators=True,
                nits=True,
                boxed="all",
                equations=False,
            ),
        )
    return _EXTRACTION


def _parse(latex: str, cpu_seconds: float | None) -> list:
    from math_verify import parse

    with _cpu_time_limit(cpu_seconds):
        parsed = parse(
            "\\boxed{" + latex + "}",
            extraction_config=[_extraction_config()],
            parsing_timeout=None,
        )
    # The string fallback (what sympy could not parse) is compared as normalised text.
    return [normalise_string(p) if isinstance(p, str) else p for p in parsed]


def _parse_reference(reference: str, cpu_seconds: float | None) -> list:
    """Math-Verify's parse of a reference, cached per worker. Only successes are cached: a
    parse that ran out of time raises ``_OutOfTime`` and is tried again next time, and an
    empty parse is not kept either."""
    cached = _REFERENCES.get(reference)
    if cached is not None:
        _REFERENCES.move_to_end(reference)
        return cached
    parsed = _parse(reference, cpu_seconds)
    if parsed:
        _REFERENCES[reference] = parsed
        if len(_REFERENCES) > _REFERENCE_CACHE_SIZE:
            _REFERENCES.popitem(last=False)
    return parsed


def _constant(parsed: list) -> bool:
    """A parse (Math-Verify's list) holds an expression and none has a free variable."""
    from sympy import Basic, MatrixBase

    expressions = [p for p in parsed if isinstance(p, (Basic, MatrixBase))]
    try:
        return bool(expressions) and not any(e.free_symbols for e in expressions)
    except Exception:  # an object without free_symbols: not known to be constant
        return False


def _equal_without_units(prediction: str, reference: str, gold: list, target: list) -> bool:
    """Equality once a unit that stands alone at the end of the answer (``36 mL``) or of the
    reference (``\\frac{37}{4} m``) is taken off (``units.split_unit``), only when the
    reference's value is a constant: against a symbolic reference (``4h``) a trailing letter
    is a variable, never a unit. Runs inside ``verify``'s CPU-time limit."""
    reference_split, prediction_split = split_unit(reference), split_unit(prediction)
    if reference_split is None and prediction_split is None:
        return False
    if reference_split is None and kept_against_bare(unit_key(prediction) or ""):
        return False  # ``5\\text{ cents}`` is not the bare 5 (dollars)
    if reference_split is not None:
        gold = _parse_reference(reference_split[0], None)
    if not _constant(gold):
        return False
    if prediction_split is not None:
        target = _parse(prediction_split[0], None)
    return bool(target) and _math_verify(gold, target)


def _without_percent(answer: str) -> str | None:
    """``answer`` without the percent sign that ends it (``17.5\\%``), or None without one."""
    answer = answer.strip()
    for sign in ("\\%", "%"):
        if answer.endswith(sign) and answer[: -len(sign)].strip():
            return answer[: -len(sign)].strip()
    return None


def _integer_valued(parsed: list) -> bool:
    """The first expression of a parse is an integer (``3``, ``\\frac{6}{2}``)."""
    from sympy import Basic

    value = next((p for p in parsed if isinstance(p, Basic)), None)
    try:
        return value is not None and bool(value.is_integer)
    except Exception:
        return False


def _equal_percent(prediction: str, reference: str, gold: list) -> bool:
    """Equality when one side or both end with a percent sign, decided here alone.

    Both: the numbers before the signs. One: the same number (``64`` for ``64\\%``: the
    answer in percentage points) or the number over 100 (``0.625`` for ``62.5\\%``), but the
    latter only when that side's number is no integer but 1: ``5000\\%`` is not the answer
    50, nor ``300\\%`` the answer 3 (Math-Verify equated both); ``150\\%`` is 1.5.
    Runs inside ``verify``'s CPU-time limit."""
    prediction_bare, reference_bare = _without_percent(prediction), _without_percent(reference)
    if prediction_bare is not None and reference_bare is not None:
        target = _parse(prediction_bare, None)
        return bool(target) and _math_verify(_parse_reference(reference_bare, None), target)
    if reference_bare is not None:
        percent, whole = _parse_reference(reference_bare, None), _parse(prediction, None)
    else:
        percent, whole = _parse(prediction_bare, None), gold
    if not percent or not whole:
        return False
    if _math_verify(whole, percent):
        return True
    from sympy import Basic, Integer

    fraction = [p / 100 for p in percent if isinstance(p, Basic)]
    ones = [w for w in whole if isinstance(w, Basic) and abs(w) == Integer(1)]
    if _integer_valued(whole) and not ones:
        return False
    return bool(fraction) and _math_verify(whole, fraction)


# A relation that states equality in a chain: ``=``, ``==``, ``\\equiv`` (``2 \\times 3 \\equiv 7``).
_EQUIV = "\\equiv"
# A congruence (``17 \\equiv 3 \\pmod 7``) is no equality of its sides.
_MODULUS_RE = re.compile(
    r"\\[bp]?mod(?![A-Za-z])|\\(?:text|mathrm|operatorname)\s{0,4}\{\s{0,4}mod|\bmod\b"
)


def _top_level_sides(answer: str) -> list[str]:
    """The sides of ``answer``'s top-level ``=`` (or ``==``, ``\\equiv``, ``≡``) signs, not of
    ``<=``, ``>=``, ``!=``."""
    sides, depth, start, i = [], 0, 0, 0
    while i < len(answer):
        ch = answer[i]
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
        elif ch == "=" and depth == 0 and (i == 0 or answer[i - 1] not in "<>!\\"):
            sides.append(answer[start:i])
            if answer.startswith("==", i):  # "1==2" is an equation too
                i += 1
            start = i + 1
        elif ch == "≡" and depth == 0:
            sides.append(answer[start:i])
            start = i + 1
        elif (
            ch == "\\"
            and depth == 0
            and answer.startswith(_EQUIV, i)
            and not answer[i + len(_EQUIV) : i + len(_EQUIV) + 1].isalpha()
        ):
            sides.append(answer[start:i])
            i += len(_EQUIV) - 1
            start = i + 1
        i += 1
    sides.append(answer[start:])
    return sides


# A modulus that ends an answer: ``\\pmod{7}``, ``\\pmod 7``, ``(\\bmod 7)``, ``(\\text{mod } 7)``,
# ``\\mod 7``, ``mod 7``; an integer modulus only.
_TRAILING_MODULUS_RE = re.compile(
    r"(?:\\q?quad|\\[,;:! ]|~|\s){0,8}(?:\\left\s{0,4})?(\()?\s{0,4}"
    r"(?:\\[bp]?mod(?![A-Za-z])|\\(?:text|mathrm|operatorname)\s{0,4}\{\s{0,4}mod\s{0,4}\}|\bmod\b)"
    r"(?:\s|\\[,;:! ]|~){0,4}(?:\{\s{0,4}(\d{1,12})\s{0,4}\}|(\d{1,12}))\s{0,4}"
    r"(?:\\right\s{0,4})?(\))?\s{0,4}$"
)


def _residue(prediction: str, modulus: re.Match) -> str | None:
    """The residue that ``prediction`` states before the modulus ``modulus`` that ends it
    (``6`` of ``6 \\pmod{7}`` and of ``13 \\equiv 6 \\pmod{7}``), against a reference that
    states no modulus; None when that is no true congruence: a constant side that is no
    integer, or two constant sides that differ by no multiple of the modulus (``13 \\equiv 5
    \\pmod 7``: the rule ``_false_equation`` applies to ``=``, modulo the modulus), or a
    modulus below 2 (modulo 1 every side agrees: ``8 \\equiv 7 \\pmod 1`` hedges 8 and 7).
    Runs inside ``verify``'s CPU-time limit."""
    from sympy import Basic

    if bool(modulus.group(1)) != bool(modulus.group(4)):
        return None  # "(\\bmod 7" or "\\pmod 7)": unbalanced
    n = int(modulus.group(2) or modulus.group(3))
    head = prediction[: modulus.start()]
    sides = [side.strip() for side in _top_level_sides(head)]
    if n < 2 or not all(sides) or _MODULUS_RE.search(head):
        return None
    residues = []
    for side in sides:
        parsed = _parse(side, None)
        if not _constant(parsed):
            continue  # ``x \\equiv 6 \\pmod 7``: the variable's residue
        value = next(p for p in parsed if isinstance(p, Basic)).doit()
        if not value.is_integer:
            return None
        residues.append(int(value) % n)
    return sides[-1] if len(set(residues)) <= 1 else None


def _false_equation(prediction: str) -> bool:
    """``prediction`` is a false chain of equalities: of constants that do not all agree
    (``2+2=5``, ``2 \\times 3 \\equiv 7``), or with a variable, whose first constant side
    does not agree with its last (``x = 5 = 7``); Math-Verify took the last side. A
    congruence (``\\pmod``) is no equality. Runs inside ``verify``'s CPU-time limit."""
    sides = _top_level_sides(prediction)
    if len(sides) < 2 or not all(side.strip() for side in sides):
        return False
    if (_EQUIV in prediction or "≡" in prediction) and _TRAILING_MODULUS_RE.search(prediction):
        return False  # a congruence; a modulus inside a side (``13 \\mod 7 \\equiv 5``) is Mod
    parsed = [_parse(side, None) for side in sides]
    constants = [p for p in parsed if _constant(p)]
    if len(constants) == len(parsed):  # every side agrees with the last
        return any(not _math_verify(constants[-1], side) for side in constants[:-1])
    # With a variable, the first constant side computes the value stated last; a side
    # between them may slip (Math-Verify's own tests pay ``x = 5+5+1 = 7 = 11`` for 11).
    return len(constants) >= 2 and not _math_verify(constants[-1], constants[0])


# A remark that closes an answer with the value it equals: ``6 + 1 \\quad (= 7)``.
_EQUALS_REMARK_RE = re.compile(
    r"(?:\\q?quad|\\[,;:! ]|~|\s){0,8}(?:\\left\s{0,4})?\(\s{0,8}=([^()=]{1,200})"
    r"(?:\\right\s{0,4})?\)\s{0,8}$"
)


def _remark_as_side(prediction: str) -> str:
    """``6 + 1 = 7`` for ``6 + 1 \\quad (= 7)``: a closing remark "(= value)" is the last
    side of an equation (whose sides must then agree, ``_false_equation``)."""
    values: list[str] = []
    for _ in range(4):  # "6 + 1 \\quad (= 7) \\quad (= 8)" is 6 + 1 = 7 = 8
        tail = prediction[-300:]
        found = _EQUALS_REMARK_RE.search(tail)
        if found is None:
            break
        head = prediction[: len(prediction) - len(tail) + found.start()]
        value = found.group(1).strip().removesuffix("\\right").strip()
        if not head.strip() or not value:
            break
        prediction, values = head, [value, *values]
    return " = ".join([prediction, *values])


# A logarithm: ``\\log``, ``\\ln``, ``\\lg``, ``\\log_2``, ``\\operatorname{log}``.
_LOG_RE = re.compile(
    r"\\(?:log|ln|lg)(?![A-Za-z])|\\operatorname\s{0,4}\{\s{0,4}(?:log|ln|lg)\s{0,4}\}"
)


def _evaluated_logarithm(prediction: str, reference: str) -> bool:
    """The value that ``prediction`` states (its last side) writes a logarithm that
    evaluates away (``\\log_2 8`` is 3, ``e^{\\ln 7}`` is 7, ``\\ln e^2`` is 2), against a
    reference that writes none: the question restated, no final answer. A logarithm with
    no simpler exact form (``\\log_2 3``, ``\\ln 2 + i\\pi/3``) is a final answer. Runs
    inside ``verify``'s CPU-time limit."""
    stated = _top_level_sides(prediction)[-1]
    stated = (split_unit(stated) or (stated,))[0]  # "\\log_2 8 \\text{ bits}"
    if not _LOG_RE.search(stated) or _LOG_RE.search(reference):
        return False
    from sympy import Basic, expand_log, log

    # The parse keeps ``log(8, 2)`` as written; evaluated, with its products and powers
    # taken apart (``\\log_3 \\sqrt{27}`` is 3/2), it is a number or still a logarithm.
    values = [
        expand_log(p.doit(), force=True) for p in _parse(stated, None) if isinstance(p, Basic)
    ]
    return bool(values) and not any(v.has(log) for v in values)


_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
_DEGREE_RE = re.compile(r"\^\s{0,4}\{?\s{0,4}\\circ\s{0,4}\}?|°|\\degree")


def _equal_in_radians(prediction: str, reference: str, gold: list, target: list) -> bool:
    """A reference in degrees (``30^\\circ``) against an answer in radians with ``\\pi``
    (``\\frac{\\pi}{6}``), not one in degrees itself (``\\frac{\\pi}{2}^\\circ`` is not
    ``90^\\circ``). Runs inside ``verify``'s CPU-time limit."""
    if not _DEGREE_RE.search(reference) or "\\pi" not in prediction or not _constant(gold):
        return False
    if _in_degrees(prediction) is not None:
        return False
    from sympy import Basic, pi

    radians = [g * pi / 180 for g in gold if isinstance(g, Basic)]
    return bool(target) and _math_verify(radians, target)


# A reference that is a decimal written out (``0.333``, ``-12.5``), or in scientific
# notation (``3.33\\times 10^{-1}``, ``3.33\\cdot10^{-1}``), read without its spaces.
_DECIMAL_RE = re.compile(
    r"([+-]?\d{1,40})\.(\d{1,40})"
    r"(?:(?:\\times|\\cdot)10\^(?:\{([+-]?\d{1,3})\}|(\d)))?"
)
# The fewest significant digits of a decimal reference that an exact answer is rounded to.
_ROUNDED_DIGITS = 3
# An answer that says it is approximate: ``\\approx``, ``\\sim``, ``\\simeq``, ``≈``.
_APPROXIMATE_RE = re.compile(r"\\(?:approx|sim|simeq|thickapprox|thicksim)(?![A-Za-z])|≈")


def _terminates(denominator: int) -> bool:
    """A fraction with this (positive) denominator is a terminating decimal: its only prime
    factors are 2 and 5."""
    denominator >>= (denominator & -denominator).bit_length() - 1
    while denominator % 5 == 0:
        denominator //= 5
    return denominator == 1


def _equal_rounded(prediction: str, reference: str, gold: list, target: list) -> bool:
    """An exact answer (``\\frac{1}{3}``, ``\\sqrt{2}``) against a decimal reference that
    has at least ``_ROUNDED_DIGITS`` significant digits (``0.333``, ``3.33\\times 10^{-1}``):
    equal when the answer rounds to the reference at the reference's last decimal place
    (within half a unit of it, ends included). A unit at the end of either is taken off as
    ``_equal_without_units`` takes it off (``\\frac{1}{3}\\text{ m}`` for ``0.333\\text{
    m}``; ``verify`` has already refused units that disagree). A decimal answer keeps the
    tolerance of ``numeric``; a reference of fewer digits (``0.3``, ``7.0``) or an integer
    one compares as before. Neither an answer that says it is approximate (``\\approx
    \\frac{1}{3}``) nor a fraction that is a terminating decimal (``\\frac{7001}{1000}`` is
    ``7.001``, wrong for ``7.00`` as written as a decimal) is exact in this sense. Runs
    inside ``verify``'s CPU-time limit."""
    from sympy import Basic, Eq, Float, Rational

    reference_split, prediction_split = split_unit(reference), split_unit(prediction)
    if reference_split is None and kept_against_bare(unit_key(prediction) or ""):
        return False  # ``\\frac{1}{3}\\text{ cents}`` is not the bare 0.333 (dollars)
    if reference_split is not None:
        reference = reference_split[0]
    if prediction_split is not None:
        prediction = prediction_split[0]
        target = _parse(prediction, None)
    found = _DECIMAL_RE.fullmatch(reference.replace(" ", ""))
    if found is None:
        return False
    whole, fraction = found.group(1), found.group(2)
    if len((whole.lstrip("+-") + fraction).lstrip("0")) < _ROUNDED_DIGITS:
        return False
    if _APPROXIMATE_RE.search(prediction):
        return False
    value = next((t for t in target if isinstance(t, Basic)), None)
    if isinstance(value, Eq):
        value = value.rhs  # ``x = \\frac{1}{3}``
    if value is None or value.free_symbols or value.has(Float) or not value.is_number:
        return False
    value = value.doit()
    if value.is_Rational and _terminates(value.q):
        return False  # a decimal written as a fraction keeps the decimal's tolerance
    exponent = int(found.group(3) or found.group(4) or 0)
    scale = Rational(10) ** exponent
    decimal = Rational(f"{whole}.{fraction}") * scale
    half_unit = Rational(1, 2 * 10 ** len(fraction)) * scale
    distance = abs(value - decimal)
    if distance.is_Rational:
        return bool(distance <= half_unit)
    return bool(distance.is_finite) and bool(distance.evalf(50) < half_unit)


_DEGREES_END_RE = re.compile(rf"(?:{_DEGREE_RE.pattern})\s{{0,4}}$")


def _in_degrees(answer: str) -> str | None:
    """The value of an answer in degrees (``90^\\circ``, ``90\\degree``, ``90\\text{
    degrees}`` are ``90``), or None."""
    found = _DEGREES_END_RE.search(answer)
    if found is not None:
        return answer[: found.start()].strip() or None
    return unit_value(answer) if unit_key(answer) == "deg" else None


def _equal_in_degrees(degrees: str, gold: list) -> bool:
    """An answer in degrees (its value ``degrees``: ``90`` of ``90^\\circ``) against a
    reference in radians (``gold``, a constant such as ``\\frac{\\pi}{2}``). Runs inside
    ``verify``'s CPU-time limit."""
    from sympy import Basic, pi

    target = _parse(degrees, None)
    if not (_constant(gold) and _constant(target)):
        return False
    radians = [t * pi / 180 for t in target if isinstance(t, Basic)]
    return bool(radians) and _math_verify(gold, radians)


def _equal_converted(prediction: str, reference: str, factor: Any, gold: list) -> bool:
    """Equality of a value in one unit with the reference's in another of the same
    dimension (``300\\text{ seconds}`` for ``5 minutes``): the reference's value times the
    exact ``factor`` (``units.conversion``) against the answer's. Both values constant.
    Runs inside ``verify``'s CPU-time limit."""
    from sympy import Basic, Rational

    predicted, expected = unit_value(prediction), unit_value(reference)
    if predicted is None or expected is None:
        return False
    gold, target = _parse_reference(expected, None), _parse(predicted, None)
    if not (_constant(gold) and _constant(target)):
        return False
    ratio = Rational(factor.numerator, factor.denominator)
    converted = [g * ratio for g in gold if isinstance(g, Basic)]
    return bool(converted) and _math_verify(converted, target)


def _rewritten(parsed: list) -> list:
    """A parse with the symbol ``i`` as the imaginary unit and hyperbolic functions written
    with ``exp``: ``e^{i\\pi}`` is -1, ``\\sinh(at)/a`` is ``(e^{at}-e^{-at})/2a``."""
    from sympy import Basic, I, Symbol, exp
    from sympy.functions.elementary.hyperbolic import HyperbolicFunction

    out = []
    for p in parsed:
        if isinstance(p, Basic):
            p = p.subs({s: I for s in p.free_symbols if isinstance(s, Symbol) and s.name == "i"})
            if p.has(HyperbolicFunction):
                p = p.rewrite(exp)
        out.append(p)
    return out


def _equal_rewritten(prediction: str, reference: str, gold: list, target: list) -> bool:
    """Equality of the two read with ``i`` as the imaginary unit, hyperbolic functions as
    exponentials, and, where one side writes ``\\ln``, ``\\log`` without a base on the other
    as the natural logarithm (``\\log 2 + i\\pi/3`` for ``\\ln 2 + i\\pi/3``). Only tried when
    one of these is in the text. Runs inside ``verify``'s CPU-time limit."""
    letters = _COMMAND_RE.sub("", prediction + reference)
    relevant = "i" in letters or any(
        f in prediction + reference for f in ("\\sinh", "\\cosh", "\\tanh")
    )
    if "\\ln" in reference and "\\log" in prediction and "\\log_" not in prediction:
        target = _parse(prediction.replace("\\log", "\\ln"), None)
        relevant = True
    if "\\ln" in prediction and "\\log" in reference and "\\log_" not in reference:
        gold = _parse_reference(reference.replace("\\log", "\\ln"), None)
        relevant = True
    if not relevant or not target:
        return False
    try:
        gold, target = _rewritten(gold), _rewritten(target)
    except Exception:  # sympy could not rewrite: compared as they were
        return False
    return _math_verify(gold, target)


def _math_verify(gold: list, target: list) -> bool:
    from math_verify import verify as math_verify

    install_numeric_rule()
    # Math-Verify's own limit stays off: it would report running out as False.
    return math_verify(gold, target, timeout_seconds=None)


def _contained(equal: Callable[..., bool]) -> Callable[..., bool]:
    """``equal`` that answers False where sympy raises on an unforeseen kind of value (a
    set divided by 100, the absolute value of a matrix): a comparison that fails is no
    equality, and must not end the task as a crash. ``_OutOfTime`` (a BaseException)
    passes through."""

    @functools.wraps(equal)
    def contained(*args: Any) -> bool:
        try:
            return equal(*args)
        except Exception:
            logger.debug("%s failed, not equal", equal.__name__, exc_info=True)
            return False

    return contained


def verify(prediction: str, reference: str, timeout_s: float) -> str:
    """Math-Verify equivalence of two extracted answers: CORRECT, WRONG, TIMEOUT or
    BAD_REFERENCE (the reference does not parse). Runs inside a worker process.

    Units first: when both end with one, the units must agree (``units.unit_key``) or
    convert exactly (``units.conversion``: ``300\\text{ s}`` for ``5 minutes``), and degrees
    answer radians as an angle (``_equal_in_degrees``). With a
    percent sign on either side, ``_equal_percent`` alone decides. An answer that is a
    false equation of constants (``2+2=5``) is wrong. Otherwise compared as they are, then
    without a unit at their end (``_equal_without_units``), then in radians against degrees
    (``_equal_in_radians``), then rewritten (``_equal_rewritten``), then an exact answer
    rounded to a decimal reference (``_equal_rounded``).
    ``timeout_s`` > 0 gives the reference parse, and then the prediction parse with the
    comparisons, ``_CPU_SHARE * timeout_s`` CPU seconds each; running out is TIMEOUT, never
    WRONG. The hard wall-clock limit is the worker pool's.
    """
    cpu_seconds = _CPU_SHARE * timeout_s if timeout_s > 0 else None
    try:
        gold = _parse_reference(reference, cpu_seconds)
        if not gold:
            return BAD_REFERENCE
        with _cpu_time_limit(cpu_seconds):
            prediction = _remark_as_side(prediction)
            modulus = _TRAILING_MODULUS_RE.search(prediction)
            if modulus is not None and not _MODULUS_RE.search(reference):
                # ``13 \\equiv 6 \\pmod{7}`` for 6: the residue, when the congruence holds.
                try:
                    residue = _residue(prediction, modulus)
                except Exception:  # sympy on an unforeseen value: no residue
                    residue = None
                if residue is None:
                    return WRONG
                prediction = residue
            predicted_unit, reference_unit = unit_key(prediction), unit_key(reference)
            if predicted_unit and reference_unit and predicted_unit != reference_unit:
                # 5 mm is not 5 cm, but 0.05 m is; radians answer degrees only as an angle
                # in pi.
                factor = conversion(reference_unit, predicted_unit)
                if factor is not None:
                    correct = _contained(_equal_converted)(prediction, reference, factor, gold)
                    return CORRECT if correct else WRONG
                degrees = _in_degrees(prediction) if reference_unit == "rad" else None
                reference_radians = unit_value(reference) if degrees is not None else None
                if reference_radians is not None:  # 90^\\circ for \\frac{\\pi}{2}\\text{ rad}
                    radians_gold = _parse_reference(reference_radians, None)
                    correct = _contained(_equal_in_degrees)(degrees, radians_gold)
                    return CORRECT if correct else WRONG
                radians = split_unit(prediction) if predicted_unit == "rad" else None
                if radians is None or reference_unit != "deg":
                    return WRONG
                value = radians[0]
                radians_equal = _contained(_equal_in_radians)
                correct = radians_equal(value, reference, gold, _parse(value, None))
                return CORRECT if correct else WRONG
            if _without_percent(prediction) is not None or _without_percent(reference):
                correct = _contained(_equal_percent)(prediction, reference, gold)
            elif _contained(_false_equation)(prediction):
                correct = False
            elif _contained(_evaluated_logarithm)(prediction, reference):
                correct = False
            elif (
                "\\pi" in reference
                and reference_unit is None
                and _in_degrees(prediction) is not None
            ):
                # An answer in degrees against a reference in radians: as an angle, never
                # the number before the sign (``\\frac{\\pi}{2}^\\circ`` is not pi/2).
                degrees = _in_degrees(prediction)
                correct = _contained(_equal_in_degrees)(degrees, gold)
            else:
                target = _parse(prediction, None)
                correct = bool(target) and _math_verify(gold, target)
                rules = (_equal_without_units, _equal_in_radians, _equal_rewritten, _equal_rounded)
                for equal in rules:
                    correct = correct or _contained(equal)(prediction, reference, gold, target)
    except _OutOfTime:
        return TIMEOUT
    return CORRECT if correct else WRONG


def score(response: str, answer: str) -> float:
    """Reward of one math response against its reference answer (+1 / -1 by default).

    Safe on hostile input: verification happens in an isolated, time-limited worker of a
    process-wide ``RewardPool`` with the default ``RewardConfig`` (started on first use).
    Batch callers should use ``RewardPool.score_batch`` (parallel workers).
    """
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None:
            import atexit

            from megatron_rl.rewards.pool import RewardPool

            _DEFAULT_POOL = RewardPool(RewardConfig(kind="math", num_workers=1))
            atexit.register(_DEFAULT_POOL.close)
        pool = _DEFAULT_POOL
    return pool.score_batch([response], [answer])[0]
