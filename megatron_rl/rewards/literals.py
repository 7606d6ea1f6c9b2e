"""Python literals as the values of functional tests: arguments in, results out, never eval.

JSON has no tuple, no set, no non-string dict key, no bytes and no complex number, so a test
``assert f((1, 2)) == {(1, 2): 3}`` cannot be carried in JSON. Functional tests carry
``ast.literal_eval``-safe text instead: ``encode`` writes it, ``decode`` reads it (only
literals: no names, calls or attribute access, so nothing of the text is ever run).
Non-finite floats are written ``1e999`` / ``-1e999`` (literals that read back as infinity);
NaN has no literal and is refused.

This file is stdlib-only and self-contained: the sandbox prepends its source to the harness
that runs model programs (which encodes their results with it).
"""

import math

# Nesting beyond this is refused (literal_eval and repr recurse on the C stack).
MAX_DEPTH = 100


def encode(value, depth=0):
    """``ast.literal_eval``-safe text of ``value``; ValueError for anything else.

    Accepted: None, bool, int, float (not NaN), complex, str, bytes, and lists, tuples,
    dicts, sets and frozensets of them (frozensets are written as sets, which compare
    equal). Subclasses (namedtuple, OrderedDict, Counter, defaultdict) are written as their
    base type, which they compare equal to; numpy values through ``tolist()``.
    """
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, str, bytes):
        return repr(value)
    if kind is float:
        if math.isnan(value):
            raise ValueError("NaN has no literal")
        if math.isinf(value):
            return "1e999" if value > 0 else "-1e999"
        return repr(value)
    if kind is complex:
        if not (math.isfinite(value.real) and math.isfinite(value.imag)):
            raise ValueError("a non-finite complex number has no literal")
        return repr(value)
    inner = depth + 1
    if isinstance(value, list):
        return "[" + ", ".join(encode(v, inner) for v in value) + "]"
    if isinstance(value, tuple):
        items = [encode(v, inner) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, dict):
        pairs = (f"{encode(k, inner)}: {encode(v, inner)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    if isinstance(value, (set, frozenset)):
        if not value:
            return "set()"
        return "{" + ", ".join(sorted(encode(v, inner) for v in value)) + "}"
    if isinstance(value, (bool, int, float, str, bytes)):
        # Subclasses (IntEnum, str enums): their plain value.
        for base in (bool, int, float, str, bytes):
            if isinstance(value, base):
                return encode(base(value), inner)
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and type(value).__module__.startswith("numpy"):
        return encode(tolist(), inner)
    raise ValueError(f"a {kind.__name__} has no literal")


def decode(text):
    """The value of literal ``text`` (``ast.literal_eval``); ValueError when it is not one."""
    import ast  # here: the sandbox harness of a script never needs it (a third of its start)

    try:
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"not a Python literal: {text[:200]!r} ({type(exc).__name__})") from exc
