"""Prompt datasets: Polaris-53K, DeepCoder, local files and the synthetic task.

Records are read with the ``datasets`` library (hub name, or local jsonl / json / parquet /
arrow / csv files, or a ``save_to_disk`` directory) and turned into ``Prompt`` objects
whose ``prompt_id`` is the row index in the full dataset, before any split or filter, so
that ids stay valid across restarts (sampler and No-Positive-Resampling state).

The validation split holds ``val_size`` prompts drawn at random with ``split_seed``; any
training prompt whose (whitespace-normalised) problem text equals a validation problem is
removed too, so duplicated rows cannot leak validation problems into training.

A mixture (``data.sources``) loads each source in turn; ids continue from one source to the
next (the first source's rows first), every prompt records its source and domain, and each
source holds out its own validation split.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.config import (
    SYNTHETIC_CODE_SOURCE,
    SYNTHETIC_SOURCE,
    DataConfig,
    ResolvedSource,
)

logger = logging.getLogger(__name__)

_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class DataError(ValueError):
    """The prompt data cannot be used as given; the message names the file (and line, row or
    field). ``megatron-rl train`` reports it in one line, without a traceback."""


@dataclass(frozen=True)
class Prompt:
    """One prompt. Math prompts have ``answer``; code prompts have ``tests`` (the
    reference passed to ``megatron_rl.rewards``, ``{"tests": raw, "fn_name": name}``).
    ``domain`` ("math" / "code") picks the verifier; ``source`` indexes
    ``PromptData.sources`` (0 for a single-source run)."""

    prompt_id: int
    problem: str
    answer: str | None = None
    tests: dict[str, Any] | None = None
    solution: str | None = None
    domain: str = ""
    source: int = 0

    @property
    def kind(self) -> str:
        """Reward kind: the domain; without one, "code" when the prompt has tests, else
        "math"."""
        if self.domain:
            return self.domain
        return "code" if self.tests is not None else "math"

    @property
    def reference(self) -> Any:
        """What the verifier compares against: the answer or the tests."""
        return self.tests if self.tests is not None else self.answer


@dataclass
class PromptData:
    """All prompts (``prompts[i].prompt_id == i``) and the train / validation ids."""

    prompts: list[Prompt]
    train_ids: list[int]
    val_ids: list[int] = field(default_factory=list)
    sources: list[ResolvedSource] = field(default_factory=list)
    # Rows left out, by "unusable/<source>" (no answer / tests) and "too_long/<source>".
    dropped: dict[str, int] = field(default_factory=dict)

    def config_of(self, prompt_id: int) -> DataConfig:
        """The (single-source) data config of the prompt's source (rendering, SFT)."""
        return self.sources[self.prompts[prompt_id].source].config

    def train_by_source(self) -> list[tuple[ResolvedSource, list[int]]]:
        """Each source with its training ids, in source order (the sampler's mixture)."""
        return [
            (source, [i for i in self.train_ids if self.prompts[i].source == k])
            for k, source in enumerate(self.sources)
        ]

    def val_by_domain(self) -> dict[str, list[int]]:
        """Validation ids of each domain, in id order (domains in order of appearance)."""
        out: dict[str, list[int]] = {}
        for i in self.val_ids:
            out.setdefault(self.prompts[i].kind, []).append(i)
        return out

    def get(self, prompt_id: int) -> Prompt:
        """The prompt with this id."""
        return self.prompts[prompt_id]

    def train(self) -> list[Prompt]:
        """Training prompts in id order."""
        return [self.prompts[i] for i in self.train_ids]

    def validation(self) -> list[Prompt]:
        """Validation prompts in id order."""
        return [self.prompts[i] for i in self.val_ids]


def _load_local(path: Path, split: str, cache_dir: str | None) -> Any:
    import datasets

    if path.is_dir() and any((path / m).exists() for m in _SAVED_MARKERS):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{path} has splits {sorted(loaded)}, not hub_split={split!r}")
            return loaded[split]
        return loaded
    files = sorted(p for p in path.iterdir() if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise DataError(f"no data files ({', '.join(sorted(_BUILDERS))}) in {path}")
    builders = {_BUILDERS.get(p.suffix) for p in files}
    if None in builders or len(builders) != 1:
        raise DataError(f"cannot read {path}: expected files of one type among {sorted(_BUILDERS)}")
    for file in files:
        check_data_file(file)
    try:
        return datasets.load_dataset(
            builders.pop(), data_files=[str(p) for p in files], split="train", cache_dir=cache_dir
        )
    except Exception as exc:  # datasets wraps the reader's error without naming the file
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise DataError(f"cannot read {path}: {type(cause).__name__}: {cause}") from exc


def check_data_file(path: Path) -> None:
    """Raise DataError naming ``path`` (and the line) for an empty file, and for a text file
    (jsonl / json / csv) that is not UTF-8 or holds a line that is not a JSON object: the
    ``datasets`` library reports these as a bare ``StopIteration``, a decode error deep in
    pyarrow at the first read of the row, or "An error occurred while generating the
    dataset"."""
    text_format = path.suffix in (".jsonl", ".json", ".csv")
    if not text_format:  # parquet / arrow: a damaged file fails in pyarrow (_load_local)
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the file is empty (no rows)")
        return
    data = path.read_bytes()
    if not data.strip():
        raise DataError(f"{path}: the file is empty (no rows)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{path} line {line}: not UTF-8 text (byte {data[err.start]:#04x} at offset "
            f"{err.start}); re-encode the file as UTF-8"
        ) from None
    if path.suffix == ".csv":
        return
    if path.suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of rows
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {err.lineno}: invalid JSON ({err.msg})") from None
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if not rows or bad is not None:
            what = "an empty array" if not rows else f"item {bad} is not an object"
            raise DataError(f"{path}: expected an array of JSON objects ({what})")
        return
    # Lines end at "\n" only: str.splitlines() also splits at U+2028 and other separators
    # that JSON allows unescaped inside a string.
    for line_no, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {line_no}: invalid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(
                f"{path} line {line_no}: expected a JSON object per line, got {type(row).__name__}"
            )


def load_records(config: DataConfig) -> Any:
    """The raw rows (a ``datasets.Dataset``) named by ``config.source``."""
    import datasets

    cache_dir = config.cache_dir or None
    if config.source == SYNTHETIC_SOURCE:
        from megatron_rl.data.synthetic import write_synthetic_dataset

        path = write_synthetic_dataset(
            config.synthetic,
            cache_dir=config.cache_dir,
            think_start=config.think_start,
            think_end=config.think_end,
        )
        return _load_local(path, "train", cache_dir)
    if config.source == SYNTHETIC_CODE_SOURCE:
        from megatron_rl.data.synthetic_code import write_synthetic_code_dataset

        path = write_synthetic_code_dataset(
            config.synthetic_code,
            cache_dir=config.cache_dir,
            think_start=config.think_start,
            think_end=config.think_end,
        )
        return _load_local(path, "train", cache_dir)
    path = Path(config.source).expanduser()
    if path.exists():
        return _load_local(path, config.hub_split, cache_dir)
    if config.source.startswith((".", "/", "~")) or path.suffix in _BUILDERS:
        raise DataError(f"source {config.source!r} looks like a path but does not exist")
    try:
        return datasets.load_dataset(
            config.source,
            name=config.hub_subset or None,
            split=config.hub_split,
            cache_dir=cache_dir,
        )
    except Exception as exc:
        raise DataError(
            f"cannot load dataset {config.source!r} from the hub (offline? use a local file): {exc}"
        ) from exc


def _fn_name(row: dict[str, Any]) -> str | None:
    metadata = row.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except ValueError:
            metadata = None
    if isinstance(metadata, dict) and metadata.get("func_name"):
        return str(metadata["func_name"])
    return None


def _problem_text(row: dict[str, Any], field_name: str, config: DataConfig) -> str:
    value = row.get(field_name)
    problem = "" if _missing(value) else str(value)
    starter = row.get("starter_code") if config.format == "deepcoder" else None
    if problem.strip() and isinstance(starter, str) and starter.strip():
        problem += f"\n\nStart from this code:\n```python\n{starter.strip()}\n```"
    return problem


# Text that a null value becomes on its way through str() or a CSV / pandas export.
_NULL_TEXT = frozenset({"", "none", "null", "nan", "n/a"})
# A source whose unusable rows exceed this fraction is refused, not filtered: a wrong field
# mapping or a broken export, not a few bad rows (ScaleRL's Polaris-53K has none).
MAX_UNUSABLE_FRACTION = 0.5
_NAMED_ROWS = 5  # rows named in a warning or error


def _missing(value: Any) -> bool:
    """A null: None, NaN (a parquet / pandas null), or an empty container."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, (list, dict, tuple)) and not value


def _answer_text(value: Any) -> str | None:
    """The reference answer of a math row; None when the row has none."""
    return None if _missing(value) else str(value)


def build_prompts(
    rows: Any, config: DataConfig, first_id: int = 0, source: int = 0
) -> list[Prompt]:
    """``Prompt`` objects from raw rows (``datasets.Dataset`` or list of dicts), numbered
    from ``first_id``, of source index ``source`` and domain ``config.effective_domain()``.

    Every row becomes a prompt (ids are row indices); a null or missing answer stays None
    (never the text "None"). ``unusable_rows`` says which prompts must not be used."""
    problem_field, answer_field, tests_field = config.fields()
    columns = list(rows.column_names) if hasattr(rows, "column_names") else None
    if columns is not None:
        for name in (problem_field, answer_field, tests_field):
            if name and name not in columns:
                raise DataError(
                    f"field {name!r} is not in the dataset {config.source!r} (fields: "
                    f"{columns}); set data.format or the data.*_field keys"
                )
    domain = config.effective_domain()
    if domain == "code" and not tests_field:
        raise DataError(f"source {config.source!r} has domain 'code' but no tests field")
    if domain != "code" and not answer_field:
        raise DataError(f"source {config.source!r} has domain {domain!r} but no answer field")
    prompts = []
    for i, row in enumerate(rows):
        if domain == "code":
            reference = {"tests": row.get(tests_field), "fn_name": _fn_name(row)}
            if row.get("special_judge"):  # a row-level flag: carried for reject_unusable
                reference["special_judge"] = True
            answer, tests = None, reference
        else:
            answer, tests = _answer_text(row.get(answer_field)), None
        solution = row.get(config.solution_field) if config.solution_field else None
        prompts.append(
            Prompt(
                prompt_id=first_id + i,
                problem=_problem_text(row, problem_field, config),
                answer=answer,
                tests=tests,
                solution=None if _missing(solution) else str(solution),
                domain=domain,
                source=source,
            )
        )
    return prompts


def drop_special_judge(prompts: list[Prompt], config: DataConfig) -> list[Prompt]:
    """The prompts of one source without code problems that need a special judge (several
    valid outputs: comparing outputs would score right answers wrong), with a warning and a
    count; they are not "unusable" rows (a contest set may hold many)."""
    from megatron_rl.rewards.code import needs_special_judge

    kept = [p for p in prompts if p.kind != "code" or not needs_special_judge(p.tests)]
    if len(kept) < len(prompts):
        logger.warning(
            "source %r: dropped %d code problems that need a special judge (their tests "
            "cannot be scored by comparing outputs)",
            config.source,
            len(prompts) - len(kept),
        )
    return kept


def _unusable(prompt: Prompt) -> str | None:
    """Why ``prompt`` cannot be scored (None: it can)."""
    if not prompt.problem.strip() or prompt.problem.strip().lower() in _NULL_TEXT:
        return "no problem text"
    if prompt.kind == "code":
        from megatron_rl.rewards.code import parse_tests

        raw = (prompt.tests or {}).get("tests")
        if _missing(raw) or (isinstance(raw, str) and raw.strip().lower() in _NULL_TEXT):
            return "no tests"
        try:  # the verifier's own parser: tests it cannot read could never pass
            parse_tests(prompt.tests)
        except Exception as exc:  # noqa: BLE001 - any failure means unusable tests
            return f"unusable tests ({type(exc).__name__}: {str(exc)[:80]})"
        return None
    if prompt.answer is None:
        return "no answer (null or missing)"
    if prompt.answer.strip().lower() in _NULL_TEXT:
        return f"no answer ({prompt.answer!r})"
    return None


def unusable_rows(prompts: list[Prompt]) -> dict[int, str]:
    """Prompt id -> why the row cannot be scored: no problem text; math: a null, missing,
    empty or "None"-like answer (scored, ``\\boxed{None}`` would earn the full reward);
    code: no tests, or tests the code verifier cannot parse."""
    return {p.prompt_id: why for p in prompts if (why := _unusable(p)) is not None}


def reject_unusable(prompts: list[Prompt], config: DataConfig) -> list[Prompt]:
    """The usable prompts of one source. A few unusable rows are dropped with a warning
    naming the first ones; more than ``MAX_UNUSABLE_FRACTION`` of the rows (a wrong field
    or a broken file) is a DataError naming the field and the source."""
    bad = unusable_rows(prompts)
    if not bad:
        return prompts
    first = prompts[0].prompt_id
    named = ", ".join(f"row {i - first}: {why}" for i, why in list(bad.items())[:_NAMED_ROWS])
    more = f", and {len(bad) - _NAMED_ROWS} more" if len(bad) > _NAMED_ROWS else ""
    problem_field, answer_field, tests_field = config.fields()
    field_name = tests_field if prompts[0].kind == "code" else answer_field
    if len(bad) > MAX_UNUSABLE_FRACTION * len(prompts):
        raise DataError(
            f"{config.source}: {len(bad)} of {len(prompts)} rows cannot be scored (field "
            f"{field_name!r} / {problem_field!r}; rows counted from 0): {named}{more}; "
            "check data.format and the data.*_field keys, or clean the file"
        )
    logger.warning(
        "%s: dropped %d of %d rows that cannot be scored (field %r; rows counted from 0): %s%s",
        config.source,
        len(bad),
        len(prompts),
        field_name,
        named,
        more,
    )
    return [p for p in prompts if p.prompt_id not in bad]


def _normalise(text: str) -> str:
    return " ".join(text.split())


def split_ids(prompts: list[Prompt], val_size: int, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, validation ids): ``val_size`` random prompts for validation (by
    ``seed``), and no training prompt whose problem text equals a validation one."""
    if val_size >= len(prompts) and val_size > 0:
        raise DataError(f"val_size={val_size} leaves no training prompts out of {len(prompts)}")
    ids = [p.prompt_id for p in prompts]
    by_id = {p.prompt_id: p for p in prompts}
    val_ids = sorted(random.Random(f"val-split-{seed}").sample(ids, val_size))
    chosen = set(val_ids)
    val_problems = {_normalise(by_id[i].problem) for i in val_ids}
    train_ids = [
        i for i in ids if i not in chosen and _normalise(by_id[i].problem) not in val_problems
    ]
    dropped = len(ids) - len(val_ids) - len(train_ids)
    if dropped:
        logger.info("removed %d training prompts that duplicate validation problems", dropped)
    if not train_ids:
        raise DataError("no training prompts left after the validation split")
    return train_ids, val_ids


def load_prompt_data(
    config: DataConfig,
    tokenizer: Any = None,
    max_tokens: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> PromptData:
    """Load, check, split and length-filter the prompts of every source; each source is
    split on its own.

    Rows that cannot be scored are dropped before the split (``reject_unusable``). With a
    tokenizer, prompts longer than the tighter of ``config.max_prompt_tokens`` (0: none) and
    ``max_tokens`` (what the run can take: ``megatron_rl.config.checks.prompt_token_limit``)
    are dropped, counted as the run renders them (``template_kwargs``: the chat template's
    arguments, a tool offered in multi-turn episodes). ``PromptData.dropped`` counts both, by
    source."""
    config.validate()
    sources = config.resolve()
    prompts: list[Prompt] = []
    train_ids: list[int] = []
    val_ids: list[int] = []
    dropped: dict[str, int] = {}
    for index, source in enumerate(sources):
        part = build_prompts(load_records(source.config), source.config, len(prompts), index)
        if not part:
            raise DataError(f"dataset {source.config.source!r} is empty")
        judged = drop_special_judge(part, source.config)
        usable = reject_unusable(judged, source.config) if judged else judged
        first = part[0].prompt_id  # rows are named from the source's first row
        train, val, too_long = _load_split(
            usable, source.config, tokenizer, max_tokens, first, template_kwargs
        )
        if len(judged) < len(part):
            dropped[f"special_judge/{source.name}"] = len(part) - len(judged)
        dropped[f"unusable/{source.name}"] = len(judged) - len(usable)
        dropped[f"too_long/{source.name}"] = too_long
        prompts += part
        train_ids += train
        val_ids += val
        if len(sources) > 1:
            logger.info(
                "source %s (%s, weight %g): %d train, %d validation",
                source.name,
                source.domain,
                source.weight,
                len(train),
                len(val),
            )
    logger.info("prompts: %d train, %d validation", len(train_ids), len(val_ids))
    return PromptData(prompts, train_ids, val_ids, sources, dropped)


def _load_split(
    prompts: list[Prompt],
    config: DataConfig,
    tokenizer: Any,
    max_tokens: int | None,
    first: int,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int], int]:
    """(train ids, validation ids, prompts dropped as too long) of one source's prompts."""
    train_ids, val_ids = split_ids(prompts, config.val_size, config.split_seed)
    limits = [n for n in (config.max_prompt_tokens, max_tokens) if n is not None and n > 0]
    if max_tokens == 0:
        limits.append(0)  # no room for any prompt: the error below says so
    if not limits:
        return train_ids, val_ids, 0
    limit = min(limits)
    if tokenizer is None:
        raise ValueError("a prompt length limit (max_prompt_tokens) needs a tokenizer")
    from megatron_rl.data.rendering import prompt_token_count

    by_id = {p.prompt_id: p for p in prompts}
    lengths = {
        i: prompt_token_count(by_id[i].problem, config, tokenizer, template_kwargs)
        for i in train_ids + val_ids
    }
    too_long = sorted(i for i, n in lengths.items() if n > limit)
    if config.max_prompt_tokens and limit == config.max_prompt_tokens:
        why, log = f"data.max_prompt_tokens={limit}", logger.info
    else:  # the recipe cannot take them: an over-long row must not stop the run at its step
        why, log = f"the run's limit of {limit} tokens (see prompt_token_limit)", logger.warning
    if too_long:
        named = ", ".join(f"row {i - first} ({lengths[i]} tokens)" for i in too_long[:5])
        log("%s: dropped %d prompts longer than %s: %s", config.source, len(too_long), why, named)
    dropped = set(too_long)
    train_ids = [i for i in train_ids if i not in dropped]
    val_ids = [i for i in val_ids if i not in dropped]
    if not train_ids:
        raise DataError(f"no training prompt of {config.source!r} fits {why}")
    return train_ids, val_ids, len(too_long)
