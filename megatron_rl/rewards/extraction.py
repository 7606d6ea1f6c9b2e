"""Answer extraction and pre-validation of model text, in plain linear-time Python.

Everything here runs in the trainer process on hostile text, so nothing parses or evaluates
it: the scans are single passes with explicit bounds, the regexes have bounded quantifiers
and only ever see capped slices. What leaves this module for a verifier is a short answer
string that passed ``unsafe_reason``.
"""

from __future__ import annotations

import re
from collections import deque

from megatron_rl.rewards.config import RewardConfig

_BOX_COMMANDS: tuple[str, ...] = ("\\boxed", "\\fbox")
# How many \boxed occurrences (from the last) are tried when the last one is unbalanced.
_MAX_BOX_TRIES = 8
# How many top-level boxes (the last ones) a response keeps for its final answer.
_MAX_BOXES = 32
# The stated-answer and answer-pattern fallbacks only look at the end of the answer section.
_PATTERN_WINDOW = 4096
# How many "answer" anchors (from the last) the stated-answer fallback tries.
_MAX_ANCHOR_TRIES = 8
# Longest math span read as a stated answer.
_MAX_SPAN = 1000
# (opener, closer, inline): inline spans stay on one line.
_MATH_DELIMITERS = (
    ("$$", "$$", False),
    ("\\[", "\\]", False),
    ("\\(", "\\)", True),
    ("$", "$", True),
)
# Between boxes that form one answer (Math-Verify's VALID_SEPARATOR_PATTERN).
_SEPARATOR_RE = re.compile(r"\b(?:and|or)\b|,|;")
_ANSWER_ANCHOR_RE = re.compile(r"(?i)\banswer\b")
_FINAL_ANSWER_RE = re.compile(r"(?i)\bfinal\s{1,8}answer\b")
# After "answer": markup, a colon, "is" or "=", in any order ("Answer:** is $5$").
_ANSWER_LEAD_RE = re.compile(r'(?:[\s*:"]|\bis\b|=){0,16}')
# "The largest $n$ is 34": a short clause on one line, then "is".
_CLAUSE_IS_RE = re.compile(r"[^\n]{0,100}?\sis\b[\s:]{0,8}")
_SPAN_LINK_RE = re.compile(r"\s{0,8}(?:,\s{0,8})?(?:(?:and|or)\b)?\s{0,8}")
# A plain-text answer: to the end of the line or sentence ("42.", "3.5. I hope").
_PLAIN_VALUE_RE = re.compile(r"([^\n]{1,300}?)(?:\.\s|\.?$|\n)", re.MULTILINE)
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


def _top_level_boxes(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, content)`` of the last ``_MAX_BOXES`` top-level boxes of ``text``.

    ``start`` is where the command begins, ``end`` the index after its argument. Boxes
    inside a box belong to it. One forward pass; unclosed boxes are retried at most
    ``_MAX_BOX_TRIES`` times (linear time).
    """
    boxes: deque[tuple[int, int, str]] = deque(maxlen=_MAX_BOXES)
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
        content, pos = argument
        boxes.append((start, pos, content))
    return list(boxes)


def last_boxed(text: str) -> str | None:
    """Content of the last top-level balanced ``\\boxed{...}`` (or ``\\fbox``).

    Boxes inside a box belong to it (``\\boxed{\\boxed{a} + b}`` is ``\\boxed{a} + b``); a box
    that is all of the content is unwrapped (``\\boxed{\\boxed{5}}`` is ``5``).
    """
    boxes = _top_level_boxes(text)
    return _unwrap_boxes(boxes[-1][2]) if boxes else None


def _final_boxed(text: str) -> tuple[str, int] | None:
    boxes = _top_level_boxes(text)
    if not boxes:
        return None
    contents = [boxes[-1][2].strip()]
    next_start = boxes[-1][0]
    for start, end, content in reversed(boxes[:-1]):
        content = content.strip()
        between = text[end:next_start]
        joined = len(between) < 10 or (
            len(between) < 70 and content != contents[-1] and _SEPARATOR_RE.search(between)
        )
        if not joined:
            break
        if content != contents[-1]:
            contents.append(content)
        next_start = start
    return ",".join(_unwrap_boxes(c) for c in reversed(contents)), boxes[-1][1]


def final_boxed(text: str) -> str | None:
    """The boxed final answer of ``text``: its last box, with the boxes that end the text
    together, joined by commas as one set (``\\boxed{1} and \\boxed{-2}`` is ``1,-2``).

    Math-Verify's rule (``latex2sympy2_extended.extract_boxed_content``): walking back from
    the last box, an earlier box joins when less than 10 characters separate them, or less
    than 70 that hold a separator (and, or, a comma or a semicolon) and the two contents
    differ. A repeated content counts once (``\\boxed{4} ... \\boxed{4}`` is ``4``).
    """
    found = _final_boxed(text)
    return None if found is None else found[0]


def _clean(answer: str) -> str:
    answer = answer.strip()
    for _ in range(4):
        stripped = answer.strip("$ \t\n").removesuffix(".").strip()
        if stripped == answer:
            break
        answer = stripped
    return answer


def _math_span(text: str, i: int) -> tuple[str, int] | None:
    """Content of the math span (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``) opening at
    ``text[i]`` and the index after it, or None. Inline spans stay on one line (as in
    Math-Verify); escaped characters (``\\$``) do not close a span. Bounded by ``_MAX_SPAN``.
    """
    for opener, closer, inline in _MATH_DELIMITERS:
        if not text.startswith(opener, i):
            continue
        j = i + len(opener)
        limit = min(len(text), j + _MAX_SPAN)
        while j < limit:
            if text.startswith(closer, j):
                return text[i + len(opener) : j], j + len(closer)
            if text[j] == "\\":
                j += 2
                continue
            if inline and text[j] == "\n":
                return None
            j += 1
        return None
    return None


def _math_spans(text: str, i: int) -> tuple[str, int] | None:
    """Math spans from ``text[i]`` joined by commas, "and" or "or" (``$12$ and $13$`` is
    ``12,13``, as Math-Verify reads up to 6 such spans as one set)."""
    first = _math_span(text, i)
    if first is None:
        return None
    parts, end = [first[0].strip()], first[1]
    for _ in range(5):
        link = _SPAN_LINK_RE.match(text, end)
        following = _math_span(text, link.end()) if link else None
        if following is None:
            break
        parts.append(following[0].strip())
        end = following[1]
    return ",".join(parts), end


def unwrap_math(text: str) -> str:
    """``text`` with its math delimiters removed (``$125$ miles`` is ``125 miles``).

    Used on references (trusted); a delimiter that never closes is left as it is.
    """
    out, i = [], 0
    while i < len(text):
        span = _math_span(text, i) if text[i] in "$\\" else None
        if span is None:
            out.append(text[i])
            i += 1
            continue
        out.append(span[0])
        i = span[1]
    return _clean("".join(out))


def _value_at(text: str, i: int, clause: bool = True) -> str | None:
    """The answer written at ``text[i]``: math spans, else plain text to the end of the
    sentence or line; a clause such as "The volume of $V$ is 120" gives what follows "is"."""
    spans = _math_spans(text, i)
    if spans is not None:
        return spans[0]
    if clause and i < len(text) and text[i].isalpha():
        found = _CLAUSE_IS_RE.match(text, i)
        if found is not None:
            return _value_at(text, found.end(), clause=False)
    plain = _PLAIN_VALUE_RE.match(text, i)
    return plain.group(1) if plain else None


def stated_answer(section: str) -> str | None:
    """The answer stated after the last usable "answer" near the end of ``section``.

    Reads "The final answer is $X$. I hope it is correct." (Minerva), "Final Answer: The
    final answer is $X$", "The answer is: 42", "**Final Answer:** $\\frac12$", "Answer \\[ 9 \\]".
    Linear: one scan of the last ``_PATTERN_WINDOW`` characters, then at most
    ``_MAX_ANCHOR_TRIES`` bounded reads from the last anchors back.
    """
    window = section[-_PATTERN_WINDOW:]
    anchors = [m.end() for m in _ANSWER_ANCHOR_RE.finditer(window)]
    for anchor in reversed(anchors[-_MAX_ANCHOR_TRIES:]):
        value = _value_at(window, _ANSWER_LEAD_RE.match(window, anchor).end())
        if value is not None and _clean(value):
            return _clean(value)
    return None


def final_answer(text: str, stated: bool = True) -> str | None:
    """The final answer of ``text``: its final boxed answer (``final_boxed``), unless a
    "final answer" statement follows the last box (the rightmost wins, as in Math-Verify);
    without a box, the stated answer (``stated_answer``) when ``stated``."""
    boxed = _final_boxed(text)
    if boxed is None:
        return stated_answer(text) if stated else None
    answer, end = boxed
    if stated and _FINAL_ANSWER_RE.search(text, end):
        after = stated_answer(text[end:])
        if after is not None:
            return after
    return _clean(answer) or None


def extract_math_answer(response: str, config: RewardConfig) -> str | None:
    """The final answer of a math response, or None when it has none.

    Steps: reject over-long responses, keep the text after the thinking, then
    ``final_answer``: the final ``\\boxed{...}`` (several that end the text together form
    one set) or a "final answer" stated after it, else the last match of
    ``config.answer_pattern`` near the end when one is set, else the stated answer when
    ``config.stated_answer``.
    """
    if len(response) > config.max_response_chars:
        return None
    section = answer_section(response, config.think_end_tag, config.require_think_end)
    if section is None:
        return None
    if config.answer_pattern and _final_boxed(section) is None:
        match = None
        for found in re.finditer(config.answer_pattern, section[-_PATTERN_WINDOW:]):
            match = found
        if match is not None:
            return _clean(match.group(1)) or None
    return final_answer(section, config.stated_answer)


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
