"""Boxed answers (``\\boxed{...}``, ``\\fbox{...}``) and the wrappers around an answer.

Linear-time scans of hostile text with explicit bounds; nothing here parses or evaluates it.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable

_BOX_COMMANDS: tuple[str, ...] = ("\\boxed", "\\fbox")
# Bold (AMC / AIME choices: ``\textbf{(C)}``) is markup around an answer, not part of it.
_BOLD_COMMANDS: tuple[str, ...] = ("\\textbf", "\\mathbf", "\\boldsymbol")
# How many \boxed occurrences (from the last) are tried when the last one is unbalanced,
# and how many wrappers ``unwrap_answer`` takes off.
_MAX_BOX_TRIES = 8
# How many top-level boxes (the last ones) a response keeps for its final answer.
_MAX_BOXES = 32
# Between boxes that form one answer (Math-Verify's VALID_SEPARATOR_PATTERN).
_SEPARATOR_RE = re.compile(r"\b(?:and|or)\b|,|;")
# Longer contents are left wrapped: far over any answer length limit, they score incorrect
# anyway, and each unwrapping step reads all of them.
_MAX_UNWRAP_CHARS = 10_000
# Characters that make a parenthesised answer a tuple or an interval ("(1,2)", "(1;2)").
_TUPLE_MARKS = ",;"


def skip_spaces(text: str, i: int) -> int:
    """The first index from ``i`` that is not a space, tab or newline."""
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
    i = skip_spaces(text, i)
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


def _command_argument(text: str, commands: tuple[str, ...]) -> str | None:
    """``x`` when all of ``text`` is one of ``commands`` applied to ``x`` (``\\textbf{x}``)."""
    cmd = next((c for c in commands if text.startswith(c)), None)
    if cmd is None or text[len(cmd) : len(cmd) + 1].isalpha():  # \boxedx, \textbfseries
        return None
    argument = _box_argument(text, len(cmd))
    if argument is None or argument[1] != len(text):
        return None
    return argument[0]


def _bare_parenthesised(text: str) -> str | None:
    """``073`` for ``(073)`` and ``B`` for ``(B)``: an answer in one pair of parentheses
    that is no tuple or interval (no comma or semicolon inside), else None."""
    group = braced_group(text, 0, "(", ")")
    if group is None or group[1] != len(text) or not group[0].strip():
        return None
    if any(mark in group[0] for mark in _TUPLE_MARKS):
        return None
    return group[0]


def unwrap_answer(content: str) -> str:
    """``content`` without the markup that wraps all of it: boxes (``\\boxed{\\boxed{x}}``),
    bold (``\\textbf{(073)}``) and a parenthesised bare answer (``(B)``); a wrapper around
    only part of the content stays (``\\boxed{a}+b``, ``(1,2)``, ``(x+1)(x-1)``)."""
    if len(content) > _MAX_UNWRAP_CHARS:
        return content.strip()
    for _ in range(_MAX_BOX_TRIES):
        inner = content.strip()
        for unwrap in (
            lambda t: _command_argument(t, _BOX_COMMANDS),
            lambda t: _command_argument(t, _BOLD_COMMANDS),
            _bare_parenthesised,
        ):
            found = unwrap(inner)
            if found is not None:
                content = found
                break
        else:
            break
    return content.strip()


def _next_box(text: str, pos: int, found: dict[str, int]) -> tuple[int, str]:
    """The first box command at or after ``pos``. ``found`` keeps each command's next
    occurrence, so that a command that is absent is not searched for again at every box
    (which made a scan of many boxes quadratic)."""
    for cmd in _BOX_COMMANDS:
        known = found.get(cmd)
        if known is None or 0 <= known < pos:  # -1: absent from here on
            found[cmd] = text.find(cmd, pos)
    hits = [(found[cmd], cmd) for cmd in _BOX_COMMANDS if found[cmd] >= 0]
    return min(hits) if hits else (-1, "")


def top_level_boxes(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, content)`` of the last ``_MAX_BOXES`` top-level boxes of ``text``.

    ``start`` is where the command begins, ``end`` the index after its argument. Boxes
    inside a box belong to it. An empty box (``put it in \\boxed{}``) is an instruction, not
    an answer, and is left out. One forward pass; unclosed boxes are retried at most
    ``_MAX_BOX_TRIES`` times (linear time).
    """
    boxes: deque[tuple[int, int, str]] = deque(maxlen=_MAX_BOXES)
    found: dict[str, int] = {}
    pos, unclosed = 0, 0
    while unclosed < _MAX_BOX_TRIES:
        start, cmd = _next_box(text, pos, found)
        if start < 0:
            break
        argument = _box_argument(text, start + len(cmd))
        if argument is None:
            unclosed += 1
            pos = start + len(cmd)
            continue
        content, pos = argument
        if content.strip():
            boxes.append((start, pos, content))
    return list(boxes)


def last_boxed(text: str) -> str | None:
    """Content of the last top-level balanced ``\\boxed{...}`` (or ``\\fbox``).

    Boxes inside a box belong to it (``\\boxed{\\boxed{a} + b}`` is ``\\boxed{a} + b``); a box
    that is all of the content is unwrapped (``\\boxed{\\boxed{5}}`` is ``5``).
    """
    boxes = top_level_boxes(text)
    return unwrap_answer(boxes[-1][2]) if boxes else None


# A box that is denied: "It is $\\boxed{7}$, not $\\boxed{8}$", "it isn't \\boxed{8}".
_DENIED_RE = re.compile(r"(?i)\b(?:not|isn(?:'|’)t|never)\s{0,4}(?:\$\$?|\\[(\[])?\s{0,4}$")


def _denied(text: str, start: int) -> bool:
    """The box starting at ``text[start]`` follows a "not": it says what the answer is not."""
    return _DENIED_RE.search(text[max(0, start - 24) : start]) is not None


def boxed_answer(
    text: str, separate: Callable[[str], bool] | None = None
) -> tuple[str, int] | None:
    """``(final_boxed(text), index after its last box)``, or None without a box. A denied
    box (``not \\boxed{8}``) is no part of it, nor a box that ``separate`` (given the
    text between two boxes) sets apart from the last: "$\\boxed{7}$ was wrong; $\\boxed{8}$"."""
    boxes = [box for box in top_level_boxes(text) if not _denied(text, box[0])]
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
        if not joined or (separate is not None and separate(between)):
            break
        if content != contents[-1]:
            contents.append(content)
        next_start = start
    return ",".join(unwrap_answer(c) for c in reversed(contents)), boxes[-1][1]


def final_boxed(text: str) -> str | None:
    """The boxed final answer of ``text``: its last box, with the boxes that end the text
    together, joined by commas as one set (``\\boxed{1} and \\boxed{-2}`` is ``1,-2``).

    Math-Verify's rule (``latex2sympy2_extended.extract_boxed_content``): walking back from
    the last box, an earlier box joins when less than 10 characters separate them, or less
    than 70 that hold a separator (and, or, a comma or a semicolon) and the two contents
    differ. A repeated content counts once (``\\boxed{4} ... \\boxed{4}`` is ``4``).
    """
    found = boxed_answer(text)
    return None if found is None else found[0]
