"""Units of measurement at the end of a math answer (``36 \\mathrm{cm}``, ``12\\text{ mL}``).

Math-Verify's own unit stripping (``NormalizationConfig.units``) drops any of ~150 words and
letters that follow a digit or a brace at the end of an answer, inside expressions too: ``5pm``
became ``5`` (``pm`` read as picometres, so it equalled ``5am``), and ``8 + 3d`` became ``11``
(a term in ``d`` read as days). The verifier turns it off and uses ``split_unit`` instead,
which takes a unit off only when it stands alone at the end of a whole answer whose value is
one constant term; ``megatron_rl.rewards.math.verify`` compares without the unit only when the
reference's value is a constant, never against a symbolic reference.

Plain linear-time string work on short, already validated answers; nothing is evaluated.
"""

from __future__ import annotations

import re

# Spacing between a value and its unit: spaces, ``\,``, ``\;``, ``\:``, ``\!``, ``\ ``, ``~``,
# ``\quad``.
_SPACING = r"(?:\s|\\[,;:! ]|~|\\q?quad\b)"
# A unit wrapped in a text command: ``\text{ cm}``, ``\mathrm{mL}``, ``\mbox{ units}``, with an
# optional power (``\text{cm}^2``).
_WRAPPED_UNIT_RE = re.compile(
    r"(?:\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mathit|mbox|operatorname)\s{0,4}\{([^{}]{1,40})\})"
    r"(\s{0,4}\^\s{0,4}(?:\{\s{0,4}[23]\s{0,4}\}|[23]))?$"
)
# A plain-text unit: one to three words, the last possibly with a power or a ``/`` compound
# (``36 mL``, ``12 square units``, ``60 km/h``, ``9 m^2``).
_PLAIN_UNIT_RE = re.compile(
    r"(?<![\\A-Za-z])((?:[A-Za-zµμΩ°]{1,20}\s{1,4}){0,2}"
    r"[A-Za-zµμΩ°]{1,20}(?:/[A-Za-z]{1,10})?)"
    r"(\s{0,4}\^\s{0,4}(?:\{\s{0,4}[23]\s{0,4}\}|[23])|[²³])?$"
)
# Abbreviations that may be written against the number (``36mL``, ``5cm``): several letters,
# which nobody writes for a product of variables.
_ATTACHED_UNITS = frozenset(
    "cm mm km nm um µm mi ft yd in kg mg lb lbs oz mL ml cc gal sec min hr hrs hrs ms yr yrs "
    "mph kph kmh rpm Hz kHz MHz kPa Pa mol eV kJ kW kcal cal".split()
)
# Single letters that are units when written apart from the number (``\frac{37}{4} m``).
_LETTER_UNITS = frozenset("m g s h l L K N J W V".split())
# Words that are never units: math functions and constants, connectives, and times of day
# (``5 pm`` is not ``5``: am / pm are part of the answer).
_NOT_UNITS = frozenset(
    "sin cos tan cot sec csc log ln exp lim max min mod gcd lcm det arg deg pi inf infty "
    "and or not but if for all with where when then else is are as of to no none yes "
    "plus minus times over divided by squared cubed root sqrt "
    "am pm AM PM noon midnight".split()
)
_UNIT_LETTERS = "A-Za-zµμΩ°"
_UNIT_WORDS_RE = re.compile(
    rf"[{_UNIT_LETTERS}]{{1,20}}(?:\^[23])?(?:[\s./·-]{{1,4}}[{_UNIT_LETTERS}]{{1,20}}(?:\^[23])?){{0,3}}\.?"
)
_UNIT_SPLIT_RE = re.compile(r"[\s./·-]+|\^[23]")
# Spacing inside a wrapped unit (``\\mathrm{~cm}``, ``\\text{\\,m}``).
_UNIT_SPACING_RE = re.compile(r"~|\\[,;:! ]|\s+")
# Between wrapped units: ``\\mathrm{km} / \\mathrm{h}``, ``\\mathrm{N} \\cdot \\mathrm{m}``.
_UNIT_JOINT_RE = re.compile(r"\s{0,4}(?:/|\\cdot)\s{0,4}$")
# The last "=" of an answer (not of <=, >=, !=): ``x = 5\\text{ cm}`` has its unit after it.
_LAST_EQUALS_RE = re.compile(r"(?<![<>!=])=(?!=)(?=[^=]*$)")
_TIME_MARKER_RE = re.compile(r"(?i)\b[ap]\.?\s{0,2}m\b\.?")
# A constant value: no letters once LaTeX commands (``\frac``, ``\sqrt``, ``\pi``) are gone.
_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
_LETTER_RE = re.compile(r"[A-Za-z]")
_TRAILING_SPACING_RE = re.compile(rf"{_SPACING}+$")
# Between terms and list items: a value holding one of these (outside brackets) is no term.
_SEPARATORS = "+-=<>,;"
# A thousands separator: "15,600", "15{,}600", "15,\\!600".
_THOUSANDS_RE = re.compile(r"(?<=\d)(?:,|\{,\}|,\\!)(?=\d{3}(?!\d))")
_SEPARATOR_COMMANDS = ("\\pm", "\\mp", "\\le", "\\ge", "\\ne", "\\lor", "\\land", "\\cup")
_OPENERS, _CLOSERS = "{([", "})]"


def _constant_term(value: str) -> bool:
    """``value`` is one term without variables: ``36``, ``15,600``, ``\\frac{37}{4}``,
    ``-2\\sqrt{3}``, ``1.5\\times 10^{3}``; not ``12 + 0.5``, ``3x``."""
    value = _THOUSANDS_RE.sub("", value.strip())
    if not value or any(value.find(cmd) >= 0 for cmd in _SEPARATOR_COMMANDS):
        return False
    depth = 0
    for i, ch in enumerate(value):
        if ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
        elif depth == 0 and i > 0 and ch in _SEPARATORS and value[i - 1] not in "^_{":
            return False
    if depth != 0 or "\\text" in value or "\\mathrm" in value:
        return False
    return not _LETTER_RE.search(_COMMAND_RE.sub("", value)) and any(c.isdigit() for c in value)


def _constant_terms(value: str) -> bool:
    """``value`` is a constant term or a list of them (``0, 1``: a unit at the end of a
    list is the unit of each)."""
    items, depth, start = [], 0, 0
    value = _THOUSANDS_RE.sub("", value)
    for i, ch in enumerate(value):
        if ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(value[start:i])
            start = i + 1
    items.append(value[start:])
    return all(_constant_term(item) for item in items)


def _is_unit_word(words: str) -> bool:
    """``words`` can name a unit: up to three words of letters (a power of 2 or 3 and ``/``
    ``.`` ``-`` between them allowed), none of them a connective, function or time of day,
    and no single letter that is not a unit (``plus x``)."""
    if not _UNIT_WORDS_RE.fullmatch(words.strip()):
        return False
    tokens = _UNIT_SPLIT_RE.split(words.strip())
    if any(t in _NOT_UNITS for t in tokens):
        return False
    return len(tokens) == 1 or all(len(t) > 1 or t in _LETTER_UNITS for t in tokens if t)


def _wrapped_units(answer: str) -> tuple[str, str] | None:
    """``(rest, unit)`` for the wrapped units that end ``answer``: one (``\\text{ cm}^2``) or
    several joined by ``/`` or ``\\cdot`` (``\\mathrm{~km} / \\mathrm{h}``); None when
    ``answer`` does not end with one, or its text is no unit (``\\text{ (or 13)}``)."""
    units: list[str] = []
    rest = answer
    for _ in range(4):
        wrapped = _WRAPPED_UNIT_RE.search(rest)
        if wrapped is None:
            break
        unit = _UNIT_SPACING_RE.sub(" ", wrapped.group(1)).strip()
        if unit.startswith("(") and unit.endswith(")"):  # "\text{ (approximately)}"
            unit = unit[1:-1].strip()
        if not unit or _TIME_MARKER_RE.search(unit) or not _is_unit_word(unit):
            return None
        units.append(unit)
        rest = rest[: wrapped.start()]
        joint = _UNIT_JOINT_RE.search(rest)
        if joint is None or _WRAPPED_UNIT_RE.search(rest[: joint.start()]) is None:
            break
        rest = rest[: joint.start()]
    if not units:
        return None
    return rest, "/".join(reversed(units))


def split_unit(answer: str) -> tuple[str, str] | None:
    """``(value, unit)`` when ``answer`` (or the right side of its last ``=``) is one
    constant term (or a list of them) followed by a unit that stands alone at its end, else None.

    A unit is a ``\\text{}`` / ``\\mathrm{}`` word (``12\\text{ mL}``, ``\\mathrm{~km} /
    \\mathrm{h}``), plain words after a space (``36 mL``, ``12 square units``,
    ``\\frac{37}{4} m``), or a known abbreviation written against the number (``5cm``).
    Never a letter against a term (``4h``, ``2c``: variables), never inside an expression
    (``8 + 3 d``), and never a time of day (``5 pm``, ``7\\text{ a.m.}``). ``x = 5\\text{ cm}``
    is ``("x = 5", "cm")``.
    """
    answer = answer.strip()
    if len(answer) > 200:
        return None
    equals = _LAST_EQUALS_RE.search(answer)
    head, answer = (
        ("", answer) if equals is None else (answer[: equals.end()], answer[equals.end() :])
    )
    found = _wrapped_units(answer)
    if found is not None:
        value, unit = found
    else:
        plain = _PLAIN_UNIT_RE.search(answer)
        if plain is None or plain.start() == 0:
            return None
        unit, value = plain.group(0).strip(), answer[: plain.start()]
        words = plain.group(1)
        if not _is_unit_word(words) or _TIME_MARKER_RE.search(answer[plain.start() - 1 :]):
            return None
        apart = bool(_TRAILING_SPACING_RE.search(value))
        single = " " not in words and "/" not in words
        if not apart and not (single and words in _ATTACHED_UNITS):
            return None
        if apart and single and len(words) == 1 and words not in _LETTER_UNITS:
            return None
    value = _TRAILING_SPACING_RE.sub("", value)
    if not _constant_terms(value):
        return None
    return (head + value).strip(), unit
