"""Answers written in prose and math spans: "The final answer is $X$", ``<answer>X</answer>``.

Linear-time reads of hostile text: every scan is bounded, and the regexes have bounded
quantifiers and only see capped slices. Nothing here parses or evaluates the text.
"""

from __future__ import annotations

import re

from megatron_rl.rewards.boxes import unwrap_answer

# The stated-answer fallback only looks at the end of the answer section.
PATTERN_WINDOW = 4096
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
# The word "answer", but not the name of an answer tag (``<answer>``, ``</answer>``).
# "The correct option is (C)", "the right choice is B" anchor an answer too.
_ANSWER_ANCHOR_RE = re.compile(
    r"(?i)(?<![</])\b(?:answer|(?:correct|right)\s{1,4}(?:option|choice))\b(?!>)"
)
# After "answer": markup, a colon, "is" or "=", in any order ("Answer:** is $5$"); not the
# emphasis that opens the answer ("is *x* = 2", "is **33**").
# A comma too: "The answer, **tan A = 2**, matches the figure".
# "would be", "should be" and a remark of words in brackets ("Answer (corrected): 8", not
# the option "(C)") lead to it too.
_ANSWER_LEAD_RE = re.compile(
    r'(?:[\s:",]|[*_`]++(?=[\s:"=]|$)|\bis\b|=|\b(?:would|should|must|will)\s{1,4}be\b'
    r"|\([A-Za-z]{2}[A-Za-z ]{0,18}\)){0,16}"
)
# "The largest $n$ is 34": a short clause on one line, then "is".
_CLAUSE_IS_RE = re.compile(r"[^\n]{0,100}?\sis\b[\s:]{0,8}")
_SPAN_LINK_RE = re.compile(r"\s{0,8}(?:,\s{0,8})?(?:(?:and|or)\b)?\s{0,8}")
# A plain-text answer: to the end of the line or sentence ("42.", "3.5. I hope").
_PLAIN_VALUE_RE = re.compile(r"([^\n]{1,300}?)(?:\.\s|\.?$|\n)", re.MULTILINE)
# Bold (``**4**``, ``__4__``) holds an answer of at most this many characters, on one line.
_MAX_BOLD = 300
_BOLD_MARKS = ("**", "__")
# What states the value in bold that ends a response: "The value of *x* is **4**.".
_STATES_VALUE_RE = re.compile(r"(?i)(?:\bis|\bare|\bequals|\bbe|=|:)\s{0,8}[*_]?$")
# After that bold, only the end of the sentence.
_SENTENCE_END = " \t\n.!"
# Markdown around a plain-text answer: emphasis and code marks ("**33**", "`42`").
_MARKDOWN_MARKS = "*_`"
# Emphasis around a word inside a plain-text answer ("*x* = 2"); never "2*3*4" (a product:
# the marks must not touch a word character on their outer side).
_EMPHASIS_RE = re.compile(
    r"(?<![\w*])(\*{1,2}|_{1,2})(?=[^\s*_])([^*_\n]{1,80}?)(?<=\S)\1(?![\w*])"
)
# "x = 2" stated in plain text: the variable name is not part of the answer.
_ASSIGNMENT_RE = re.compile(r"[A-Za-z]\s{0,8}=\s{0,8}(?=\S)")
_COMMA_RE = re.compile(r",\s{1,8}")
# A plain-text token that is a word of prose once punctuation around it is taken off.
_WORD_PUNCTUATION = "()[],.;:!?\"'" + _MARKDOWN_MARKS
# Kinds of stated value: math (a span, a number, an expression), a single word ("yes",
# "even": an answer only when nothing better is stated), or a clause of prose (never one).
MATH, WORD, PROSE = "math", "word", "prose"


def clean_answer(answer: str) -> str:
    """``answer`` without the math delimiters, spaces and final period around it."""
    answer = answer.strip()
    for _ in range(4):
        stripped = answer.strip("$ \t\n").removesuffix(".").strip()
        if stripped == answer:
            break
        answer = stripped
    return answer


def math_span(text: str, i: int) -> tuple[str, int] | None:
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
    first = math_span(text, i)
    if first is None:
        return None
    parts, end = [first[0].strip()], first[1]
    for _ in range(5):
        link = _SPAN_LINK_RE.match(text, end)
        following = math_span(text, link.end()) if link else None
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
        span = math_span(text, i) if text[i] in "$\\" else None
        if span is None:
            out.append(text[i])
            i += 1
            continue
        out.append(span[0])
        i = span[1]
    return clean_answer("".join(out))


def _without_trailing_clause(value: str) -> str:
    """``3/8`` for ``3/8, and the final answer is exact`` and ``7`` for ``7, not 8``: a comma
    followed by "not" or by two words of prose ends the answer (``1, 2``,
    ``x = 1, and x = 2``, ``[2, infinity)`` stay)."""
    for comma in _COMMA_RE.finditer(value):
        following = value[comma.end() :].split(maxsplit=2)
        if following and following[0].lower() == "not":  # "7, not 8": 8 is denied
            return value[: comma.start()]
        if len(following) >= 2 and _is_word(following[0]) and _is_word(following[1]):
            return value[: comma.start()]
    return value


def _plain_answer(value: str) -> str:
    """A plain-text answer without markdown (``**33**``, ``9**``, ``*x* = 2``), a trailing
    clause (``_without_trailing_clause``) and a leading ``x =`` (as ``\\text{}`` is taken
    off LaTeX answers)."""
    value = _without_trailing_clause(_EMPHASIS_RE.sub(r"\2", value))
    for _ in range(4):
        stripped = clean_answer(value.strip(_MARKDOWN_MARKS + " \t"))
        if stripped == value:
            break
        value = stripped
    assignment = _ASSIGNMENT_RE.match(value)
    if assignment is not None and not any(c in value[assignment.end() :] for c in "=<>"):
        value = value[assignment.end() :]
    return value


def _is_word(token: str) -> bool:
    bare = token.strip(_WORD_PUNCTUATION)
    return len(bare) >= 2 and bare.isalpha() and bare.isascii()


def plain_kind(value: str) -> str:
    """MATH, WORD or PROSE: what a plain-text stated value is. Prose starts with two words
    ("correct to the nearest hundredth", "expressed in exact form"); one word alone is a
    WORD; anything else (a number, "12 square units", "x + 1", "B") is MATH."""
    tokens = value.split(maxsplit=2)
    if not tokens:
        return PROSE
    if len(tokens) == 1 and _is_word(tokens[0]):
        return WORD
    if len(tokens) >= 2 and _is_word(tokens[0]) and _is_word(tokens[1]):
        return PROSE
    return MATH


def _bold_at(text: str, i: int) -> tuple[str, int] | None:
    """Content of the bold span (``**x**``, ``__x__``) opening at ``text[i]`` and the index
    after it, or None; one line and ``_MAX_BOLD`` characters at most."""
    for mark in _BOLD_MARKS:
        if text.startswith(mark, i) and not text.startswith(mark[0], i + 2):
            close = text.find(mark, i + 2, i + 2 + _MAX_BOLD + len(mark))
            content = text[i + 2 : close] if close > i + 2 else ""
            if content.strip() and "\n" not in content:
                return content, close + len(mark)
    return None


def value_at(text: str, i: int, clause: bool = True, bold: bool = True) -> tuple[str, str] | None:
    """``(answer, kind)`` written at ``text[i]``: the content of a bold span there
    ("**tan A = 2**, matches": ``tan A = 2``), math spans (MATH), else plain text to the
    end of the sentence or line (``plain_kind``); a clause such as "The volume of $V$ is
    120" gives what follows "is". Markdown emphasis around the answer is taken off."""
    emphasised = _bold_at(text, i) if bold else None
    if emphasised is not None:
        found = value_at(emphasised[0].strip(), 0, clause, bold=False)
        if found is not None and found[0]:
            return found
    start = i
    while i < len(text) and text[i] in _MARKDOWN_MARKS:
        i += 1
    spans = _math_spans(text, i)
    if spans is not None:
        return clean_answer(unwrap_answer(spans[0])), MATH
    if clause and i < len(text) and text[i].isalpha():
        found = _CLAUSE_IS_RE.match(text, i)
        if found is not None:
            return value_at(text, found.end(), clause=False)
    plain = _PLAIN_VALUE_RE.match(text, start)
    if plain is None:
        return None
    value = _plain_answer(plain.group(1))
    return clean_answer(unwrap_answer(value)), plain_kind(value)


# A math span that ends right before "is our answer" / "as the final answer".
_SPAN_BEFORE_ANCHOR_RE = re.compile(
    r"(?i)\$\s{0,4}(?:is|as)\s{1,4}(?:our|the|my)\s{1,4}(?:final\s{1,4})?$"
)


def _span_before(window: str, anchor: int) -> str | None:
    """The math span (``$x <= 2$``) that an "answer" at ``window[anchor]`` follows as in
    "$x <= 2$ is our answer", or None."""
    lead = _SPAN_BEFORE_ANCHOR_RE.search(window, max(0, anchor - 40), anchor)
    if lead is None:
        return None
    opener = window.rfind("$", max(0, lead.start() - _MAX_SPAN), lead.start())
    span = math_span(window, opener) if opener >= 0 else None
    if span is None or span[1] != lead.start() + 1:
        return None
    return clean_answer(unwrap_answer(span[0])) or None


def stated_answer(section: str, math_only: bool = False, clause: bool = True) -> str | None:
    """The answer stated after the last usable "answer" near the end of ``section``.

    Reads "The final answer is $X$. I hope it is correct." (Minerva), "Final Answer: The
    final answer is $X$", "The answer is: 42", "**Final Answer:** $\\frac12$", "Answer \\[ 9 \\]".
    A clause of prose is no answer ("the final answer is correct to the nearest tenth"): the
    anchor before it is tried. A single word ("The answer is yes") counts only when no
    anchor states math, and never with ``math_only``. Without any, the value in bold that
    ends the text (``closing_bold``), when not ``math_only``. Without ``clause``, the value
    must follow "answer" itself ("the answer is 8", "Answer: 8"), not a clause after it
    ("the answer squared is 49", "the answer to part (b) is 12").
    Linear: one scan of the last ``PATTERN_WINDOW`` characters, then at most
    ``_MAX_ANCHOR_TRIES`` bounded reads from the last anchors back.
    """
    window = section[-PATTERN_WINDOW:]
    anchors = [(m.start(), m.end()) for m in _ANSWER_ANCHOR_RE.finditer(window)]
    word = None
    for start, anchor in reversed(anchors[-_MAX_ANCHOR_TRIES:]):
        before = _span_before(window, start)
        if before is not None:  # "Thus $x <= 2$ is our answer."
            return before
        found = value_at(window, _ANSWER_LEAD_RE.match(window, anchor).end(), clause)
        if found is None or not found[0]:
            continue
        if found[1] == MATH:
            return found[0]
        if found[1] == WORD and word is None:
            word = found[0]
    if math_only:
        return None
    return closing_bold(window) or word


def closing_bold(section: str) -> str | None:
    """The math in bold that ends ``section`` as the value of "is", "=" or ":" ("The value
    of *x* is **4**.", "... in base 9 is **$40_9$**."), else None. A bold value after
    anything else ("is **3** or **4**") is no answer, nor is bold prose."""
    end = len(section.rstrip(_SENTENCE_END))
    window_start = max(0, end - _MAX_BOLD - 4)
    for mark in _BOLD_MARKS:
        if not section.endswith(mark, 0, end):
            continue
        opener = section.rfind(mark, window_start, end - len(mark))
        if opener < 0 or not _STATES_VALUE_RE.search(section, max(0, opener - 40), opener):
            continue
        bold = _bold_at(section, opener)
        if bold is None or section[bold[1] : end].strip("*_"):
            continue
        found = value_at(bold[0].strip(), 0, clause=False, bold=False)
        if found is not None and found[0] and found[1] == MATH:
            return found[0]
    return None


def tag_content(section: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` of ``section`` (to its end when the tag never
    closes), or None when there is no ``<tag>``."""
    opener, closer = f"<{tag}>", f"</{tag}>"
    start = section.rfind(opener)
    if start < 0:
        return None
    start += len(opener)
    end = section.find(closer, start)
    return section[start:] if end < 0 else section[start:end]


def bare_answer(content: str) -> str | None:
    """The answer that is all of ``content`` (an answer tag's): math spans, a clause ending
    in "is X", or plain text to the end of its first sentence or line."""
    content = content.strip()
    found = value_at(content, 0) if content else None
    return found[0] if found is not None and found[0] else None
