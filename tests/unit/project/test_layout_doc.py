"""docs/development.md's layout names every package of megatron_rl (it omitted three)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_layout_names_every_package():
    text = (ROOT / "docs" / "development.md").read_text()
    layout = text[text.index("## Layout") :]
    named = set(re.findall(r"megatron_rl/(\w+)/", layout))
    packages = {p.parent.name for p in (ROOT / "megatron_rl").glob("*/__init__.py")}
    assert packages - named == set(), f"docs/development.md's layout omits {packages - named}"
    assert named - packages == set(), f"docs/development.md's layout names {named - packages}"
