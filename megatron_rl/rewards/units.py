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
from fractions import Fraction

# Spacing between a value and its unit: spaces, ``\,``, ``\;``, ``\:``, ``\!``, ``\ ``, ``~``,
# ``\quad``.
_SPACING = r"(?:\s|\\[,;:! ]|~|\\q?quad\b)"
# A unit wrapped in a text command: ``\text{ cm}``, ``\mathrm{mL}``, ``\mbox{ units}``, with an
# optional power (``\text{cm}^2``).
_WRAPPED_UNIT_RE = re.compile(
    r"(?:\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mathit|mbox|operatorname)\s{0,4}\{([^{}]{1,40})\})"
    r"(\s{0,4}\^\s{0,4}(?:\{\s{0,4}-?\s{0,4}[1-3]\s{0,4}\}|[23]))?$"
)
# A plain-text unit: one to three words, the last possibly with a power or a ``/`` compound
# (``36 mL``, ``12 square units``, ``60 km/h``, ``9 m^2``).
_PLAIN_UNIT_RE = re.compile(
    r"(?<![\\A-Za-z])((?:[A-Za-zµμΩ°]{1,20}\s{1,4}){0,2}"
    r"[A-Za-zµμΩ°]{1,20}(?:/[A-Za-z]{1,10})?)"
    r"(\s{0,4}\^\s{0,4}(?:\{\s{0,4}-?\s{0,4}[1-3]\s{0,4}\}|[23])|[²³])?$"
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
) | frozenset(
    # Words that change the value (``multiplied``) or say something of it: never a unit.
    "factorial factorials percent wrong incorrect correct false true not maybe unsure "
    "hundred hundreds thousand thousands million millions billion billions trillion "
    "trillions dozen dozens half halves third thirds quarter quarters tenth tenths "
    "hundredth hundredths thousandth thousandths millionth millionths "
    "probably perhaps possibly likely guess unknown kidding joking sorry oops hmm "
    # Counting words and abbreviations that scale (``scaled`` reads them as factors) or may
    # (``mil`` is a thousandth of an inch or a million, ``MM`` a million or 2000).
    "k grand grands lakh lakhs lac lacs crore crores gross score scores ten tens bn bln mln "
    "mil mils MM mn tn thou pct zillion zillions gazillion gazillions "
    # Number words: ``5\\text{ thousand five}`` is 5005, never 5000 in the unit "five".
    "zero one two three four five six seven eight nine eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy "
    "eighty ninety".split()
)
# Currency subunits: a reference without a unit counts money in the main unit (dollars), so
# ``5 cents`` is not its 5; they count against a reference with a unit (``\\$5``), and
# convert. (Letters that are units and multipliers, ``5\\text{K}`` and ``5\\text{ M}``,
# are read as the units, kelvin and molar, as science answers write them: taken off against
# a bare number, never scaled.)
_KEPT_AGAINST_BARE = frozenset("cent penny".split())
# Function names that are also units of time when they stand alone after a number.
_TIME_ABBREVIATIONS = frozenset("min mins sec secs".split())
# What a parenthesised text may say and still be taken off as a unit (``9 \\text{
# (approximately)}``); any other remark in parentheses (``5 \\text{ (just kidding)}``) stays.
_PARENTHESISED_UNITS = frozenset("approximately approx about rounded exact exactly".split())
_UNIT_LETTERS = "A-Za-zµμΩ°"
# A power of a unit inside its text (``\\text{ m s^-1}``, ``\\text{ m/s^2}``).
_INNER_POWER = r"\^(?:\{-?[1-3]\}|-?[1-3])"
_UNIT_WORDS_RE = re.compile(
    rf"[{_UNIT_LETTERS}]{{1,20}}(?:{_INNER_POWER})?"
    rf"(?:[\s./·-]{{1,4}}[{_UNIT_LETTERS}]{{1,20}}(?:{_INNER_POWER})?){{0,3}}\.?"
)
_UNIT_SPLIT_RE = re.compile(rf"[\s./·-]+|{_INNER_POWER}")
# Spacing inside a wrapped unit (``\\mathrm{~cm}``, ``\\text{\\,m}``).
_UNIT_SPACING_RE = re.compile(r"~|\\[,;:! ]|\s+")
# Between wrapped units: a quotient (``\\mathrm{km} / \\mathrm{h}``) or a product
# (``\\mathrm{N} \\cdot \\mathrm{m}``, ``\\text{N}\\,\\text{m}``, ``\\text{kg}\\text{m}``).
_UNIT_JOINT_RE = re.compile(
    r"(?:\s|\\[,;:! ]|~){0,4}(/|\\cdot(?![A-Za-z])|\\times(?![A-Za-z])|·)?(?:\s|\\[,;:! ]|~){0,4}$"
)
# The exponent of a power after a wrapped unit (``^{-1}``, ``^2``).
_POWER_DIGITS_RE = re.compile(r"-?\s{0,4}[1-3]")
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
    named = [t for t in tokens if t]
    if len(named) == 1 and named[0] in _TIME_ABBREVIATIONS:
        return True  # ``5 min``, ``5 sec.``: minutes, not the function (written ``\\min``)
    # ``min`` and ``sec`` in a compound unit (``m/min``) are minutes and seconds too.
    if any(t in _NOT_UNITS and t not in _TIME_ABBREVIATIONS for t in tokens):
        return False
    return len(tokens) == 1 or all(len(t) > 1 or t in _LETTER_UNITS for t in tokens if t)


def _wrapped_units(answer: str) -> tuple[str, str] | None:
    """``(rest, unit)`` for the wrapped units that end ``answer``: one (``\\text{ cm}^2`` is
    ``cm^2``) or several, each with its power, as a quotient (``\\mathrm{~km} / \\mathrm{h}``
    is ``km/h``) or a product (``\\text{N}\\cdot\\text{m}`` is ``N m``,
    ``\\text{m}\\cdot\\text{s}^{-1}`` is ``m s^-1``); None when ``answer`` does not end with
    one, or its text is no unit (``\\text{ (or 13)}``)."""
    units: list[str] = []
    rest = answer
    for _ in range(4):
        wrapped = _WRAPPED_UNIT_RE.search(rest)
        if wrapped is None:
            break
        unit = _UNIT_SPACING_RE.sub(" ", wrapped.group(1)).strip()
        if unit.startswith("(") and unit.endswith(")"):  # "\text{ (approximately)}"
            unit = unit[1:-1].strip()
            if unit.lower() not in _PARENTHESISED_UNITS and _unit_name(unit) == unit.lower():
                return None  # a remark, not a known unit
        if not unit or _TIME_MARKER_RE.search(unit) or not _is_unit_word(unit):
            return None
        if wrapped.group(2):
            power = _POWER_DIGITS_RE.search(wrapped.group(2)).group(0).replace(" ", "")
            unit = f"{unit}^{power}"
        units.append(unit)
        rest = rest[: wrapped.start()]
        joint = _UNIT_JOINT_RE.search(rest)
        if _WRAPPED_UNIT_RE.search(rest[: joint.start()]) is None:
            break
        units.append("/" if joint.group(1) == "/" else " ")
        rest = rest[: joint.start()]
    if not units:
        return None
    if units[-1] in ("/", " "):
        units.pop()  # the loop ran out with a joint taken
    return rest, "".join(reversed(units))


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


# Words that scale the number before them (``5 million``, ``3 dozen``, ``7 hundredths``):
# written as the factor, they are read as a product, never taken off as a unit.
_MULTIPLIERS = {
    "hundred": "100",
    "thousand": "1000",
    "million": "10^{6}",
    "billion": "10^{9}",
    "trillion": "10^{12}",
    "dozen": "12",
    "half": "\\frac{1}{2}",
    "halve": "\\frac{1}{2}",
    "third": "\\frac{1}{3}",
    "quarter": "\\frac{1}{4}",
    "tenth": "\\frac{1}{10}",
    "hundredth": "\\frac{1}{100}",
    "thousandth": "\\frac{1}{1000}",
    "millionth": "\\frac{1}{10^{6}}",
    "ten": "10",
    "grand": "1000",
    "lakh": "10^{5}",
    "lac": "10^{5}",
    "crore": "10^{7}",
    "gross": "144",
}
# Only as written (``5\\text{ score}`` is 100, ``5 scores`` no product) and, for the
# abbreviations, only in a text command (``5\\text{k}``; a plain ``5k`` is a product with
# the variable ``k``).
_EXACT_MULTIPLIERS = {"score": "20"}
_ABBREVIATED_MULTIPLIERS = {
    "k": "1000",
    "bn": "10^{9}",
    "Bn": "10^{9}",
    "BN": "10^{9}",
    "bln": "10^{9}",
    "mln": "10^{6}",
}
_NUMBER = r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+"
# A number (after a dollar sign or none) that multiplier words may follow.
_SCALED_NUMBER_RE = re.compile(rf"\s{{0,4}}(\\?\$\s{{0,4}})?({_NUMBER})")
# After it, a multiplier or "factorial" / "percent", plain or in a text command (the
# commands ``split_unit`` reads a unit from, holding up to four words: ``\\text{ hundred
# thousand}``), then anything (a unit: ``5 million dollars``).
_SCALE_WORDS_RE = re.compile(
    rf"(?:{_SPACING}){{0,4}}"
    r"(?:\\(?:text|textrm|textnormal|textbf|textit|mathrm|mathbf|mathit|mbox|operatorname)"
    r"\s{0,4}\{((?:\s|\\[,;:! ]|~){0,4}[A-Za-z]{1,12}(?:\s{1,4}[A-Za-z]{1,12}){0,3})\s{0,4}\}"
    r"|([A-Za-z]{3,12})(?![A-Za-z]))"
)
_WORD_RE = re.compile(r"[A-Za-z]+")
# At most this many multiplier words are read after a number (``5 hundred thousand``).
_MAX_SCALE_WORDS = 4


def _scale_word(word: str, wrapped: bool) -> str | None:
    """The factor a multiplier word stands for (plural or not), "!" for factorial, "%"
    for percent, else None. Abbreviations (``k``, ``bn``) only when ``wrapped`` in a text
    command."""
    if wrapped and word in _ABBREVIATED_MULTIPLIERS:
        return _ABBREVIATED_MULTIPLIERS[word]
    word = word.lower()
    if word in _EXACT_MULTIPLIERS:
        return _EXACT_MULTIPLIERS[word]
    if word in ("factorial", "percent", "pct"):
        return "!" if word == "factorial" else "%"
    if word.endswith("s") and word[:-1] in _MULTIPLIERS:
        word = word[:-1]
    if word == "halves":
        word = "half"
    return _MULTIPLIERS.get(word)


# The words of a scale, each a power of ten, that may follow another in a number ("five
# hundred thousand", "two thousand million", "one lakh crore").
_SCALE_POWERS = {
    "hundred": 2,
    "thousand": 3,
    "lakh": 5,
    "lac": 5,
    "million": 6,
    "crore": 7,
    "billion": 9,
    "trillion": 12,
}


def _stacks(words: list[str], word: str) -> bool:
    """The multiplier ``word`` may follow the multiplier words ``words`` already read: the
    first may be any; after it only a word of the scale larger than the one before
    (``hundred thousand`` is 100 * 1000, as English writes it). "Five thousand hundred",
    "five thousand thousand", "five hundred dozen" or "five hundred thousandths" (0.7 or
    0.00007?) say no one number; nor does a percent or a factorial after a word."""
    if not words:
        return True
    power = _SCALE_POWERS.get(_singular(word))
    before = _SCALE_POWERS.get(_singular(words[-1]))
    return power is not None and before is not None and power > before


def _singular(word: str) -> str:
    """A multiplier word without its plural "s" (``thousands`` is ``thousand``)."""
    word = word.lower()
    return word[:-1] if word.endswith("s") and word[:-1] in _MULTIPLIERS else word


def scaled(answer: str) -> str:
    """``answer`` with the multiplier words after its leading number written as a product:
    ``5 million`` is ``5\\times 10^{6}``, ``3 \\text{ dozen}`` is ``3\\times 12``, ``7
    hundredths`` is ``7\\times \\frac{1}{100}``, ``5 hundred thousand`` is ``5\\times
    100\\times 1000`` (stacked words multiply, ``_stacks``); ``5 factorial`` is ``5!`` and
    ``12 percent`` ``12\\%``. What follows the words (a unit) stays. Math-Verify's unit
    stripping read these words as units and took them off, so ``5 million`` equalled 5.
    Other answers are returned as they are."""
    if len(answer) > 200:
        return answer
    found = _SCALED_NUMBER_RE.match(answer)
    if found is None:
        return answer
    factors: list[str] = []
    read: list[str] = []  # the multiplier words read, as written
    position, leftover = found.end(), ""
    while len(factors) < _MAX_SCALE_WORDS and factors[-1:] not in (["!"], ["%"]):
        words = _SCALE_WORDS_RE.match(answer, position)
        if words is None:
            break
        wrapped = words.group(1) is not None
        names = _WORD_RE.findall(words.group(1)) if wrapped else [words.group(2)]
        taken = 0
        for name in names[: _MAX_SCALE_WORDS - len(factors)]:
            factor = _scale_word(name, wrapped)
            if factor is None or not _stacks(read, name):
                break
            factors.append(factor)
            read.append(name)
            taken += 1
        if not taken:
            break
        position = words.end()
        if taken < len(names):  # ``\\text{ thousand dollars}``: the unit stays wrapped
            leftover = "\\text{ " + " ".join(names[taken:]) + "}"
            break
    if not factors:
        return answer
    number, rest = found.group(2).replace(",", ""), (leftover + " " + answer[position:]).strip()
    if factors[0] in ("!", "%"):
        written = number + ("!" if factors[0] == "!" else "\\%")
    else:
        written = number + "".join(f"\\times {factor}" for factor in factors)
    written = (found.group(1) or "").strip() + written
    return written + (" " + rest if rest else "")


# Names of a unit, each to one spelling (plurals are handled by ``_unit_name``). Symbols
# whose case matters stay as written (``Mm`` is no ``mm``); the rest compare lower-cased.
_UNIT_NAMES = {
    "millimeter": "mm",
    "millimetre": "mm",
    "centimeter": "cm",
    "centimetre": "cm",
    "meter": "m",
    "metre": "m",
    "kilometer": "km",
    "kilometre": "km",
    "nanometer": "nm",
    "nanometre": "nm",
    "micrometer": "um",
    "micrometre": "um",
    "µm": "um",
    "μm": "um",
    "inch": "in",
    "inches": "in",
    "foot": "ft",
    "feet": "ft",
    "yard": "yd",
    "mile": "mi",
    "milligram": "mg",
    "gram": "g",
    "kilogram": "kg",
    "pound": "lb",
    "lbs": "lb",
    "ounce": "oz",
    "tonne": "t",
    "ton": "t",
    "second": "s",
    "sec": "s",
    "secs": "s",
    "minute": "min",
    "mins": "min",
    "hour": "h",
    "hr": "h",
    "hrs": "h",
    "millisecond": "ms",
    "day": "day",
    "days": "day",
    "week": "week",
    "wk": "week",
    "month": "month",
    "year": "yr",
    "yrs": "yr",
    "milliliter": "ml",
    "millilitre": "ml",
    "liter": "l",
    "litre": "l",
    "gallon": "gal",
    "degree": "deg",
    "radian": "rad",
    "°": "deg",
    "dollar": "dollar",
    "usd": "dollar",
    "buck": "dollar",
    "cent": "cent",
    "¢": "cent",
    "penny": "penny",
    "pennies": "penny",
    "pence": "penny",
    "kelvin": "K",
    "unit": "unit",
    "kph": "km/h",
    "kmh": "km/h",
    "mph": "mi/h",
    "sq": "square",
    "cu": "cubic",
}
# A value in degrees: ``30^\\circ``, ``30^{\\circ}``, ``30°``, ``30\\degree``.
_DEGREES_RE = re.compile(r"(?:\^\s{0,4}\{?\s{0,4}\\circ\s{0,4}\}?|°|\\degree)\s{0,4}$")
# Words of a power: before the unit (``square meters``) or after it (``meters squared``).
_POWER_BEFORE = {"square": 2, "cubic": 3}
_POWER_AFTER = {"squared": 2, "cubed": 3}
# The parts of a unit's text: a name, a quotient sign, or the power of the name before it
# (``^2``, ``^{-1}``, ``²``); anything else (spaces, ``·``, ``.``, ``-``) is a product.
_UNIT_PART_RE = re.compile(
    r"([A-Za-zµμΩ°]+)|(/)|\^\s{0,4}(?:\{\s{0,4}(-?\s{0,4}\d)\s{0,4}\}|(-?\d))|([²³])"
)


def _unit_name(token: str) -> str:
    """One spelling of a unit's name or symbol (``centimeters`` and ``cm`` are ``cm``)."""
    for candidate in (token, token.lower()):
        if candidate in _UNIT_NAMES:
            return _UNIT_NAMES[candidate]
    lower = token.lower()
    if len(lower) > 3 and lower.endswith("s") and lower[:-1] in _UNIT_NAMES:
        return _UNIT_NAMES[lower[:-1]]
    if len(lower) > 3 and lower.endswith("s"):
        lower = lower[:-1]  # a counted noun: apples, units
    if token in ("L", "mL"):
        return lower
    return lower if len(token) > 2 else token


# A dollar sign before a constant value (``\\$5``, ``$ 12.50``): a unit of its own.
_DOLLAR_RE = re.compile(r"\\?\$\s{0,4}")


def _dollars(answer: str) -> str | None:
    """The value of ``answer`` written with a dollar sign before it (``\\$5`` is ``5``), or
    None."""
    answer = answer.strip()
    found = _DOLLAR_RE.match(answer)
    if found is None or len(answer) > 200 or not _constant_terms(answer[found.end() :]):
        return None
    return answer[found.end() :].strip()


def unit_value(answer: str) -> str | None:
    """``answer`` without the unit that ``unit_key`` reads (``300\\text{ s}`` is ``300``,
    ``\\$5`` is ``5``), or None without one."""
    found = split_unit(answer)
    if found is None:
        return _dollars(answer)
    equals = _LAST_EQUALS_RE.search(found[0])  # ``x = 300\\text{ s}`` is 300
    return found[0] if equals is None else found[0][equals.end() :].strip()


def _unit_factors(unit: str) -> list[tuple[str, int]] | None:
    """The units that ``unit`` (a unit's text) multiplies, each with its exponent, in the
    order written: ``m/s^2`` is ``[(m, 1), (s, -2)]``, ``m s^-1`` is ``[(m, 1), (s, -1)]``,
    ``kilometers per hour`` is ``[(km, 1), (h, -1)]``, ``N m`` is ``[(N, 1), (m, 1)]``.
    Everything after ``/`` or "per" divides (``J/kg K`` is J over kg K). None when a power
    has nothing to apply to."""
    factors: list[tuple[str, int]] = []
    sign, before, last = 1, 1, 0  # ``last``: how many factors the last name added
    for name, slash, braced, bare, superscript in _UNIT_PART_RE.findall(unit):
        if slash or name.lower() == "per":
            sign = -1
            continue
        if name:
            written = _unit_name(name)
            if written.lower() in _POWER_BEFORE:
                before = _POWER_BEFORE[written.lower()]
                continue
            if written.lower() in _POWER_AFTER:
                power = _POWER_AFTER[written.lower()]
            else:
                # A name may be a quotient itself: ``mph`` is ``mi/h``.
                parts = written.split("/")
                added = [(parts[0], 1)] + [(part, -1) for part in parts[1:2]]
                factors += [(n, sign * e * before) for n, e in added if n]
                before, last = 1, len(added)
                continue
        else:
            digits = (braced or bare).replace(" ", "") or ("2" if superscript == "²" else "3")
            power = int(digits)
        if not last:
            return None
        factors[-last:] = [(n, e * power) for n, e in factors[-last:]]
    return factors


def _factors_key(factors: list[tuple[str, int]]) -> str:
    """One spelling of a product of units: the units with a positive exponent in order of
    their names, then ``/`` and those with a negative one (``m s^-1`` and ``m/s`` are
    ``m/s``; ``N m`` and ``m N`` are ``N m``); ``1`` when they cancel."""
    exponents: dict[str, int] = {}
    for name, exponent in factors:
        exponents[name] = exponents.get(name, 0) + exponent

    def written(name: str, exponent: int) -> str:
        return name if exponent == 1 else f"{name}^{exponent}"

    ordered = sorted(exponents.items())
    above = " ".join(written(n, e) for n, e in ordered if e > 0)
    below = " ".join(written(n, -e) for n, e in ordered if e < 0)
    if not below:
        return above or "1"
    return f"{above or '1'}/{below}"


def unit_key(answer: str) -> str | None:
    """The unit that ends ``answer`` (``split_unit``) in one spelling with its powers, or None
    without one: ``5 centimeters`` and ``5\\text{ cm}`` are ``cm``, ``12 \\text{ m}^2`` and
    ``12 square meters`` are ``m^2``, ``60 km/h`` and ``60 kilometers per hour`` are
    ``km/h``; ``30^\\circ`` and ``30 degrees`` are ``deg``. A compound unit is read as the
    product it writes (``_unit_factors``): ``\\text{m}\\cdot\\text{s}^{-1}`` is ``m/s``, and
    ``\\text{m}\\cdot\\text{s}`` is ``m s``, no quotient. When both a response and its
    reference carry a unit, the keys must agree or convert (``conversion``): ``5 mm`` is not
    ``5 cm`` (the unit is no longer taken off both sides regardless), ``50 mm`` is. A dollar
    sign before a constant value is ``dollar``."""
    if _DEGREES_RE.search(answer):
        return "deg"
    found = split_unit(answer)
    if found is None:
        return "dollar" if _dollars(answer) is not None else None
    factors = _unit_factors(found[1])
    if not factors:
        return _UNIT_NAMES.get(found[1], found[1])
    key = _factors_key(factors)
    return _UNIT_NAMES.get(key, key)


def kept_against_bare(key: str) -> bool:
    """A unit (``unit_key``) that is not taken off against a reference without a unit: one
    with a currency subunit in it (``5\\text{ cents}`` and ``5\\text{ cents}\\cdot\\text{s}``
    are not the answer 5)."""
    return any(part.split("^")[0] in _KEPT_AGAINST_BARE for part in re.split("[ /]", key))


# Units that convert into one another, each with its dimension (exponents of length, mass,
# time and dollars) and its size in the base unit (metre, gram, second, dollar) as an exact
# fraction. Only units of fixed size: no months or years, no ton (short or metric), no
# temperature (its scales have offsets), no other currency.
_LENGTH, _MASS, _TIME, _MONEY = (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)
_SIZES: dict[str, tuple[tuple[int, ...], Fraction]] = {
    "nm": (_LENGTH, Fraction(1, 10**9)),
    "um": (_LENGTH, Fraction(1, 10**6)),
    "mm": (_LENGTH, Fraction(1, 1000)),
    "cm": (_LENGTH, Fraction(1, 100)),
    "m": (_LENGTH, Fraction(1)),
    "km": (_LENGTH, Fraction(1000)),
    "in": (_LENGTH, Fraction(254, 10000)),
    "ft": (_LENGTH, Fraction(3048, 10000)),
    "yd": (_LENGTH, Fraction(9144, 10000)),
    "mi": (_LENGTH, Fraction(1609344, 1000)),
    "mg": (_MASS, Fraction(1, 1000)),
    "g": (_MASS, Fraction(1)),
    "kg": (_MASS, Fraction(1000)),
    "lb": (_MASS, Fraction(45359237, 100000)),
    "oz": (_MASS, Fraction(45359237, 1600000)),
    "ms": (_TIME, Fraction(1, 1000)),
    "s": (_TIME, Fraction(1)),
    "min": (_TIME, Fraction(60)),
    "h": (_TIME, Fraction(3600)),
    "day": (_TIME, Fraction(86400)),
    "week": (_TIME, Fraction(604800)),
    "ml": ((3, 0, 0, 0), Fraction(1, 10**6)),
    "l": ((3, 0, 0, 0), Fraction(1, 1000)),
    "dollar": (_MONEY, Fraction(1)),
    "cent": (_MONEY, Fraction(1, 100)),
}
_KEY_FACTOR_RE = re.compile(r"([a-z]{1,6})(?:\^(-?\d))?")


def _size(key: str) -> tuple[tuple[int, ...], Fraction] | None:
    """Dimension and size of a ``unit_key``: a product of units of ``_SIZES``, each with a
    power, over another or not (``cm^2``, ``km/h``, ``m/s^2``, ``kg m/s^2``); None for
    anything else."""
    parts = key.split("/")
    if len(parts) > 2:
        return None
    dimension, size = [0, 0, 0, 0], Fraction(1)
    for sign, part in zip((1, -1), parts):
        for factor in part.split(" "):
            if factor == "1":
                continue
            found = _KEY_FACTOR_RE.fullmatch(factor)
            if found is None or found.group(1) not in _SIZES:
                return None
            power = sign * int(found.group(2) or 1)
            unit_dimension, unit_size = _SIZES[found.group(1)]
            dimension = [d + power * u for d, u in zip(dimension, unit_dimension)]
            size *= unit_size**power
    return tuple(dimension), size


def conversion(source: str, target: str) -> Fraction | None:
    """The exact factor that turns a value in the unit ``source`` into the unit ``target``
    (both ``unit_key``s): 60 from ``min`` to ``s``, 1/100 from ``cm`` to ``m``, 100 from
    ``dollar`` to ``cent``; None unless both are known units of one dimension (``min`` and
    ``m`` are not)."""
    source_size, target_size = _size(source), _size(target)
    if source_size is None or target_size is None or source_size[0] != target_size[0]:
        return None
    return source_size[1] / target_size[1]
