"""Audit of the reward on a user's own evaluation outputs (``megatron-rl reward-audit``).

Before a long run, score the outputs of one's own evaluation harness with the run's reward
and read where the two disagree. Rows (JSONL, one object a line, or Parquet) hold a
``response``, its ``reference`` (a math answer, or code tests in any format of
``megatron_rl.rewards.code.parse_problem``), and optionally a ``label`` (the harness's
verdict: a bool, 0/1, a number > 0 for correct, or "correct" / "incorrect" ...) and a
``domain`` ("math" | "code"). Every row is scored by ``RewardPool`` (the worker pool and the
sandbox, as in training). With labels, each disagreement is put in a class:

- ``extraction_empty``: the label says correct, and the reward found no answer (no box, no
  stated answer; for code no program block);
- ``unequal``: the label says correct, an answer was found and judged different (for code:
  a test failed);
- ``rewarded_label_wrong``: the reward pays +1 where the label says wrong (a possible false
  positive of the reward, or a mistake of the label: read these first);
- ``timeout``: the verification (math) or the program (code) ran out of time;
- ``crash``: the verifier crashed or the sandbox failed;
- ``bad_reference``: the reference cannot be read (math: does not parse; code: unusable
  tests or a problem that needs a special judge).

Rows without a reference are refused, naming the row.
"""

from __future__ import annotations

import json
import logging
import math as pymath
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.rewards import code
from megatron_rl.rewards import math as math_reward
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.extraction import extract_code, extract_math_answer
from megatron_rl.rewards.pool import RewardPool, check_references

logger = logging.getLogger(__name__)

DOMAINS = ("math", "code")
CLASSES = (
    "extraction_empty",
    "unequal",
    "rewarded_label_wrong",
    "timeout",
    "crash",
    "bad_reference",
)
_TIMEOUT = {math_reward.TIMEOUT, code.TIMEOUT_WALL, code.TIMEOUT_CPU}
_CRASH = {"crashed", "error"}
_BAD_REFERENCE = {math_reward.BAD_REFERENCE, code.BAD_TESTS, "special_judge"}
_TRUE = {"true", "correct", "yes", "pass", "passed", "1", "+1", "1.0"}
_FALSE = {"false", "incorrect", "wrong", "no", "fail", "failed", "0", "-1", "0.0", "-1.0"}


@dataclass(frozen=True)
class Fields:
    """Names of the row fields the audit reads."""

    response: str = "response"
    reference: str = "reference"
    label: str = "label"
    domain: str = "domain"


@dataclass
class Row:
    """One row read from the file, and how the reward scored it."""

    name: str  # where it is: "FILE line N" / "FILE row N"
    response: str
    reference: Any
    domain: str
    label: bool | None
    id: Any = None
    reward: float | None = None
    status: str = ""
    seconds: float = 0.0
    extracted: str | None = None  # math: the answer read; code: the program

    @property
    def correct(self) -> bool:
        return self.reward is not None and self.reward > 0

    def disagreement(self) -> str | None:
        """The row's class of disagreement (``CLASSES``), or None when it agrees / has no
        label."""
        if self.label is None or self.correct == self.label:
            return None
        if self.correct:
            return "rewarded_label_wrong"
        if self.status in _TIMEOUT:
            return "timeout"
        if self.status in _CRASH:
            return "crash"
        if self.status in _BAD_REFERENCE:
            return "bad_reference"
        if self.extracted is None:
            return "extraction_empty"
        return "unequal"

    def to_dict(self) -> dict[str, Any]:
        """The row for the disagreements file."""
        reference_seen = (
            math_reward.reference_answer(str(self.reference)) if self.domain == "math" else None
        )
        return {
            "row": self.name,
            "id": self.id,
            "domain": self.domain,
            "class": self.disagreement(),
            "label": self.label,
            "reward": self.reward,
            "status": self.status,
            "extracted": self.extracted,
            "reference": self.reference,
            "reference_seen": reference_seen,
            "seconds": round(self.seconds, 3),
            "response_end": self.response[-600:],
        }


@dataclass
class AuditResult:
    """The scored rows and the summaries the command prints."""

    rows: list[Row]
    seconds: float
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def labelled(self) -> list[Row]:
        return [r for r in self.rows if r.label is not None]

    def agreement(self) -> tuple[int, int]:
        """(rows whose reward agrees with the label, labelled rows)."""
        labelled = self.labelled
        return sum(r.correct == r.label for r in labelled), len(labelled)

    def disagreements(self) -> list[Row]:
        return [r for r in self.rows if r.disagreement() is not None]

    def by_class(self) -> dict[str, list[Row]]:
        """Disagreeing rows of each class (every class of ``CLASSES``, possibly empty)."""
        out: dict[str, list[Row]] = {name: [] for name in CLASSES}
        for row in self.disagreements():
            out[row.disagreement()].append(row)  # type: ignore[index]
        return out

    def slowest(self, n: int) -> list[Row]:
        return sorted(self.rows, key=lambda r: -r.seconds)[:n]

    def extracted_answers(self) -> Counter[str]:
        """How often each math answer was extracted (rows with none not counted)."""
        return Counter(
            r.extracted for r in self.rows if r.domain == "math" and r.extracted is not None
        )

    def nothing_extracted(self) -> list[Row]:
        return [r for r in self.rows if r.extracted is None and r.status not in _BAD_REFERENCE]

    def rewarded(self) -> list[Row]:
        """The rows the reward paid (reward > 0)."""
        return [r for r in self.rows if r.correct]

    def without_think_end(self, config: RewardConfig) -> list[Row]:
        """Rows that extracted nothing because they never close their thinking: with
        ``reward.require_think_end`` a response without ``reward.think_end_tag`` has no
        answer (empty when it is off)."""
        if not config.require_think_end:
            return []
        return [r for r in self.nothing_extracted() if config.think_end_tag not in r.response]


def parse_label(value: Any, name: str) -> bool | None:
    """A harness's verdict as a bool (None: no label); ValueError naming the row."""
    if value is None or (isinstance(value, float) and pymath.isnan(value)):
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value > 0
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        if not text:
            return None
    raise ValueError(
        f"{name}: label {value!r} is not a verdict (a bool, a number > 0 for correct, or one "
        f"of {sorted(_TRUE)} / {sorted(_FALSE)})"
    )


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(row name, record) of a JSONL or Parquet file; ValueError naming a bad line."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from exc
        return [(f"{path} row {i + 1}", rec) for i, rec in enumerate(table.to_pylist())]
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path} line {number}: not UTF-8 text (byte {exc.start + 1} of the line is "
                    f"{raw[exc.start : exc.start + 1]!r}): a binary file, or text in another "
                    "encoding (Latin-1?), which must be re-encoded as UTF-8"
                ) from exc
            if not line.strip() or line.startswith("#"):  # a comment line (a file's header)
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path} line {number}: not JSON ({exc})") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{path} line {number}: not a JSON object")
            records.append((f"{path} line {number}", record))
    return records


def read_rows(path: str | Path, domain: str = "math", fields: Fields = Fields()) -> list[Row]:
    """The rows of ``path`` (``.jsonl`` / ``.json`` lines, or ``.parquet``); ValueError
    naming the row and field that is wrong (``MissingReferenceError`` for a row without a
    reference). ``domain`` is that of rows without a domain field."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    path = Path(path)
    rows = []
    for name, record in _records(path):
        response = record.get(fields.response)
        if not isinstance(response, str):
            raise ValueError(
                f"{name}: field {fields.response!r} must be the response text, got "
                f"{type(response).__name__} (fields: {sorted(record)})"
            )
        row_domain = record.get(fields.domain) or domain
        if row_domain not in DOMAINS:
            raise ValueError(
                f"{name}: field {fields.domain!r} must be one of {DOMAINS}, got {row_domain!r}"
            )
        label = parse_label(record.get(fields.label), name)
        reference = record.get(fields.reference)
        check_references([reference], [name])
        rows.append(Row(name, response, reference, row_domain, label, record.get("id")))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _extracted(row: Row, config: RewardConfig) -> str | None:
    if row.domain == "math":
        return extract_math_answer(row.response, config)
    return extract_code(row.response, config)


def _unusable_tests(row: Row) -> str | None:
    """``"special_judge"`` or ``code.BAD_TESTS`` for a code row whose tests cannot be run
    (logged with the row's name), else None. Checked before scoring: tests of a shape no
    format has (``{"inputs": 1, "outputs": 2}``) raised a TypeError in the worker, which
    ended the audit with a traceback after its scoring."""
    try:
        code.parse_problem(row.reference)
    except code.SpecialJudgeError:
        return "special_judge"
    except Exception as exc:  # any shape of bad data: the row is reported, not the audit lost
        logger.warning("%s: unusable code tests, scored incorrect: %s", row.name, exc)
        return code.BAD_TESTS
    return None


def audit(
    rows: list[Row],
    config: RewardConfig,
    chunk: int = 64,
    progress: Callable[[int], None] | None = None,
) -> AuditResult:
    """Score every row with ``RewardPool(config)`` (in chunks of ``chunk`` rows; ``progress``
    is called with the number of rows done after each) and fill in its reward, status,
    seconds and extracted answer."""
    started = time.monotonic()
    with RewardPool(config) as pool:
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            todo = []
            for row in part:
                row.extracted = _extracted(row, config)
                unusable = _unusable_tests(row) if row.domain == "code" else None
                if unusable is not None:
                    row.reward, row.status = config.incorrect_reward, unusable
                else:
                    todo.append(row)
            if todo:
                rewards = pool.score_batch(
                    [r.response for r in todo],
                    [r.reference for r in todo],
                    [r.domain for r in todo],
                )
                for row, reward, status, seconds in zip(
                    todo, rewards, pool.last_statuses, pool.last_seconds
                ):
                    row.reward, row.status, row.seconds = reward, status, seconds
            if progress is not None:
                progress(len(part))
        stats = dict(pool.stats)
    return AuditResult(rows, time.monotonic() - started, stats)


def write_rows(path: str | Path, rows: Sequence[Row]) -> None:
    """The rows as JSONL (one ``Row.to_dict`` a line)."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row.to_dict(), ensure_ascii=False, default=str) + "\n")
