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


def test_the_simulators_predictions_in_the_readme_come_from_todays_inputs():
    """tools/README.md's figures had drifted from what the simulator prints (5,731 vs 5,765
    GPU-h). Its predictions block records the digest of the files it was computed from
    (simulator, scheduler, recipes); a change to any of them fails here until
    `tools/simulate_run.py --calibrate --write-readme` rewrites it (minutes: not run in CI)."""
    from megatron_rl.simulation.report import prediction_inputs_digest

    text = (ROOT / "tools" / "README.md").read_text()
    m = re.search(r"<!-- simulate --calibrate, inputs (\w+) -->", text)
    assert m, "tools/README.md lost its predictions block"
    assert m.group(1) == prediction_inputs_digest(ROOT), (
        "the simulator's inputs changed since tools/README.md's predictions were written: run "
        "tools/simulate_run.py --calibrate --write-readme"
    )


def test_nothing_cites_files_outside_the_repository():
    """Docs, recipes, code and tests cited SCALERL.md / DESIGN.md (not in the repository) and
    read a file from outside it: what they need of those is in docs/paper.md and tests/data."""
    import subprocess

    out = subprocess.run(
        ["git", "grep", "-n", "-e", "SCALERL.md", "-e", "DESIGN.md", "-e", "shared/models",
         "--", ".", f":!{Path(__file__).relative_to(ROOT)}"],
        cwd=ROOT, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert out == "", out
