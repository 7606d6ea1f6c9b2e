"""Reading runs' (compute, pass rate) points from metrics.jsonl or CSV files."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass
class RunData:
    """One run's evaluation points, in file order with non-decreasing x."""

    name: str
    source: str
    x_field: str
    y_field: str
    x: np.ndarray  # [N] compute, non-decreasing, >= 0
    y: np.ndarray  # [N] metric

    def default_r0(self) -> float:
        """y of the record with the smallest x (the step-0 evaluation)."""
        return float(self.y[int(np.argmin(self.x))])


def run_name(path: Path) -> str:
    """A run's display name: the directory of a ``metrics.jsonl``, else the file stem."""
    if path.name == "metrics.jsonl" and path.parent.name:
        return path.parent.name
    return path.stem


def load_run(
    path: str | Path,
    x_field: str = "gpu_hours",
    y_field: str = "val_pass_rate",
    name: str | None = None,
    growing: bool = False,
) -> RunData:
    """Read (x, y) points from a metrics.jsonl (records without ``y_field`` are skipped) or a CSV.

    ``growing``: the file is being written (a running run): a last line without its newline
    is a record in the making and is ignored.

    Raises ``ValueError`` naming the file (and line, field) for missing fields, non-numeric,
    NaN or infinite values, negative or decreasing x, a pass rate outside [0, 1], or a file
    with no usable record.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    text = path.read_text()
    if growing and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    if _is_jsonl(path, text):
        rows, fields_seen = _read_jsonl(path, text, x_field, y_field)
    else:
        rows, fields_seen = _read_csv(path, text, x_field, y_field)
    if not rows:
        seen = ", ".join(sorted(fields_seen)) or "none"
        raise ValueError(f"{path}: no record has field {y_field!r} (fields seen: {seen})")
    for (line_prev, x_prev, _), (line, x, _) in zip(rows, rows[1:]):
        if x < x_prev:
            raise ValueError(
                f"{path} line {line}: {x_field} is not monotone ({x} after {x_prev} on line "
                f"{line_prev}); a resumed run that appended repeated steps? keep one record "
                "per evaluation"
            )
    if is_rate(y_field):
        for line, _, y in rows:
            if not 0.0 <= y <= 1.0:
                raise ValueError(
                    f"{path} line {line}: {y_field} = {y:g} is not a pass rate in [0, 1]"
                )
    x = np.array([r[1] for r in rows], dtype=np.float64)
    y = np.array([r[2] for r in rows], dtype=np.float64)
    return RunData(name or run_name(path), str(path), x_field, y_field, x, y)


def is_rate(field: str) -> bool:
    """Whether ``field`` holds a fraction in [0, 1]: ``val_pass_rate``, ``pass_rate``,
    ``val_pass_rate/math``, ... (the sigmoid's asymptote of a pass rate is at most 1)."""
    return field.split("/", 1)[0].endswith("pass_rate")


def domain_fields(path: str | Path, y_field: str = "val_pass_rate") -> list[str]:
    """The per-domain fields of ``y_field`` in a metrics.jsonl (``val_pass_rate/math``,
    ``val_pass_rate/code`` ...: a mixture of data sources), in first-seen order; [] for a
    CSV, a single-source run, or a missing file. A torn last line is ignored."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    if not _is_jsonl(path, text):
        return []
    prefix, fields = f"{y_field}/", {}
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # load_run names the bad line
        if isinstance(record, dict):
            fields.update(dict.fromkeys(k for k in record if k.startswith(prefix)))
    return list(fields)


def _is_jsonl(path: Path, text: str) -> bool:
    if path.suffix.lower() in JSONL_SUFFIXES:
        return True
    if path.suffix.lower() == ".csv":
        return False
    return text.lstrip().startswith("{")


def _read_jsonl(
    path: Path, text: str, x_field: str, y_field: str
) -> tuple[list[tuple[int, float, float]], set[str]]:
    rows: list[tuple[int, float, float]] = []
    seen: set[str] = set()
    lines = text.splitlines()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if line_no == len(lines) and not text.endswith("\n"):
                break  # a torn last line: the run is writing it (or died writing it)
            raise ValueError(f"{path} line {line_no}: invalid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {line_no}: expected a JSON object per line")
        seen.update(record)
        if record.get(y_field) is None:
            continue
        if record.get(x_field) is None:
            raise ValueError(
                f"{path} line {line_no}: record has {y_field!r} but no {x_field!r} field"
            )
        where = f"{path} line {line_no}"
        rows.append(
            (
                line_no,
                _number(record[x_field], where, x_field, x=True),
                _number(record[y_field], where, y_field),
            )
        )
    return rows, seen


def _read_csv(
    path: Path, text: str, x_field: str, y_field: str
) -> tuple[list[tuple[int, float, float]], set[str]]:
    reader = csv.DictReader(text.splitlines())
    columns = [c.strip() for c in reader.fieldnames or []]
    for field in (x_field, y_field):
        if field not in columns:
            raise ValueError(
                f"{path}: missing column {field!r} (columns: {', '.join(columns) or 'none'})"
            )
    reader.fieldnames = columns
    rows: list[tuple[int, float, float]] = []
    for line_no, row in enumerate(reader, start=2):
        y_text = (row.get(y_field) or "").strip()
        if not y_text:
            continue
        x_text = (row.get(x_field) or "").strip()
        where = f"{path} line {line_no}"
        if not x_text:
            raise ValueError(f"{where}: row has {y_field!r} but no {x_field!r} value")
        rows.append(
            (line_no, _number(x_text, where, x_field, x=True), _number(y_text, where, y_field))
        )
    return rows, set(columns)


def _number(value: object, where: str, field: str, x: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{where}: {field} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{where}: {field} must be a number, got {value!r}") from None
    if math.isnan(number):
        raise ValueError(f"{where}: {field} is NaN")
    if math.isinf(number):
        raise ValueError(f"{where}: {field} is infinite")
    if x and number < 0:
        raise ValueError(f"{where}: {field} must be >= 0, got {number}")
    return number
