"""Answer extraction and pre-validation of model text, in plain linear-time Python.

Everything here runs in the trainer process on hostile text, so nothing parses or evaluates
it: the scans are single passes with explicit bounds, the regexes have bounded quantifiers
and only ever see capped slices. What leaves this module for a verifier is a short answer
string that passed ``unsafe_reason``.
"""

from __future__ import annotations

import re

from megatron_rl.rewards.config import RewardConfig

_BOX_COMMANDS: tuple[str, ...] = ("\\boxed", "\\fbox")
# How many \boxed occurrences (from the last) are tried when the last one is unbalanced.
_MAX_BOX_TRIES = 8
# The answer-pattern fallback only looks at the end of the answer section.
_PATTERN_WINDOW = 4096
_OPENERS = "{(["
_CLOSERS = "})]"
_DIGITS_RE = re.compile(r"\d+")
_FACTORIAL_RE = re.compile(r"(\d+)\s{0,8}!")
_INTEGER_RE = re.compile(r"[+-]?\d+")
_CODE_FENCE_RE = re.compile(r"```[ \t]{0,8}([A-Za-z0-9_+-]{0,20})[ \t]{0,8}\n")


def answer_section(response: str, think_end_tag: str, require_think_end: bool) -> str | None:
    """The part of a response after its thinking, or None when there is none.

    The text after the last ``think_end_tag`` is the answer. A response that never closes
    its thinking has no answer (None) when ``require_think_end``; otherwise all of it is.
    """
    end = response.rfind(think_end_tag)
    if end < 0:
        return None if require_think_end else response
    return response[end + len(think_end_tag) :]


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n":
        i += 1
    return i


def braced_group(text: str, i: int, opener: str = "{", closer: str = "}") -> tuple[str, int] | None:
    """Content of the balanced group opening at ``text[i]`` and the index after it.

    Backslash-escaped delimiters (``\\{``) do not count. Returns None when ``text[i]`` is
    not ``opener`` or the group never closes.
    """
    if i >= len(text) or text[i] != opener:
        return None
    depth, j = 0, i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == opener:
            depth += 1
        elif ch == closer:
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], j + 1
        j += 1
    return None


def _box_argument(text: str, i: int) -> tuple[str, int] | None:
    """Argument of a box command whose name ends at ``text[i]``, and the index after it."""
    i = _skip_spaces(text, i)
    group = braced_group(text, i)
    if group is not None:
        return group
    if i < len(text) and text[i] not in "{}$\\":
        # "\boxed 5": the argument is the next run of non-space characters.
        j = i
        while j < len(text) and text[j] not in " \t\n$":
            j += 1
        return text[i:j], j
    return None


def _unwrap_boxes(content: str) -> str:
    """``\\boxed{\\boxed{x}}`` -> ``x``; a box that is only part of the content stays."""
    for _ in range(_MAX_BOX_TRIES):
        inner = content.strip()
        cmd = next((c for c in _BOX_COMMANDS if inner.startswith(c)), None)
        if cmd is None:
            break
        argument = _box_argument(inner, len(cmd))
        if argument is None or argument[1] != len(inner):
            break
        content = argument[0]
    return content


def _next_box(text: str, pos: int) -> tuple[int, str]:
    found = [(text.find(cmd, pos), cmd) for cmd in _BOX_COMMANDS]
    hits = [hit for hit in found if hit[0] >= 0]
    return min(hits) if hits else (-1, "")


def last_boxed(text: str) -> str | None:
    """Content of the last top-level balanced ``\\boxed{...}`` (or ``\\fbox``).

    Boxes inside a box belong to it (``\\boxed{\\boxed{a} + b}`` is ``\\boxed{a} + b``); a box
    that is all of the content is unwrapped (``\\boxed{\\boxed{5}}`` is ``5``). One forward
    pass; unclosed boxes are retried at most ``_MAX_BOX_TRIES`` times (linear time).
    """
    last: str | None = None
    pos, unclosed = 0, 0
    while unclosed < _MAX_BOX_TRIES:
        start, cmd = _next_box(text, pos)
        if start < 0:
            break
        argument = _box_argument(text, start + len(cmd))
        if argument is None:
            unclosed += 1
            pos = start + len(cmd)
            continue
        last, pos = argument
    return None if last is None else _unwrap_boxes(last)


def _clean(answer: str) -> str:
    answer = answer.strip()
    for _ in range(4):
        stripped = answer.strip("$ \t\n").removesuffix(".").strip()
        if stripped == answer:
            break
        answer = stripped
    return answer


def extract_math_answer(response: str, config: RewardConfig) -> str | None:
    """The final answer of a math response, or None when it has none.

    Steps: reject over-long responses, keep the text after the thinking, take the last
    ``\\boxed{...}``, else the last match of ``config.answer_pattern`` near the end.
    """
    if len(response) > config.max_response_chars:
        return None
    section = answer_section(response, config.think_end_tag, config.require_think_end)
    if section is None:
        return None
    boxed = last_boxed(section)
    if boxed is not None:
        return _clean(boxed) or None
    if not config.answer_pattern:
        return None
    match = None
    for found in re.finditer(config.answer_pattern, section[-_PATTERN_WINDOW:]):
        match = found
    if match is None:
        return None
    return _clean(match.group(1)) or None


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
    i = _skip_spaces(text, i)
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
        nxt = _skip_spaces(text, after)
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
    pos = 0
    while True:
        fence = _CODE_FENCE_RE.search(section, pos)
        if fence is None:
            break
        end = section.find("```", fence.end())
        if end < 0:
            break
        language = fence.group(1).lower()
        tagged = language in ("python", "py", "python3")
        if tagged or (language == "" and not best_tagged):
            best, best_tagged = section[fence.end() : end], tagged
        pos = end + 3
    if best is None or len(best) > config.code_max_chars or not best.strip():
        return None
    return best
