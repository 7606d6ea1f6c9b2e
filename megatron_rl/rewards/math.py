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
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.extraction import (
    extract_math_answer,
    final_answer,
    integer_answer,
    unsafe_reason,
)
from megatron_rl.rewards.forms import (
    base_numeral,
    chosen_option,
    normalise_string,
    option_letter,
    scientific_notation,
    time_of_day,
)
from megatron_rl.rewards.stated import unwrap_math
from megatron_rl.rewards.units import split_unit

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

    Returns the reward when it is decided here (no answer, unsafe answer, a reference that is
    a time of day or a numeral in a base, an option letter opening the answer against a letter, or both answers
    plain integers), else the ``(prediction, reference)`` pair a worker must verify.
    """
    prediction = extract_math_answer(response, config)
    if prediction is None:
        return config.incorrect_reward
    reason = unsafe_reason(prediction, config)
    if reason is not None:
        logger.debug("answer rejected before parsing: %s", reason)
        return config.incorrect_reward
    # After the checks, on a short answer; its exponent has at most 3 digits.
    prediction = scientific_notation(prediction)
    reference = scientific_notation(reference_answer(answer))
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


def _equal_without_percent(prediction: str, reference: str, gold: list, target: list) -> bool:
    """Equality once the percent sign of the one side that has it is taken off. Math-Verify
    takes ``25`` for ``25\\%`` (integers) but not ``17.5`` for ``17.5\\%``; both now score
    alike. Runs inside ``verify``'s CPU-time limit."""
    prediction_bare, reference_bare = _without_percent(prediction), _without_percent(reference)
    if (prediction_bare is None) == (reference_bare is None):
        return False
    if reference_bare is not None:
        gold = _parse_reference(reference_bare, None)
    else:
        target = _parse(prediction_bare, None)
    return bool(gold) and bool(target) and _math_verify(gold, target)


def _math_verify(gold: list, target: list) -> bool:
    from math_verify import verify as math_verify

    # Math-Verify's own limit stays off: it would report running out as False.
    return math_verify(gold, target, timeout_seconds=None)


def verify(prediction: str, reference: str, timeout_s: float) -> str:
    """Math-Verify equivalence of two extracted answers: CORRECT, WRONG, TIMEOUT or
    BAD_REFERENCE (the reference does not parse). Runs inside a worker process.

    Compared as they are, then without a unit at their end (``_equal_without_units``), then
    without the percent sign of one of them (``_equal_without_percent``).
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
            target = _parse(prediction, None)
            correct = bool(target) and _math_verify(gold, target)
            if not correct:
                correct = _equal_without_units(prediction, reference, gold, target)
            if not correct:
                correct = _equal_without_percent(prediction, reference, gold, target)
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
