"""Answer extraction and pre-validation of model text, in plain linear-time Python.

Everything here runs in the trainer process on hostile text, so nothing parses or evaluates
it: the scans are single passes with explicit bounds, the regexes have bounded quantifiers
and only ever see capped slices. What leaves this module for a verifier is a short answer
string that passed ``unsafe_reason``. Boxes are read by ``megatron_rl.rewards.boxes``,
answers in prose and answer tags by ``megatron_rl.rewards.stated``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from megatron_rl.rewards.boxes import (
    boxed_answer,
    braced_group,
    final_boxed,
    last_boxed,
    skip_spaces,
)
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.corrections import after_answer, separates
from megatron_rl.rewards.stated import (
    PATTERN_WINDOW,
    bare_answer,
    clean_answer,
    stated_answer,
    tag_content,
    unwrap_math,
)
from megatron_rl.rewards.units import scaled, split_unit

__all__ = [
    "answer_section",
    "extract_code",
    "extract_math_answer",
    "final_answer",
    "final_boxed",
    "integer_answer",
    "last_boxed",
    "nesting_depth",
    "unevaluated_operator",
    "unsafe_reason",
    "unwrap_math",
]

_OPENERS = "{(["
_CLOSERS = "})]"
_FINAL_ANSWER_RE = re.compile(r"(?i)\bfinal\s{1,8}answer\b")
# "answer" after the box: "So the answer is 8.", "Corrected answer: 8" (not ``<answer>``).
_ANSWER_AFTER_RE = re.compile(r"(?i)(?<![</])\banswer\b(?!>)")
# A word of prose (three letters or more once LaTeX commands are gone): "7 makes sense".
_PROSE_WORD_RE = re.compile(r"[A-Za-z]{3,}")
_LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
_LEADING_NUMBER_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")
# After a stated number, what goes on computing it ("7/2", "7-8", "7^2", "7!", "7 \\cdot 2"),
# and the words that change it or offer another ("7 times 2", "7 or more", "7 less than 15").
_NUMBER_GOES_ON_RE = re.compile(r"\s{0,4}(?:[-+*/^!×·÷−]|\\(?:cdot|times|div|pm)(?![A-Za-z])|,?\d)")
_NEXT_WORD_RE = re.compile(r"\s{1,4}([A-Za-z]+)")
_VALUE_WORDS = frozenset(
    "times plus minus divided over squared cubed factorial percent root or to and more less "
    "fewer than".split()
)
_DIGITS_RE = re.compile(r"\d+")
_FACTORIAL_RE = re.compile(r"(\d+)\s{0,8}!")
_INTEGER_RE = re.compile(r"[+-]?\d+")
_CODE_FENCE_RE = re.compile(r"```[ \t]{0,8}([A-Za-z0-9_+-]{0,20})[ \t]{0,8}\n")
PYTHON_TAGS = ("python", "py", "python3")  # fence languages read as Python


def fenced_blocks(section: str) -> Iterator[tuple[str, str]]:
    """``(language, body)`` of each closed fenced block of ``section``, in order (the language
    lower-cased, "" when untagged); an unclosed fence ends the scan."""
    pos = 0
    while True:
        fence = _CODE_FENCE_RE.search(section, pos)
        if fence is None:
            return
        end = section.find("```", fence.end())
        if end < 0:
            return
        yield fence.group(1).lower(), section[fence.end() : end]
        pos = end + 3


def answer_section(response: str, think_end_tag: str, require_think_end: bool) -> str | None:
    """The part of a response after its thinking, or None when there is none.

    The text after the last ``think_end_tag`` is the answer. A response that never closes
    its thinking has no answer (None) when ``require_think_end``; otherwise all of it is.
    """
    end = response.rfind(think_end_tag)
    if end < 0:
        return None if require_think_end else response
    return response[end + len(think_end_tag) :]


def _opened(text: str, brackets: str = "([") -> int:
    """How many of ``brackets`` (round and square, by default the openers) ``text`` holds."""
    return sum(text.count(bracket) for bracket in brackets[:2])


def final_answer(text: str, stated: bool = True) -> str | None:
    """The final answer of ``text``: its final boxed answer (``final_boxed``), unless a
    "final answer" that states math follows the last box (the rightmost wins, as in
    Math-Verify; prose such as "the final answer is exact" does not override the box);
    without a box, the stated answer (``stated_answer``) when ``stated``."""
    boxed = boxed_answer(text, separates)
    if boxed is None:
        found = stated_answer(text) if stated else None
        if found is None:
            return None
        window = text[-PATTERN_WINDOW:]
        at = window.rfind(found)
        corrected = after_answer(window[at + len(found) :], found) if at >= 0 else None
        return found if corrected is None else corrected or None
    answer, end = boxed
    corrected = after_answer(text[end:], clean_answer(answer))
    if corrected is not None:
        # The last stated answer counts: a box then "that is wrong: the value is 6" is 6;
        # a box retracted with no value stated, or hedged ("otherwise 8"), is no answer.
        return corrected or None
    if stated and _ANSWER_AFTER_RE.search(text, end):
        # The last stated answer counts (``_restates``); after a mere "answer" (not "final
        # answer") the value must follow the word ("The answer squared is 49" leaves it).
        final = _FINAL_ANSWER_RE.search(text, end) is not None
        after = stated_answer(text[end:], math_only=True, clause=final)
        # "(Answer: 7)": the bracket that closes the remark is no part of the value.
        while after and after[-1] in ")]" and _opened(after) < _opened(after, _CLOSERS):
            after = after[:-1].rstrip()
        if after is not None and _restates(after, clean_answer(answer), text, end):
            return after
    return clean_answer(answer) or None


def _restates(after: str, boxed: str, text: str, end: int) -> bool:
    """The answer ``after``, stated after a box (``boxed``) that ends at ``text[end]``,
    replaces it: the last stated answer counts ("$\\boxed{7}$. So the answer is 8." is 8).
    After "final answer" any math does; after a mere "answer", a value without prose, or
    one whose leading number is not the box's ("The answer is 8 apples"): "The answer 7
    makes sense" leaves the box."""
    if _FINAL_ANSWER_RE.search(text, end) is not None:
        return True
    if not _PROSE_WORD_RE.search(_LATEX_COMMAND_RE.sub("", after)):
        return True
    number = _LEADING_NUMBER_RE.match(after)
    if number is None:
        return False
    unit = split_unit(boxed)  # "7 cm long" restates the box 7\text{ cm}
    if number.group(0) != "".join((unit[0] if unit else boxed).split()):
        return True
    # The box's number, then a noun ("7 apples", "7, i.e. seven") leaves the box; what
    # changes the number ("7/2 apples", "7-8", "7 hundred", "7 or more", "7 less than 15",
    # "7 times 2") states another value.
    if _NUMBER_GOES_ON_RE.match(after, number.end()) or scaled(after) != after:
        return True
    word = _NEXT_WORD_RE.match(after, number.end())
    return word is not None and word.group(1).lower() in _VALUE_WORDS


def _pattern_answer(section: str, pattern: str) -> str | None:
    match = None
    for found in re.finditer(pattern, section[-PATTERN_WINDOW:]):
        match = found
    return None if match is None else clean_answer(match.group(1)) or None


def extract_math_answer(response: str, config: RewardConfig) -> str | None:
    """The final answer of a math response, or None when it has none.

    Steps: reject over-long responses, keep the text after the thinking and, when it has
    one, only the content of its last ``<config.answer_tag>`` (R1-Zero's
    ``<answer>...</answer>``); then ``final_answer``: the final ``\\boxed{...}`` (several
    that end the text together form one set) or a "final answer" stated after it, else the
    last match of ``config.answer_pattern`` near the end when one is set, else the stated
    answer when ``config.stated_answer``, else all of the tag's content.
    """
    if len(response) > config.max_response_chars:
        return None
    section = answer_section(response, config.think_end_tag, config.require_think_end)
    if section is None:
        return None
    tagged = tag_content(section, config.answer_tag) if config.answer_tag else None
    if tagged is not None:
        section = tagged
    if config.answer_pattern and boxed_answer(section) is None:
        found = _pattern_answer(section, config.answer_pattern)
        if found is not None:
            return found
    found = final_answer(section, config.stated_answer)
    if found is None and tagged is not None:
        found = bare_answer(tagged)
    return found


def nesting_depth(text: str) -> int:
    """Maximum bracket nesting depth of ``text`` (all of {[( count, escaped or not)."""
    depth = best = 0
    for ch in text:
        if ch in _OPENERS:
            depth += 1
            best = max(best, depth)
        elif ch in _CLOSERS:
            depth = max(depth - 1, 0)
    return best


def _exponent(text: str, i: int) -> tuple[str, int]:
    """The exponent token starting at ``text[i]`` (after ``^``) and the index after it."""
    i = skip_spaces(text, i)
    for opener, closer in ("{}", "()"):
        group = braced_group(text, i, opener, closer)
        if group is not None:
            return group
    j = i
    if j < len(text) and text[j] in "+-":
        j += 1
    start_digits = j
    while j < len(text) and text[j].isdigit():
        j += 1
    if j > start_digits:
        return text[i:j], j
    if j < len(text) and text[j] == "\\":
        j += 1
        while j < len(text) and text[j].isalpha():
            j += 1
        return text[i:j], j
    return text[i : i + 1], min(i + 1, len(text))


def _power_reason(answer: str, max_exponent: int) -> str | None:
    text = answer.replace("**", "^")
    i = text.find("^")
    while i >= 0:
        exponent, after = _exponent(text, i + 1)
        if "^" in exponent or "!" in exponent:
            return "power in an exponent"
        for digits in _DIGITS_RE.findall(exponent):
            if int(digits) > max_exponent:
                return f"exponent above {max_exponent}"
        nxt = skip_spaces(text, after)
        if nxt < len(text) and text[nxt] == "^":
            return "power tower"
        i = text.find("^", max(after, i + 1))
    return None


def unsafe_reason(answer: str, config: RewardConfig) -> str | None:
    """Why an extracted answer must not reach a symbolic verifier, or None when it may.

    Rejects what could make parsing or evaluation hang or blow up: long strings, deep
    nesting, long integer literals, exponents that are large literals or powers themselves
    (``9^{9^{9^9}}``), power towers, and factorials of large literals. The worker time limit
    still backs this up for what a static check cannot see.
    """
    if len(answer) > config.max_answer_chars:
        return f"answer longer than {config.max_answer_chars} characters"
    if nesting_depth(answer) > config.max_nesting_depth:
        return f"nesting deeper than {config.max_nesting_depth}"
    for digits in _DIGITS_RE.findall(answer):
        if len(digits) > config.max_number_digits:
            return f"number with more than {config.max_number_digits} digits"
    reason = _power_reason(answer, config.max_exponent)
    if reason is not None:
        return reason
    for match in _FACTORIAL_RE.finditer(answer):
        if int(match.group(1)) > config.max_factorial:
            return f"factorial above {config.max_factorial}"
    return None


# Operators that a final answer must have evaluated: integrals, sums, products, limits,
# derivatives, gcd / lcm / max / min, determinants, floor and ceiling. An answer holding one restates the question.
_OPERATOR_RE = re.compile(
    r"\\(?:[iod]{0,3}int|sum|prod|lim|limsup|liminf|gcd|lcm|max|min|det|partial|nabla|lfloor|lceil)"
    r"(?![A-Za-z])"
    r"|\\(?:operatorname\*?|text|mathrm|textrm)\s{0,4}\{\s{0,4}(?i:gcd|lcm|max|lim|det)\s{0,4}\}"
    # ``\text{min}`` ending the answer, with a power or none, is the unit (``5\text{ min}``,
    # ``300\text{ min}^{-1}``), not the operator.
    r"|\\(?:operatorname\*?|text|mathrm|textrm)\s{0,4}\{\s{0,4}(?i:min)\s{0,4}\}"
    r"(?!\s{0,4}(?:\^\s{0,4}(?:\{\s{0,4}-?\s{0,4}\d\s{0,4}\}|\d)\s{0,4})?$)"
    r"|\\[dt]?frac\s{0,4}\{\s{0,4}(?:d|\\mathrm\s{0,4}\{\s{0,4}d\s{0,4}\})(?:\^\{?\d\}?)?\s{0,4}\}"
    r"\s{0,4}\{\s{0,4}(?:d|\\mathrm\s{0,4}\{\s{0,4}d\s{0,4}\})\s{0,4}[A-Za-z]"
    r"|(?<![A-Za-z])(?i:gcd|lcm)\s{0,4}\(|(?<![A-Za-z\\])d/d[A-Za-z]"
)


def unevaluated_operator(answer: str) -> str | None:
    """The first operator left unevaluated in ``answer`` (``\\int``, ``\\sum``, ``\\lim``,
    ``\\frac{d}{dx}``, ``\\gcd`` ...), or None. ``\\int_0^1 x^2dx`` for 1/3 restates the
    question; Math-Verify evaluated it and paid."""
    found = _OPERATOR_RE.search(answer[:2000])
    return None if found is None else found.group(0)


def integer_answer(text: str) -> int | None:
    """``text`` as an int when it is a plain integer literal (spaces allowed), else None."""
    compact = text.replace(" ", "")
    if len(compact) > 400 or not _INTEGER_RE.fullmatch(compact):
        return None
    return int(compact)


def extract_code(response: str, config: RewardConfig) -> str | None:
    """The program of a code response: the last fenced block after the thinking.

    A ```python (or py / python3) block is preferred over an untagged one; other languages
    are ignored. Returns None when there is no block or it is over ``code_max_chars``.
    """
    if len(response) > config.max_response_chars:
        return None
    section = answer_section(response, config.think_end_tag, config.require_think_end)
    if section is None:
        return None
    best: str | None = None
    best_tagged = False
    for language, body in fenced_blocks(section):
        tagged = language in PYTHON_TAGS
        if tagged or (language == "" and not best_tagged):
            best, best_tagged = body, tagged
    if best is None or len(best) > config.code_max_chars or not best.strip():
        return None
    return best
