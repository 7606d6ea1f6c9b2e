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


def test_the_plans_in_the_docs_are_the_planners(tmp_path):
    """docs/planning.md's tables had drifted from what `megatron-rl plan` prints (8B push 2.2
    vs 4.9 GiB, engine total 124.9 vs 126.4): its plan blocks are now written by the planner,
    and a block whose figures differ from the planner's is rewritten."""
    from megatron_rl.planning.docs import refresh_plans

    page = (ROOT / "docs" / "planning.md").read_text()
    assert page.count("<!-- plan: ") >= 4
    assert refresh_plans(page, ROOT) == page  # current (test_docs checks every generated page)
    stale = page.replace("| **total** | **126.4** |", "| **total** | **124.9** |", 1)
    assert stale != page and refresh_plans(stale, ROOT) == page
