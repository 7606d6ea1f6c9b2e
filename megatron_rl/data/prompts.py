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
                raise ValueError(f"{path} has splits {sorted(loaded)}, not hub_split={split!r}")
            return loaded[split]
        return loaded
    files = sorted(p for p in path.iterdir() if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"no data files ({', '.join(sorted(_BUILDERS))}) in {path}")
    builders = {_BUILDERS.get(p.suffix) for p in files}
    if None in builders or len(builders) != 1:
        raise ValueError(
            f"cannot read {path}: expected files of one type among {sorted(_BUILDERS)}"
        )
    return datasets.load_dataset(
        builders.pop(), data_files=[str(p) for p in files], split="train", cache_dir=cache_dir
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
        raise ValueError(f"source {config.source!r} looks like a path but does not exist")
    try:
        return datasets.load_dataset(
            config.source,
            name=config.hub_subset or None,
            split=config.hub_split,
            cache_dir=cache_dir,
        )
    except Exception as exc:
        raise ValueError(
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
    problem = str(row[field_name])
    starter = row.get("starter_code") if config.format == "deepcoder" else None
    if isinstance(starter, str) and starter.strip():
        problem += f"\n\nStart from this code:\n```python\n{starter.strip()}\n```"
    return problem


def build_prompts(
    rows: Any, config: DataConfig, first_id: int = 0, source: int = 0
) -> list[Prompt]:
    """``Prompt`` objects from raw rows (``datasets.Dataset`` or list of dicts), numbered
    from ``first_id``, of source index ``source`` and domain ``config.effective_domain()``."""
    problem_field, answer_field, tests_field = config.fields()
    columns = list(rows.column_names) if hasattr(rows, "column_names") else None
    if columns is not None:
        for name in (problem_field, answer_field, tests_field):
            if name and name not in columns:
                raise ValueError(f"field {name!r} is not in the dataset (fields: {columns})")
    domain = config.effective_domain()
    if domain == "code" and not tests_field:
        raise ValueError(f"source {config.source!r} has domain 'code' but no tests field")
    if domain == "math" and not answer_field:
        raise ValueError(f"source {config.source!r} has domain 'math' but no answer field")
    prompts = []
    special_judge = 0
    for row in rows:
        if domain == "code":
            reference = {"tests": row[tests_field], "fn_name": _fn_name(row)}
            if _needs_special_judge(row, reference):
                special_judge += 1  # several valid outputs: comparison would score them wrong
                continue
            answer, tests = None, reference
        else:
            answer, tests = str(row[answer_field]), None
        solution = row.get(config.solution_field) if config.solution_field else None
        prompts.append(
            Prompt(
                prompt_id=first_id + len(prompts),
                problem=_problem_text(row, problem_field, config),
                answer=answer,
                tests=tests,
                solution=str(solution) if solution is not None else None,
                domain=domain,
                source=source,
            )
        )
    if special_judge:
        logger.warning(
            "source %r: dropped %d code problems that need a special judge (their tests "
            "cannot be scored by comparing outputs)",
            config.source,
            special_judge,
        )
    return prompts


def _needs_special_judge(row: dict[str, Any], reference: dict[str, Any]) -> bool:
    from megatron_rl.rewards.code import needs_special_judge

    return bool(row.get("special_judge")) or needs_special_judge(reference)


def _normalise(text: str) -> str:
    return " ".join(text.split())


def split_ids(prompts: list[Prompt], val_size: int, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, validation ids): ``val_size`` random prompts for validation (by
    ``seed``), and no training prompt whose problem text equals a validation one."""
    if val_size >= len(prompts) and val_size > 0:
        raise ValueError(f"val_size={val_size} leaves no training prompts out of {len(prompts)}")
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
        raise ValueError("no training prompts left after the validation split")
    return train_ids, val_ids


def load_prompt_data(config: DataConfig, tokenizer: Any = None) -> PromptData:
    """Load, split and (with ``max_prompt_tokens`` and a tokenizer) length-filter the
    prompts of every source; each source is split on its own."""
    config.validate()
    sources = config.resolve()
    prompts: list[Prompt] = []
    train_ids: list[int] = []
    val_ids: list[int] = []
    for index, source in enumerate(sources):
        part = build_prompts(load_records(source.config), source.config, len(prompts), index)
        if not part:
            raise ValueError(f"dataset {source.config.source!r} is empty")
        train, val = _load_split(part, source.config, tokenizer)
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
    return PromptData(prompts, train_ids, val_ids, sources)


def _load_split(
    prompts: list[Prompt], config: DataConfig, tokenizer: Any
) -> tuple[list[int], list[int]]:
    """(train ids, validation ids) of one source's prompts, length-filtered."""
    train_ids, val_ids = split_ids(prompts, config.val_size, config.split_seed)
    by_id = {p.prompt_id: p for p in prompts}
    if config.max_prompt_tokens:
        if tokenizer is None:
            raise ValueError("max_prompt_tokens needs a tokenizer")
        from megatron_rl.data.rendering import prompt_token_count

        def fits(i: int) -> bool:
            return (
                prompt_token_count(by_id[i].problem, config, tokenizer) <= config.max_prompt_tokens
            )

        kept_train, kept_val = [i for i in train_ids if fits(i)], [i for i in val_ids if fits(i)]
        logger.info(
            "max_prompt_tokens=%d dropped %d training and %d validation prompts",
            config.max_prompt_tokens,
            len(train_ids) - len(kept_train),
            len(val_ids) - len(kept_val),
        )
        train_ids, val_ids = kept_train, kept_val
        if not train_ids:
            raise ValueError(
                f"no training prompt of {config.source!r} fits "
                f"max_prompt_tokens={config.max_prompt_tokens}"
            )
    return train_ids, val_ids
