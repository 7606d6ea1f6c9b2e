"""The preflight's results: one row per named check, a table for people, JSON for tools."""

from __future__ import annotations

import io
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

Status = Literal["PASS", "FAIL", "SKIP"]
REPORT_FILE = "preflight.json"


@dataclass
class CheckResult:
    """One check: ``value`` measured, ``limit`` it was held to (both as people read them),
    ``details`` the numbers behind them (JSON), ``message`` what went wrong or what to know.
    SKIP: not run because a check it needs failed (the report then fails too)."""

    name: str
    status: Status
    value: str = ""
    limit: str = ""
    seconds: float = 0.0
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "PASS"


@dataclass
class Report:
    """Every check of one preflight, in the order they ran."""

    recipe: str
    run_dir: str
    platform: str
    world_size: int
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            **{k: v for k, v in asdict(self).items() if k != "results"},
            "checks": [_finite(asdict(r)) for r in self.results],
        }

    def write(self, run_dir: str | Path) -> Path:
        """``RUN_DIR/preflight.json`` (written whole, then renamed into place; the part file
        is this process's own: a failing rank may write it while rank 0 does)."""
        path = Path(run_dir) / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.part{os.getpid()}")
        part.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        part.replace(path)
        return path


def _finite(value: Any) -> Any:
    """NaN / inf as null: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def render_table(report: Report) -> str:
    """The PASS/FAIL table as text (rich), with a verdict line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"megatron-rl preflight: {report.recipe} ({report.platform})")
    for column in ("check", "status", "measured", "limit", "seconds"):
        table.add_column(column, overflow="fold")
    colour = {"PASS": "green", "FAIL": "bold red", "SKIP": "yellow"}
    for r in report.results:
        table.add_row(
            r.name,
            f"[{colour[r.status]}]{r.status}[/]",
            r.value,
            r.limit,
            f"{r.seconds:.1f}",
        )
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=False, color_system=None)
    console.print(table)
    for r in report.failed():
        console.print(f"{r.status} {r.name}: {r.message}", markup=False)
    verdict = "PASSED" if report.passed else f"FAILED ({len(report.failed())} checks)"
    path = Path(report.run_dir) / REPORT_FILE
    console.print(f"preflight {verdict} in {report.seconds:.0f} s; report: {path}", markup=False)
    return out.getvalue()
