"""What a response says after its final answer that changes it (issue 45: the last stated
answer counts).

- A retraction ("that is wrong", "$\\boxed{7}$ is incorrect", "no, wait", "scratch that"):
  the answer is the value stated after it, or none.
- Doubt ("Actually, D.", "Hmm, no, it's 8", "Err, 8", "I meant 8", "on second thought,
  $8$"): the first value stated after it (not one it denies: "rather than 8"), when it
  states one; else the answer stands.
- Another value offered ("or, if the endpoints count, 8", "otherwise 8", "unless n = 0, in
  which case 0", "or 8 if ...", "or 8", "/ 8", "maybe 8"): a hedge over two values, which
  is no answer.

``separates`` tells ``boxes.boxed_answer`` that two boxes with a retraction or a doubt
between them form no set of answers.

Linear-time reads of hostile text: the regexes have bounded quantifiers and only see the
first ``PATTERN_WINDOW`` characters after the answer. Nothing here parses or evaluates it.
"""

from __future__ import annotations

import re
from fractions import Fraction

from megatron_rl.rewards.stated import MATH, PATTERN_WINDOW, math_span, value_at

# A statement that the answer before it is wrong ("Wait, that is wrong", "that's incorrect",
# "I made a mistake", "scratch that", "no, wait"): the answer is then what is stated after it.
_WRONG = r"(?:wrong|incorrect|not\s{1,4}(?:right|correct|the\s{1,4}answer)|a\s{1,4}mistake)"
_RETRACTION_RE = re.compile(
    r"(?i)\b(?:(?:that|this|it|which|the\s{1,4}(?:box|answer|value|result))"
    rf"(?:\s{{1,4}}(?:is|was)|'s|’s)\s{{1,4}}{_WRONG}"
    r"|(?:that|this|it)\s{1,4}(?:can(?:'|’|no)t|isn(?:'|’)t|wasn(?:'|’)t)\s{1,4}(?:be\s{1,4})?(?:right|correct)"
    r"|(?:i|we)\s{1,4}(?:made\s{1,4}(?:a|an)\s{1,4}(?:mistake|error)|was\s{1,4}wrong|miscalculated)"
    # ... but not one already put right: "I made a mistake earlier in step 2".
    r"(?!\s{1,4}(?:earlier|before|above|previously|initially|at\s{1,4}first|in\s{1,4}(?:step|my|the)))"
    r"|my\s{1,4}mistake|scratch\s{1,4}that|oops|correction(?=\s{0,4}:)"
    # "I'm wrong, it's 8" (not "correct me if I'm wrong", "unless I am wrong").
    r"|(?<!if\s)(?<!unless\s)(?:i|we)(?:'m|’m|'re|’re|\s{1,4}am|\s{1,4}are)\s{1,4}wrong"
    r"|no\s{0,4},?\s{0,4}wait|wait\s{0,4},?\s{0,4}no(?!\s{1,4}(?:one|more|need))"
    r"|(?:is|was)n(?:'|’)t\s{1,4}(?:right|correct))\b"
    # The answer itself as the subject, right after it: "$\boxed{7}$ is incorrect".
    rf"|\A[\s$)\]}}\\]{{0,8}}(?:is|was)\s{{1,4}}{_WRONG}\b"
)
# A sign of doubt that may bring a new value: "Actually, D.", "Hmm, no, it's 8", "Err, 8",
# "I meant 8", "make that 8", "on second thought", "No, 8" ("no" as an interjection, not
# "no one").
# A correction announced ("Correction, 8.", "Edit: 8", "let me correct that: 8") is one too,
# not "no correction needed", and so is a label with a colon ("Final: 8", "Result: 8").
_DOUBT_RE = re.compile(
    r"(?i)\b(?:actually|wait|hmm+|err+|erm|um+|i\s{1,4}meant?|make\s{1,4}that|re-?check(?:ing)?"
    r"|rather|instead|on\s{1,4}second\s{1,4}thought|hold\s{1,4}on|no(?=\s{0,4}[,.!:;—–-])"
    r"|(?<!no\s)(?<!without\s)(?:corrections?|corrected|errat(?:um|a)|edit|update)"
    r"(?=\s{0,4}[-,.!:;—–$\d])"
    r"|(?:correcting|let\s{1,4}me\s{1,4}correct|to\s{1,4}correct)\s{1,4}(?:myself|that|this|it)"
    # A label that states a value anew after the answer: "Final: 8", "Result: 8".
    r"|(?:final|result|conclusion|verdict|corrected|revised)(?=\s{0,4}:))\b"
)
# How far after a sign of doubt a value is looked for.
_DOUBT_REACH = 300
# The first value after a sign of doubt: a math span (read by ``math_span``), a number, or
# an option letter that ends its sentence ("Actually, D.").
_VALUE_START_RE = re.compile(
    r"\$|\\[(\[]|(?<![\w.^_{])[-+−]?\d|(?<![\w\\])\(?[A-J]\)?(?=\s{0,4}(?:[.!;?]|$))",
    re.MULTILINE,
)
_NUMBER_RE = re.compile(r"[-+−]?\d+(?:[.,/]\d+){0,8}")
# After a number, an operator: the number opens an expression ("3 + 4 = 7"), read as one.
_OPERATOR_AFTER_RE = re.compile(r"\s{0,4}[-+*/=×·^]")
# That expression in plain text: numbers, operators, brackets and single spaces, to the
# first word or sentence end ("3 + 4 = 7, confirmed" is ``3 + 4 = 7``).
_EXPRESSION_RE = re.compile(
    r"[-+−]?\d(?:[\d+\-−*/=×·^(){}]|\\[A-Za-z]{1,12}|[ \t](?=\S)|\.(?=\d)){0,200}"
)
_DANGLING = " \t+-−*/=×·^"
# A plain number that ``Fraction`` reads: ``7``, ``-7.0``, ``14/2``.
_PLAIN_NUMBER_RE = re.compile(r"[-−]?\d{1,20}(?:\.\d{1,20}|/\d{1,20})?")
# Before a value, what denies it: "rather than 8", "instead of 8", "not 8", "n = 2".
_DENIAL_RE = re.compile(r"(?i)(?:\bnot|n't|n’t|\bthan|\bof|[A-Za-z]\s{0,4}=)\s{0,4}$")
# In a question "not" denies nothing: "Is it not 8?" offers 8.
_QUESTION_DENIAL_RE = re.compile(r"(?i)(?:\bthan|\bof|[A-Za-z]\s{0,4}=)\s{0,4}$")
_NO_DENIAL_RE = re.compile(r"(?!)")
# A question answered "No." right after it ("Is it 8? No."): its value is refused, and the
# "No" is a sign of doubt of its own (a value after it is the answer).
_ANSWERED_NO_RE = re.compile(r"(?i)\s{0,4}(?:no|nope)\b\s{0,4}(?:[,.!;:—–-]|$)")
# What states the corrected value after a retraction: "the value is 6", "it should be $6$",
# "= 6", ": 6", "it's 6". How many of those (the last ones) are read.
_MAX_RESTATED_TRIES = 8
_RESTATED_RE = re.compile(r"(?i)(?:\bis|\bbe|'s|’s|=|:)\s{0,8}(?=\S)")


def _value_after_doubt(window: str, i: int) -> str | None:
    """The first value stated in the ``_DOUBT_REACH`` characters after ``window[i]`` that
    is not denied ("rather than 8"), or None."""
    end = min(len(window), i + _DOUBT_REACH)
    for found in _VALUE_START_RE.finditer(window, i, end):
        j = found.start()
        if _DENIAL_RE.search(window[max(i, j - 12) : j]):
            continue
        span = math_span(window, j)
        if span is not None:
            return span[0].strip() or None
        if window[j] == "\\":
            continue  # a delimiter that never closes
        number = _NUMBER_RE.match(window, j)
        if number is None:
            return found.group(0).strip("()")
        if _OPERATOR_AFTER_RE.match(window, number.end()):
            expression = _EXPRESSION_RE.match(window, j).group(0).rstrip(_DANGLING)
            # A check ("3 + 4 = 7, confirmed") is its last side, unless the text after it
            # states another value ("7 = 8 - 1, so 8", "3+4=7, 7+1=8"): the last stated
            # value counts.
            last = "".join(re.split(r"=|\\equiv", expression)[-1].split()).strip("().")
            later = _values(window[j + len(expression) : end])
            return later[-1] if any(not _same_value(v, last) for v in later) else expression or None
        return number.group(0)
    return None


# An alternative value, under a condition or not: "otherwise 8", "or, if ..., 8", "unless
# ... in which case 8", "alternatively 8", "or 8 if ...", "or 8".
_CONDITIONAL_RE = re.compile(
    r"(?i)\b(?:otherwise|unless|in\s{1,4}which\s{1,4}case|alternatively|if\s{1,4}instead"
    r"|or\s{0,4},?\s{0,4}(?:if|when|assuming|possibly|maybe|perhaps)|else|maybe|perhaps"
    r"|possibly|probably|(?:could|might)\s{1,4}(?:also\s{1,4})?be|not\s{1,4}sure"
    r"|or\s{1,4}[^\s,.;]{1,40}\s{1,4}(?:if|when|assuming)"
    # "Or was it 8?", "or is it $8$", "or else 8", "alternately 8", "another answer is 8".
    r"|or\s{0,4},?\s{0,4}(?:is|was|would|could|should|might|may|maybe|else|even|rather)"
    r"|alternat(?:e|ive)(?:ly)?|another\s{1,4}(?:possible\s{1,4}|valid\s{1,4})?"
    r"(?:answer|solution|value|option|possibility|candidate))\b"
    # "or 8", "or $8$", "/ 8" right after the answer: a second value offered.
    r"|\bor\s{1,4}(?=[$\d]|\\[(\[]|\\boxed)|\A[\s$)\]}\\]{0,8}/\s{0,4}(?=[$\d])"
    # "if the endpoints count, 8", "if ..., it would be 8", "if ... then $8$".
    r"|(?i:\bif\b[^.\n]{0,80}?(?:,|:|\bthen\b)\s{0,4}"
    r"(?:it(?:'s|’s|\s{1,4}is|\s{1,4}would\s{1,4}be)\s{0,4})?(?=[$\d]|\\[(\[]|\\boxed))"
)
# After a condition, how far (at most; a sentence or line ends it sooner) a value is looked for.
_CONDITION_REACH = 160
# A hedge word that ends its line, with a colon or comma or none: its value comes on the
# next line that is not blank.
_LINE_LEAD_RE = re.compile(r"[ \t]{0,4}[:,]?[ \t]{0,4}\n(?:[ \t]{0,4}\n){0,4}")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)|\n")
_VALUE_MARK_RE = re.compile(r"\d|\$|\\[(\[]|\\boxed")


def _conditional(window: str, answer: str | None = None) -> bool:
    """``window`` offers another value under a condition (``_CONDITIONAL_RE`` and then a
    number or math before its sentence ends), one that is not ``answer`` ("Alternatively,
    7 can be found by counting" offers none)."""
    for found in _CONDITIONAL_RE.finditer(window):
        reach = window[found.start() : found.end() + _CONDITION_REACH]
        start = found.end() - found.start()
        if _LINE_LEAD_RE.match(reach, start):
            # "Alternatively:\n$$8$$", "Otherwise,\n\n8": the value is on the next line.
            start = _LINE_LEAD_RE.match(reach, start).end()
        end = _SENTENCE_END_RE.search(reach, start)
        sentence = reach[: end.start() if end else len(reach)]
        if not _VALUE_MARK_RE.search(sentence):
            continue
        if answer is None or "\\boxed" in sentence:
            return True
        values = _values(sentence, _NO_DENIAL_RE)
        same = "".join(answer.split())
        if not values or any(not _same_value(value, same) for value in values):
            return True
    return False


# Another value endorsed beside the answer: "although 8 also works", "8 works too", "8 is
# also a solution", "so does 8": a word of addition and one of approval in one sentence.
_ALSO_RE = re.compile(
    r"(?i)\b(?:also|too|as\s{1,4}well|equally|(?:so|as)\s{1,4}(?:does|do|is|would))\b"
)
_APPROVAL_RE = re.compile(
    r"(?i)\b(?:works?|valid|correct|right|possible|acceptable|allowed|fine|good|ok(?:ay)?|true"
    r"|holds?|satisf(?:y|ies|ying)|fits?|solutions?|answers?|solves?|do|does|serves?"
    r"|suffices?|counts?|qualif(?:y|ies)|options?|candidates?|possibilit(?:y|ies))\b"
)
# A word of addition right before or after a value ("Also 8.", "and also $8$", "8 too.",
# "8 as well"): another value offered, approved or not.
_ALSO_VALUE_RE = re.compile(
    r"(?i)\b(?:also|too|as\s{1,4}well)\s{0,4}[,:]?\s{0,4}(?:[$\d]|\\[(\[]|\\boxed)"
    r"|(?:[\d$}]|\\[)\]])\s{0,4},?\s{0,4}(?:also|too|as\s{1,4}well)\b"
)
# Where a question or a sentence ends, how much of a sentence around "?" or "also" is read,
# and how many of each (the first) are.
_QUESTION_REACH = 200
_MAX_QUESTIONS = 16
# A point before a digit is a decimal point ("2 \\cdot 3.5 = 7"), no end.
_CLAUSE_END_RE = re.compile(r"\.(?!\d)|[!?;\n]")


def _values(text: str, denial: re.Pattern = _DENIAL_RE) -> list[str]:
    """The values ``text`` states, at most 8, none denied (``denial``: "not 8", "n = 2"):
    math spans, expressions read to their last side ("3 + 4 = 7" is 7), numbers and option
    letters; without spaces and delimiters."""
    values: list[str] = []
    read_to = 0  # the end of the last math span or expression read: none is read twice
    for found in _VALUE_START_RE.finditer(text):
        j = found.start()
        if j < read_to or denial.search(text[max(0, j - 12) : j]):
            continue
        span = math_span(text, j)
        if span is not None:
            value, read_to = span[0], span[1]
        elif text[j] in "$\\":
            continue  # a delimiter that never closes (the one that closed the answer)
        else:
            number = _NUMBER_RE.match(text, j)
            if number is None:
                value = found.group(0).strip("()")
            elif _OPERATOR_AFTER_RE.match(text, number.end()):
                value = _EXPRESSION_RE.match(text, j).group(0).rstrip(_DANGLING)
                read_to = j + len(value)
            else:
                value = number.group(0)
                read_to = number.end()  # "14/2" is one value, not 14/2 and 2
        value = re.split(r"=|\\equiv", value)[-1]
        values.append("".join(value.split()).strip("().").removesuffix("\\right"))
        if len(values) >= 8:
            break
    return [v for v in values if v]


def _number(value: str) -> Fraction | None:
    """``value`` as an exact number when it is a plain one (``7``, ``7.0``, ``14/2``)."""
    if len(value) > 40 or not _PLAIN_NUMBER_RE.fullmatch(value):
        return None
    try:
        return Fraction(value.replace("−", "-"))
    except (ValueError, ZeroDivisionError):
        return None


def _same_value(value: str, answer: str) -> bool:
    """``value`` is ``answer``: the same text, or the same plain number (``14/2`` is 7)."""
    if value == answer:
        return True
    number = _number(value)
    return number is not None and number == _number(answer)


def _other_value(text: str, answer: str | None, denial: re.Pattern = _DENIAL_RE) -> bool:
    """``text`` states a value that is not ``answer`` (any value when ``answer`` is None)."""
    if answer is None:
        return bool(_values(text, denial))
    same = "".join(answer.split())
    return any(not _same_value(value, same) for value in _values(text, denial))


def _endorsed_alternative(window: str, answer: str | None) -> bool:
    """``window`` offers another value as a question ("Or was it 8?", "Is it 8?") or
    endorses one beside the answer ("although 8 also works", "8 works too"): the sentence
    states a value other than ``answer``."""
    questions = 0
    for mark in re.finditer(r"\?", window):
        questions += 1
        if questions > _MAX_QUESTIONS:
            break
        start = max(0, mark.start() - _QUESTION_REACH)
        ends = list(_CLAUSE_END_RE.finditer(window, start, mark.start()))
        question = window[ends[-1].end() if ends else start : mark.start()]
        if _ANSWERED_NO_RE.match(window, mark.end()):
            continue
        if _other_value(question, answer, _QUESTION_DENIAL_RE):
            return True
    for count, also in enumerate(_ALSO_RE.finditer(window)):
        if count >= _MAX_QUESTIONS:
            break
        ends = list(
            _CLAUSE_END_RE.finditer(window, max(0, also.start() - _QUESTION_REACH), also.start())
        )
        start = ends[-1].end() if ends else max(0, also.start() - _QUESTION_REACH)
        end = _CLAUSE_END_RE.search(window, also.end(), also.end() + _QUESTION_REACH)
        sentence = window[start : end.start() if end else also.end() + _QUESTION_REACH]
        endorsed = _APPROVAL_RE.search(sentence) or _ALSO_VALUE_RE.search(sentence)
        if endorsed and _other_value(sentence, answer):
            return True
    return False


def separates(between: str) -> bool:
    """The text between two boxes retracts or doubts the first ("$\\boxed{7}$ was wrong;
    $\\boxed{8}$", "Actually, I meant $\\boxed{8}$"): they are no set of answers."""
    window = between[:PATTERN_WINDOW]
    return _RETRACTION_RE.search(window) is not None or _DOUBT_RE.search(window) is not None


def after_answer(text: str, answer: str | None = None) -> str | None:
    """What ``text`` (the text after a final answer, ``answer``) makes of that answer: None
    when it stands; "" when it is no answer (retracted with no value stated, offered with
    an alternative, conditional or not, or with another value asked or endorsed,
    ``_endorsed_alternative``); else the value that replaces it (the last stated after a
    retraction or a sign of doubt)."""
    window = text[:PATTERN_WINDOW]
    if _conditional(window, answer) or _endorsed_alternative(window, answer):
        return ""
    retractions = list(_RETRACTION_RE.finditer(window))
    start = retractions[-1].end() if retractions else 0
    doubts = list(_DOUBT_RE.finditer(window, start))
    for doubt in reversed(doubts[-_MAX_RESTATED_TRIES:]):
        value = _value_after_doubt(window, doubt.end())
        if value:
            return value
    if not retractions:
        return None
    restated = list(_RESTATED_RE.finditer(window, start))
    for statement in reversed(restated[-_MAX_RESTATED_TRIES:]):
        value = value_at(window, statement.end(), clause=False)
        if value is not None and value[0] and value[1] == MATH:
            return value[0]
    return ""
