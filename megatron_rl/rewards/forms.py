"""Answer forms that the math reward reads itself, before or beside Math-Verify.

Each is a plain, linear-time reading of a short answer that already passed
``extraction.unsafe_reason`` (or of a trusted reference); nothing here evaluates text.

- ``time_of_day``: ``4:30 \\text{ p.m.}``, ``\\text{4:30 p.m.}``, ``7pm``, ``16:30``. Math-Verify
  read ``am`` / ``pm`` as units (attometre, picometre) and dropped them, so ``5pm`` equalled
  ``5am``; a time of day is compared as minutes after midnight, its marker included.
- ``option_letter`` / ``chosen_option``: ``(D) (2,0)`` against the reference ``D`` is ``D``.
- ``scientific_notation``: ``1e-3`` is ``1\\times 10^{-3}``, not e - 3.
- ``normalise_string``: Math-Verify's string fallback without spaces and single-token braces.
- ``base_numeral``: ``40_9`` keeps its base (Math-Verify dropped the subscript).
- ``visible_answer``: the answer as it renders (``\\phantom``, colour, bold, brace groups).
- ``repeating_decimal``: ``0.\\overline{3}`` is ``\\frac{1}{3}``.
"""

from __future__ import annotations

import re

from megatron_rl.rewards.boxes import unwrap_answer

# Wrappers and spacing taken off before a time of day is read.
_TIME_WRAPPER_RE = re.compile(r"\\(?:text|textrm|textnormal|mathrm|mbox)\s{0,4}\{|[{}$]")
_TIME_SPACING_RE = re.compile(r"\\[,;:! ]|~|\s+")
_TIME_RE = re.compile(
    r"(?i)(?:(\d{1,2})(?::(\d{2}))?([ap])\.?m\.?|(\d{1,2}):(\d{2})|(\d{1,2})(?::(\d{2}))?(noon|midnight)|(noon|midnight))"
)
_TIME_MARKER_RE = re.compile(r"(?i)(?<![a-z])(?:[ap]\.?\s{0,2}m\b\.?|noon|midnight)")


def time_of_day(answer: str, marker_required: bool = True) -> int | None:
    """Minutes after midnight of ``answer`` when all of it is a time of day, else None.

    With an am / pm marker (``4:30 p.m.``, ``\\text{4:30 p.m.}``, ``7pm``, ``11\\,\\mathrm{am}``)
    or noon / midnight; without one (``16:30``) only when not ``marker_required``.
    """
    if len(answer) > 100:
        return None
    if marker_required and not _TIME_MARKER_RE.search(answer):
        return None
    text = _TIME_SPACING_RE.sub("", _TIME_WRAPPER_RE.sub("", answer)).rstrip(".")
    found = _TIME_RE.fullmatch(text)
    if found is None:
        return None
    hour_s, minute_s, half, hour24_s, minute24_s, hour_n, minute_n, word_n, word = found.groups()
    if hour24_s is not None:
        hour, minute = int(hour24_s), int(minute24_s)
        return hour * 60 + minute if hour < 24 and minute < 60 else None
    if hour_s is not None:
        hour, minute = int(hour_s), int(minute_s or 0)
        if not 1 <= hour <= 12 or minute >= 60:
            return None
        return (hour % 12 + (12 if half.lower() == "p" else 0)) * 60 + minute
    name = (word_n or word).lower()
    if hour_n is not None and (int(hour_n) != 12 or int(minute_n or 0) != 0):
        return None
    return 12 * 60 if name == "noon" else 0


# A multiple-choice reference: one option letter, maybe in parentheses.
_OPTION_REFERENCE_RE = re.compile(r"\(?\s{0,4}([A-J])\s{0,4}\)?")
# The option letter that opens an answer: ``(D)``, ``\text{(D)}``, ``\textbf{(D)}``, ``D.``,
# ``D:``, ``D)``.
_LEADING_OPTION_RE = re.compile(
    r"\s{0,8}(?:\\(?:text|textbf|textrm|mathbf|mathrm)\s{0,4}\{\s{0,4})?"
    r"(?:\(\s{0,4}([A-J])\s{0,4}\)|([A-J])\s{0,4}[.:)](?=\s|$))"
)
# In the text after the letter, what makes the answer several options: another letter in
# parentheses, or a connective (``(B) or (D)``, ``(A), C``).
_ANOTHER_OPTION_RE = re.compile(
    r"\(\s{0,4}[A-J]\s{0,4}\)|(?<![A-Za-z])(?:or|and)(?![A-Za-z])|\\lor|\\land"
    # Another letter opening an option in any punctuation: "C) 12; D) 14", "C: 12, D: 14",
    # "C. 12; D. 14".
    r"|(?<![A-Za-z\\])[A-J]\s{0,4}[.:)](?=\s|$|\})"
)
_LEADING_SEPARATOR_RE = re.compile(r"[\s}$]{0,8}[,;/&]")


def option_letter(reference: str) -> str | None:
    """The option letter when all of ``reference`` is one (``D``, ``(D)``, ``\\textbf{(D)}``),
    else None."""
    if len(reference) > 100:
        return None
    found = _OPTION_REFERENCE_RE.fullmatch(unwrap_answer(reference))
    return None if found is None else found.group(1)


def chosen_option(answer: str) -> str | None:
    """The option letter of an answer that opens with one and goes on with that option's
    text (``(D) (2,0)``, ``\\text{(C) } 7``, ``B. $2x-2$``), else None; None also when the
    text names another option (``(B) or (D)``: a hedge is no choice)."""
    if len(answer) > 1000:
        return None
    found = _LEADING_OPTION_RE.match(answer)
    if found is None or _LEADING_SEPARATOR_RE.match(answer, found.end()):
        return None
    if _ANOTHER_OPTION_RE.search(answer, found.end()):
        return None
    return found.group(1) or found.group(2)


def option_text(answer: str) -> str | None:
    """The text of the one option an answer opens with (``12`` of ``C) 12``, ``(B) $-1$``),
    for a reference that is that text rather than a letter; None without one, with a hedge
    over options, or with no text after the letter. The closing brace of ``\\text{(C) }``
    and math delimiters are taken off."""
    if chosen_option(answer) is None:
        return None
    found = _LEADING_OPTION_RE.match(answer)
    rest = answer[found.end() :].strip()
    if found.group(0).lstrip().startswith("\\"):
        rest = rest.removeprefix("}").strip()
    rest = rest.strip("$ ")
    return rest or None


def option_hedge(answer: str) -> bool:
    """``answer`` opens with an option letter and names another one (``C) 12; D) 14``,
    ``(B) or (D)``): several options offered, which is no choice of one."""
    if len(answer) > 1000:
        return False
    found = _LEADING_OPTION_RE.match(answer)
    return found is not None and _ANOTHER_OPTION_RE.search(answer, found.end()) is not None


# ``1e-3``, ``2.5E4``: digits on both sides of the ``e`` (a sign only as ``e-``: ``2e+1`` may be
# 2e + 1), not part of a longer token. At most 3 exponent digits (``extraction.unsafe_reason``
# has checked the answer before: a longer exponent stays as it is, which Math-Verify reads
# as Euler's number).
_SCIENTIFIC_RE = re.compile(r"(?<![\w.\\^_])(\d+(?:\.\d+)?|\.\d+)[eE](-?\d{1,3})(?![\w.^])")


def scientific_notation(answer: str) -> str:
    """``answer`` with each number in scientific notation written as a power of ten:
    ``1e-3`` is ``1\\times 10^{-3}`` (Math-Verify read it as e - 3, Euler's number)."""
    if "e" not in answer and "E" not in answer:
        return answer
    return _SCIENTIFIC_RE.sub(r"\1\\times 10^{\2}", answer)


# ``_{1}`` / ``^{2}``: braces around one letter or digit, which LaTeX renders as without them.
_SINGLE_TOKEN_BRACES_RE = re.compile(r"([_^])\{\s{0,8}([A-Za-z0-9])\s{0,8}\}")
_SPACE_RE = re.compile(r"\s+")


def _space(found: re.Match) -> str:
    """A run of spaces goes, but one stays where it ends a command's name before a letter
    (``\\pi r`` is not ``\\pir``)."""
    text, start, end = found.string, found.start(), found.end()
    j = start
    while j > 0 and text[j - 1].isalpha():
        j -= 1
    after_command = 0 < j < start and text[j - 1] == "\\"
    return " " if after_command and end < len(text) and text[end].isalpha() else ""


def normalise_string(answer: str) -> str:
    """``answer`` as Math-Verify's string fallback should compare it (for what sympy cannot
    parse): without spaces (but the one after a command's name before a letter: ``\\pi r``)
    and without braces around a single letter or digit (``E_{1}`` is ``E_1``; ``E_{12}``
    stays). ``E_{1}, E_{2}`` scored -1 against ``E_{1},E_{2}``."""
    return _SPACE_RE.sub(_space, _SINGLE_TOKEN_BRACES_RE.sub(r"\1\2", answer)).strip()


# ``40_9``, ``40_{9}``, ``1011_2``, ``A3_{16}``, ``\text{40}_{(9)}``: a numeral with its base as
# a subscript.
_NUMERAL_TEXT_RE = re.compile(
    r"\\(?:text|textrm|mathrm|mbox)\s{0,4}\{\s{0,4}([0-9A-Za-z]{1,64})\s{0,4}\}"
)
_BASE_NUMERAL_RE = re.compile(r"([0-9A-Za-z]{1,64})_(?:\{\(?(\d{1,2})\)?\}|\((\d{1,2})\)|(\d))")
_DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def base_numeral(answer: str) -> tuple[str, int | None] | None:
    """``(digits, base)`` of a numeral written with its base (``40_9`` is ``("40", 9)``), or
    ``(digits, None)`` for bare decimal digits (``40``), else None. Math-Verify dropped the
    subscript, so ``40_8`` equalled ``40_9``. The numeral has a decimal digit, and only
    digits of its base (``x_6``, ``a_5``, ``E_{3}4`` are no numerals)."""
    if len(answer) > 100:
        return None
    text = _NUMERAL_TEXT_RE.sub(r"\1", answer).replace("$", "").replace(" ", "")
    if text.isdigit() and text.isascii():
        return text, None
    found = _BASE_NUMERAL_RE.fullmatch(text)
    if found is None or not any(c.isdigit() for c in found.group(1)):
        return None
    digits, base = found.group(1).upper(), int(next(g for g in found.groups()[1:] if g))
    if not 2 <= base <= 36 or any(_DIGITS.find(d) >= base for d in digits):
        return None
    return digits, base


# Characters that render as nothing: zero-width spaces, joiners and direction marks, the
# word joiner and the invisible operators (function application, times, separator, plus),
# the byte-order mark, the soft hyphen, the grapheme joiner, the Mongolian vowel separator.
_INVISIBLE_RE = re.compile("[\u200b-\u200f\u2060-\u2064\ufeff\u00ad\u034f\u180e]")
# Commands whose argument renders blank (``\phantom{6}`` leaves the space of a 6, empty).
_BLANK_COMMANDS = ("\\phantom", "\\hphantom", "\\vphantom")
# Text struck out (``\\cancel{6}5``) is no part of the answer either.
_STRUCK_COMMANDS = ("\\cancel", "\\bcancel", "\\xcancel", "\\sout", "\\st")
# Colour: ``\color{red}`` (a switch) and ``\textcolor{red}{x}`` / ``\colorbox{red}{x}``.
_COLOR_SWITCH = "\\color"
_COLOR_COMMANDS = ("\\textcolor", "\\colorbox")
_BOX_NAMES = ("\\boxed", "\\fbox")
_TEXT_COMMANDS = ("\\text", "\\textrm", "\\mathrm", "\\mbox", "\\textnormal")
# Commands that render their argument visibly, in place (bold, italic, a typewriter face,
# ``\smash``, which only hides its height): ``\mathbf{8}7`` is 87. Taken off a number or a
# sign only (``\text{-}7`` is -7); a letter keeps its command (``\mathbf{v}``, ``5\text{ cm}``).
_VISIBLE_COMMANDS = _TEXT_COMMANDS + (
    "\\mathbf",
    "\\textbf",
    "\\boldsymbol",
    "\\bm",
    "\\pmb",
    "\\mathit",
    "\\textit",
    "\\emph",
    "\\mathsf",
    "\\textsf",
    "\\mathtt",
    "\\texttt",
    "\\mathnormal",
    "\\textup",
    "\\smash",
    "\\underline",
)
# A number, or a sign, as the whole argument of a visible command or of a brace group.
_NUMBER_FRAGMENT_RE = re.compile(
    r"\s{0,8}(?:[+-]?(?:\d{1,400}(?:\.\d{1,400})?|\.\d{1,400})|[+-])\s{0,8}"
)
# A brace group that holds a number: ``{3}4`` renders as 34 (Math-Verify read it as 3 + 4).
_NUMBER_GROUP_RE = re.compile(r"\{(\s{0,8}(?:[+-]?\d{1,400}(?:\.\d{1,400})?|[+-])\s{0,8})\}")
# Colours that hide the text on a page.
_HIDING_COLOURS = frozenset(("white", "transparent"))
# LaTeX spacing between two digits: ``10\,000`` (a thin space between digit groups).
_DIGIT_SPACING_RE = re.compile(r"(?<=\d)(?:\\[,;:! ]|~|\\q?quad(?![A-Za-z]))(?=\d)")
# A number written in groups of three (``1\,234\,567``): 1-3 digits, then groups of 3.
_GROUPED_RE = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\[,;:! ]|~)\d{3})+(?![\d])")
_GROUP_SPACING_RE = re.compile(r"\\[,;:! ]|~")
_MAX_VISIBLE_STEPS = 64
# Unicode math as LaTeX writes it (``5²``, ``½``, ``−5``, ``π``): Math-Verify read none of it.
_UNICODE_MATH = str.maketrans(
    {
        "°": "^{\\circ}",
        "²": "^{2}",
        "³": "^{3}",
        "½": "\\frac{1}{2}",
        "⅓": "\\frac{1}{3}",
        "⅔": "\\frac{2}{3}",
        "¼": "\\frac{1}{4}",
        "¾": "\\frac{3}{4}",
        "−": "-",
        "×": "\\times ",
        "÷": "\\div ",
        "·": "\\cdot ",
        "π": "\\pi ",
        "∞": "\\infty ",
        "≤": "\\le ",
        "≥": "\\ge ",
    }
)


def _command_at(text: str, i: int, names: tuple[str, ...]) -> str | None:
    for name in names:
        if text.startswith(name, i) and not text[i + len(name) : i + len(name) + 1].isalpha():
            return name
    return None


def _group_after(text: str, i: int) -> tuple[str, int] | None:
    """The braced argument at ``text[i]`` (spaces before it skipped) and the index after it."""
    from megatron_rl.rewards.boxes import braced_group, skip_spaces

    return braced_group(text, skip_spaces(text, i))


def visible_answer(answer: str) -> str | None:
    """``answer`` as it renders: invisible characters and ``\\phantom`` arguments gone,
    colour commands taken off their text, a box inside the answer replaced by what it holds,
    an answer all in one text command (``\\text{5 cm}``) read as its text, and digit groups
    written with thin spaces joined (``10\\,000`` is ``10000``, which
    Math-Verify read as the product 10 * 000). None when digits are set apart by spacing in
    any other way (``3\\,5``): no number reads that way, and no product either.

    Math-Verify read ``\\phantom{6}`` as 6 and ``\\phantom{3}4`` as 7, and nothing of
    ``\\color{red}{5}``; ``\\boxed{\\boxed{6}5}`` was read as its inner box, 6. Unicode
    math (``5²``, ``½``, ``−5``, ``π``, ``45°``) is written as LaTeX. Linear in the
    answer's length (at most ``_MAX_VISIBLE_STEPS`` commands are taken off)."""
    text = _INVISIBLE_RE.sub("", answer).translate(_UNICODE_MATH)
    for _ in range(_MAX_VISIBLE_STEPS):
        i = text.find("\\")
        changed = False
        while i >= 0:
            blank = _command_at(text, i, _BLANK_COMMANDS + _STRUCK_COMMANDS)
            colour = _command_at(text, i, _COLOR_COMMANDS)
            switch = _command_at(text, i, (_COLOR_SWITCH,))
            boxed = _command_at(text, i, _BOX_NAMES)
            visible = _command_at(text, i, _VISIBLE_COMMANDS)
            name = blank or colour or switch or boxed or visible
            group = _group_after(text, i + len(name)) if name else None
            if group is not None and visible and not _NUMBER_FRAGMENT_RE.fullmatch(group[0]):
                group = None  # ``\mathbf{v}``, ``\text{ cm}``: as they are
            if group is not None:
                content, end = group
                if blank:
                    replacement = ""
                elif content.strip().lower() in _HIDING_COLOURS and name != "\\colorbox":
                    return None  # white text on a white page: hidden, no answer
                elif colour:
                    second = _group_after(text, end)
                    if second is None:
                        return None
                    replacement, end = "{" + second[0] + "}", second[1]
                elif switch:
                    replacement = ""
                else:  # a box, or a visible command around a number (``_number_groups``)
                    replacement = "{" + content + "}" if content.strip() else ""
                text = text[:i] + replacement + text[end:]
                changed = True
                break
            i = text.find("\\", i + 1)
        if not changed:
            break
    text = _number_groups(text)
    text = _GROUPED_RE.sub(lambda m: _GROUP_SPACING_RE.sub("", m.group(0)), text).strip()
    if _DIGIT_SPACING_RE.search(text):
        return None
    # All of it in one text command (``\\text{5 cm}``) reads as the text.
    name = _command_at(text, 0, _TEXT_COMMANDS) if text.startswith("\\") else None
    group = _group_after(text, len(name)) if name else None
    if group is not None and group[1] == len(text) and group[0].strip():
        text = group[0].strip()
    return text


def _number_groups(text: str) -> str:
    """``text`` with the braces taken off each group that holds a number (``{3}4`` and
    ``{3}{4}`` are 34), but not where they delimit something: a command's argument
    (``\\frac{8}{7}``, ``\\sqrt[3]{8}``), an exponent or a subscript (``2^{8}7`` is 2^8
    times 7, ``x^2{3}`` is x^2 times 3). What precedes a group is read from the text as
    rewritten so far, so a run of groups is read left to right; linear in the length."""
    out, tail, last = [], " ", 0
    for found in _NUMBER_GROUP_RE.finditer(text):
        between = text[last : found.start()]
        tail = (tail + between).rstrip(" \t\n")[-2:].rjust(2)
        out.append(between)
        before, ahead = tail[-1], tail[-2]
        if before.isalpha() or before in "}]^_\\" or (before.isdigit() and ahead in "^_"):
            kept = found.group(0)
        else:
            kept = found.group(1).strip()
        out.append(kept)
        tail = (tail + kept)[-2:].rjust(2)
        last = found.end()
    out.append(text[last:])
    return "".join(out)


# An ordering written as a chain of one relation: ``b > a > c``, ``x<y<z``.
_CHAIN_SPLIT_RE = re.compile(r"\s{0,8}(>|<|\\gt(?![A-Za-z])|\\lt(?![A-Za-z]))\s{0,8}")
_ORDER_ITEM_RE = re.compile(r"[A-Za-z0-9_{}\\^.+-]{1,40}")


def ordering(answer: str, reference: str) -> bool | None:
    """Whether the chain ``answer`` (``b > a > c``, one relation throughout) lists the
    items of the reference's ordering (``b, a, c``) in its order, as written; None when
    ``answer`` is no such chain or ``reference`` no list of as many items. Math-Verify read
    the chain as two inequalities and the list as a set, and never matched them."""
    if len(answer) > 300 or len(reference) > 300:
        return None
    parts = _CHAIN_SPLIT_RE.split(answer.strip())
    relations = {p.strip() for p in parts[1::2]}
    items = [p.replace(" ", "") for p in parts[0::2]]
    listed = [p.replace(" ", "") for p in reference.split(",")]
    if len(items) < 2 or len(relations) != 1 or len(listed) != len(items):
        return None
    if not all(_ORDER_ITEM_RE.fullmatch(i) for i in items + listed):
        return None
    if not all(any(c.isalpha() for c in i) for i in items):
        return None  # "1 < 2 < 3": constants, no ordering of named things
    return items == listed


# ``1 \le x \le 2``, ``1 < x \leq 2``: a variable between two bounds.
_LESS = r"(<|\\leq?(?![A-Za-z])|\\leqslant|≤)"
_BOUNDED_RE = re.compile(
    rf"\s{{0,8}}([^<>=]{{1,60}}?)\s{{0,8}}{_LESS}\s{{0,8}}[A-Za-z]\s{{0,8}}{_LESS}"
    rf"\s{{0,8}}([^<>=]{{1,60}}?)\s{{0,8}}"
)
# ``x \\ge 3``, ``x < 2``: a variable bounded from one side (a ray).
_RAY_RE = re.compile(
    r"\s{0,8}[A-Za-z]\s{0,8}(<|>|\\[lg]eq?(?![A-Za-z])|\\[lg]eqslant|≤|≥)\s{0,8}([^<>=]{1,60}?)\s{0,8}"
)
_INTERVAL_RE = re.compile(r"[\[(][^,;]{1,60}[,;][^,;]{1,60}[\])]")


def interval_of(answer: str, reference: str) -> str:
    """``answer`` as an interval when it bounds one variable from both sides and the
    reference is an interval: ``1 \\le x \\le 2`` is ``[1,2]``, ``1 < x \\le 2`` is
    ``(1,2]``; else ``answer`` as it is. Math-Verify compares a relation with an interval
    only the other way round (a relation as the reference)."""
    if len(answer) > 200 or not _INTERVAL_RE.fullmatch(reference.replace(" ", "")):
        return answer
    found = _BOUNDED_RE.fullmatch(answer)
    if found is None:
        return _ray(answer) if "\\infty" in reference else answer
    low, low_rel, high_rel, high = found.groups()
    opener = "(" if low_rel == "<" else "["
    closer = ")" if high_rel == "<" else "]"
    return f"{opener}{low.strip()},{high.strip()}{closer}"


def _ray(answer: str) -> str:
    """``x \\ge 3`` as ``[3,\\infty)``, ``x < 2`` as ``(-\\infty,2)``; else ``answer``."""
    found = _RAY_RE.fullmatch(answer)
    if found is None:
        return answer
    relation, bound = found.group(1), found.group(2).strip()
    closed = relation not in ("<", ">")
    if relation in (">", "≥") or relation.startswith("\\g"):
        return ("[" if closed else "(") + bound + ",\\infty)"
    return "(-\\infty," + bound + ("]" if closed else ")")


# A repeating decimal: ``0.\overline{3}``, ``6.\overline{9}``, ``0.1\overline{6}``, ``0.\bar{3}``,
# ``0.\dot{3}``, ``0.\dot{1}4\dot{2}`` (dots over the first and last repeating digits),
# ``0.(3)``. Integer and decimal digits, then the repeating ones; no digit or point around it.
_REPEAT_OPEN = r"(?<![\d.])([+-]?)(\d{0,40})\.(\d{0,40})"
_REPEATING_RE = re.compile(
    _REPEAT_OPEN + r"(?:\\(?:overline|bar)\s{0,4}(?:\{\s{0,4}(\d{1,40})\s{0,4}\}|(\d))"
    r"|\\dot\s{0,4}\{?(\d)\}?(?:(\d{0,40})\\dot\s{0,4}\{?(\d)\}?)?"
    r"|\((\d{1,40})\))(?![\d.])"
)


def _repeating_value(found: re.Match) -> str:
    from fractions import Fraction

    sign, whole, decimals = found.group(1), found.group(2), found.group(3)
    over, over_digit, first_dot, dotted, last_dot, parenthesised = found.groups()[3:]
    if parenthesised is not None and decimals:
        return found.group(0)  # ``0.5(3)``: also a product, as Math-Verify reads it
    if first_dot is not None:
        period = first_dot + ((dotted or "") + last_dot if last_dot is not None else "")
    else:
        period = over or over_digit or parenthesised
    head = int((whole or "0") + decimals)
    value = Fraction(int((whole or "0") + decimals + period) - head) / (
        10 ** len(decimals) * (10 ** len(period) - 1)
    )
    text = (
        str(value.numerator)
        if value.denominator == 1
        else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    )
    whole_answer = found.start() == 0 and found.end() == len(found.string)
    return sign + (text if whole_answer or value.denominator == 1 else "(" + text + ")")


def repeating_decimal(answer: str) -> str:
    """``answer`` with each repeating decimal written as the fraction it is: ``0.\\overline{3}``
    is ``\\frac{1}{3}``, ``6.\\overline{9}`` is 7, ``0.1\\dot{6}`` is ``\\frac{1}{6}``,
    ``0.(3)`` is ``\\frac{1}{3}`` (Math-Verify read none of them). A fraction inside a longer
    answer is put in parentheses. Not read: ``0.1(6)``, which is also the product 0.1 * 6,
    and ``0.333\\ldots``, which does not write which digits repeat."""
    if len(answer) > 1000 or not ("\\" in answer or "(" in answer):
        return answer
    return _REPEATING_RE.sub(_repeating_value, answer.strip())
