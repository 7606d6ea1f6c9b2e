"""``docs/config.md``: every recipe key with its type, default and one-line meaning, read from
the config dataclasses (no torch import).

A field's meaning is its entry in its class docstring's ``Attributes:`` (or ``Args:``) section
(``name: meaning``; ``a / b: meaning`` covers both), else the ``#`` comment right above the
field. ``tools/gen_docs.py`` writes the page; ``tests/unit/project/test_docs.py`` fails when a
key has no meaning or the page is stale.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from dataclasses import dataclass
from typing import Any

from megatron_rl.config.loader import to_dict

_SECTION = re.compile(r"^\s*(Attributes|Args|Fields):\s*$")
_ENTRY = re.compile(r"^(\s*)([A-Za-z_][\w ./,]*?)\s*(?:\([^)]*\))?:\s+(.*)$")


@dataclass(frozen=True)
class KeyDoc:
    """One recipe key: dotted path, type as written, default (YAML-ish text), meaning."""

    key: str
    type: str
    default: str
    meaning: str


def _docstring_entries(cls: type) -> dict[str, str]:
    """``name -> meaning`` from the class docstring's Attributes / Args section."""
    doc = inspect.getdoc(cls) or ""
    entries: dict[str, str] = {}
    inside, indent, current = False, None, []
    names: list[str] = []
    pending: str | None = None

    def flush() -> None:
        if names:
            text = " ".join(" ".join(current).split())
            for name in names:
                entries.setdefault(name, text)

    for line in doc.splitlines():
        if _SECTION.match(line):
            inside, indent = True, None
            continue
        if not inside:
            continue
        if not line.strip():
            continue
        lead = len(line) - len(line.lstrip())
        if pending is not None:  # a list of names that went on to this line
            line, pending = pending + " " + line.strip(), None
            lead = len(line) - len(line.lstrip())
        m = _ENTRY.match(line)
        if not m and (indent is None or lead == indent) and line.rstrip().endswith(","):
            pending = line.rstrip()
            continue
        if m and (indent is None or lead == indent):
            flush()
            indent = lead
            names = [n.strip() for n in re.split(r"\s*[/,]\s*", m.group(2)) if n.strip()]
            current = [m.group(3)]
        elif indent is not None and lead > indent:
            current.append(line.strip())
        elif indent is not None and lead < indent:
            flush()
            inside, names, current = False, [], []
    flush()
    return entries


def _comment_entries(cls: type) -> dict[str, str]:
    """``name -> meaning`` from ``#`` comments right above (or after) a field's line."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    field_line = re.compile(r"^    ([A-Za-z_]\w*)\s*:[^#]*?(#\s*(.*))?$")
    for i, line in enumerate(lines):
        m = field_line.match(line)
        if not m:
            continue
        above = []
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            above.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        text = " ".join(above) or (m.group(3) or "")
        if text:
            out[m.group(1)] = text
    return out


_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bal)(?<!\bvs)\.(?=\s+[A-Z]|$)")


def _sentence_end(text: str, start: int = 0) -> re.Match | None:
    """The next sentence end at or after ``start`` that is not inside parentheses or a quote
    (``("The final answer is $X$. I hope ...")`` was cut after its first sentence)."""
    for m in _SENTENCE_END.finditer(text, start):
        before = text[: m.start()]
        if before.count("(") <= before.count(")") and before.count('"') % 2 == 0:
            return m
    return None


def _first_sentence(text: str) -> str:
    """The first sentence (the second too when the first is a mere word or two)."""
    m = _sentence_end(text)
    if m and m.end() < 25:
        nxt = _sentence_end(text, m.end())
        m = nxt or m
    return text[: m.end()] if m else text


def _meaning(cls: type, name: str) -> str:
    doc = _docstring_entries(cls).get(name) or _comment_entries(cls).get(name, "")
    return _first_sentence(doc.strip())


def _nested(tp: Any) -> tuple[type | None, bool]:
    """(the dataclass inside a field's type, whether it is a list of them)."""
    if dataclasses.is_dataclass(tp):
        return tp, False
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple) and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    dcs = [a for a in args if dataclasses.is_dataclass(a)]
    if len(dcs) == 1 and origin is not None and origin not in (list, tuple, dict):
        return dcs[0], False  # X | None
    return None, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _show(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    value = to_dict(value)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if not isinstance(value, str) else json.dumps(value)


def keys(cls: type | None = None, prefix: str = "") -> list[KeyDoc]:
    """Every recipe key under ``cls`` (default: the whole ``RunConfig``), depth first."""
    if cls is None:
        from megatron_rl.config.schema import RunConfig

        cls = RunConfig
    hints = typing.get_type_hints(cls)
    out: list[KeyDoc] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}{f.name}"
        inner, is_list = _nested(hints[f.name])
        default = _default(f)
        if inner is not None and not is_list and dataclasses.is_dataclass(default):
            out.extend(keys(inner, f"{key}."))
            continue
        type_text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(KeyDoc(key, type_text, _show(default), _meaning(cls, f.name)))
        if inner is not None:  # a list of sections (data.sources) or an optional section
            out.extend(keys(inner, f"{key}[]." if is_list else f"{key}."))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """``docs/config.md``: one table per top-level section."""
    lines = [
        "# Recipe reference",
        "",
        "<!-- Generated by tools/gen_docs.py from the config dataclasses and their docstrings;",
        "     do not edit by hand (tests/unit/project/test_docs.py fails when it is stale). -->",
        "",
        "Every key of a recipe (`recipes/*.yaml`, or `key=value` overrides on the command line)",
        "with its type, its default (when a recipe does not set it; `recipes/base_scalerl.yaml`",
        "sets many) and its meaning. `a[].b`: key `b` of each entry of the list `a`. The full",
        "text of a key is in its class's docstring (`megatron_rl/*/config.py`,",
        "`megatron_rl/config/sections.py`, `megatron_rl/config/schema.py`).",
        "",
    ]
    section = None
    for doc in keys():
        top = doc.key.split(".")[0] if "." in doc.key else "(top level)"
        if top != section:
            section = top
            lines += [
                "",
                f"## {section}",
                "",
                "| key | type | default | meaning |",
                "|---|---|---|---|",
            ]
        lines.append(
            f"| `{doc.key}` | `{_cell(doc.type)}` | `{_cell(doc.default)}` | {_cell(doc.meaning)} |"
        )
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"
