"""Recipe-facing configuration of the prompt data (imports no torch).

Defaults follow ScaleRL (docs/paper.md sections 1-3): 1,000 prompts held out at random by seed
for validation, Polaris-53K fields (problem, answer), thinking as ``<think> ... </think>``
followed by the answer, No-Positive-Resampling handled by the sampler, no dynamic sampling
(zero-variance groups are filtered by the algorithm, not refilled).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rl.config.errors import ConfigError

DATA_FORMATS: tuple[str, ...] = ("polaris", "deepcoder", "custom")
SYNTHETIC_OPERATIONS: tuple[str, ...] = ("add", "sub", "mul")
SYNTHETIC_SOLUTIONS: tuple[str, ...] = ("scratchpad", "tool")
SYNTHETIC_SOURCE = "synthetic"
SYNTHETIC_CODE_SOURCE = "synthetic_code"
SYNTHETIC_CODE_TEMPLATES: tuple[str, ...] = ("sum", "diff", "max", "min", "prod")
# A prompt's domain picks its verifier (the reward kinds of megatron_rl.rewards).
DOMAINS: tuple[str, ...] = ("math", "code")


def domains() -> list[str]:
    """The domains a source may name: the built-in verifiers and the installed reward
    plug-ins (``megatron_rl.rewards.registry``: a domain of that name is scored by it)."""
    from megatron_rl.rewards.registry import kinds

    return kinds()


# Default field names of each format: (problem, answer, tests).
FORMAT_FIELDS: dict[str, tuple[str, str, str]] = {
    "polaris": ("problem", "answer", ""),
    "deepcoder": ("problem", "", "tests"),
}


@dataclass
class SyntheticConfig:
    """The synthetic arithmetic task (``DataConfig.source: synthetic``).

    Attributes:
        operations: operations to draw from, a subset of SYNTHETIC_OPERATIONS.
        min_digits: fewest digits of an operand (difficulty floor).
        max_digits: most digits of an operand (difficulty ceiling).
        num_problems: distinct problems generated (capped by how many exist).
        seed: generator seed; the same settings always write the same file.
        solution: the worked solutions' style (the warm start's traces): "scratchpad"
            (column arithmetic in the thinking section) or "tool" (the thinking section
            asks a Python tool, ToRA's fenced ```python block then its ```output block,
            and the answer copies the output: multi-turn episodes with ``python_tool`` and
            the markdown tool format, ``recipes/tiny_cpu_tool.yaml``).
    """

    operations: tuple[str, ...] = ("add",)
    min_digits: int = 1
    max_digits: int = 2
    num_problems: int = 5000
    seed: int = 0
    solution: str = "scratchpad"

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        ops = tuple(self.operations)
        if not ops or any(op not in SYNTHETIC_OPERATIONS for op in ops):
            raise ConfigError(
                "operations",
                f"must be a non-empty subset of {list(SYNTHETIC_OPERATIONS)}, got "
                f"{self.operations!r}",
            )
        for name in ("min_digits", "max_digits", "num_problems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")
        if self.max_digits < self.min_digits:
            raise ConfigError(
                "max_digits", f"{self.max_digits} must be >= min_digits ({self.min_digits})"
            )
        if self.max_digits > 18:
            raise ConfigError("max_digits", f"must be <= 18, got {self.max_digits}")
        if not isinstance(self.seed, int):
            raise ConfigError("seed", f"must be an int, got {self.seed!r}")
        if self.solution not in SYNTHETIC_SOLUTIONS:
            raise ConfigError(
                "solution", f"must be one of {list(SYNTHETIC_SOLUTIONS)}, got {self.solution!r}"
            )


@dataclass
class SyntheticCodeConfig:
    """The synthetic code task (``source: synthetic_code``): read two ints from stdin, print
    an expression of them (``max(a,b)+7``), checked by stdin/stdout tests.

    Attributes:
        templates: expression templates to draw from, a subset of SYNTHETIC_CODE_TEMPLATES
            (sum ``a+b+k``, diff ``a-b+k``, max ``max(a,b)+k``, min ``min(a,b)+k``,
            prod ``a*b+k``).
        max_constant: the constant ``k`` is drawn from [0, max_constant].
        max_operand: test inputs ``a`` and ``b`` are drawn from [0, max_operand].
        num_tests: stdin/stdout tests per problem.
        num_problems: distinct problems generated (capped by how many exist).
        seed: generator seed; the same settings always write the same file.
    """

    templates: tuple[str, ...] = SYNTHETIC_CODE_TEMPLATES
    max_constant: int = 99
    max_operand: int = 99
    num_tests: int = 3
    num_problems: int = 500
    seed: int = 0

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        templates = tuple(self.templates)
        if not templates or any(t not in SYNTHETIC_CODE_TEMPLATES for t in templates):
            raise ConfigError(
                "templates",
                f"must be a non-empty subset of {list(SYNTHETIC_CODE_TEMPLATES)}, got "
                f"{self.templates!r}",
            )
        for name, low in (("max_constant", 0), ("max_operand", 1), ("num_tests", 1),
                          ("num_problems", 1)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(name, f"must be an int >= {low}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("seed", f"must be an int, got {self.seed!r}")


@dataclass
class DataSourceConfig:
    """One prompt source of a mixture (``data.sources``); unset fields follow ``data``.

    Attributes:
        source: as ``data.source`` (hub name, local file or directory, "synthetic",
            "synthetic_code").
        name: name of the source in logs and errors; empty: the domain.
        domain: "math", "code" or an installed reward plug-in's name: the verifier of its
            prompts and the suffix of its validation metrics (``val_pass_rate/<domain>``);
            empty: "code" when the format has tests (deepcoder), else "math".
        weight: mixing weight; a source gets ``weight / sum(weights)`` of the drawn prompts.
        format, hub_subset, hub_split, problem_field, answer_field, tests_field,
            solution_field, prompt_template: as in ``data``; empty: ``data``'s value
            (``format`` defaults to "deepcoder" for the synthetic code task).
        val_size: held-out validation prompts of this source; null: ``data.val_size``
            (ScaleRL math+code: 1,000 of each).
        synthetic / synthetic_code: settings of the synthetic tasks.
    """

    source: str = ""
    name: str = ""
    domain: str = ""
    weight: float = 1.0
    format: str = ""
    hub_subset: str = ""
    hub_split: str = ""
    problem_field: str = ""
    answer_field: str = ""
    tests_field: str = ""
    solution_field: str = ""
    prompt_template: str = ""
    val_size: int | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    synthetic_code: SyntheticCodeConfig = field(default_factory=SyntheticCodeConfig)


@dataclass(frozen=True)
class ResolvedSource:
    """A source of the mixture with every setting filled in (``DataConfig.resolve()``)."""

    name: str
    domain: str
    weight: float
    config: DataConfig  # a single-source DataConfig (``sources`` empty)


@dataclass
class DataConfig:
    """Where prompts come from, how they are split, rendered and sampled.

    Attributes:
        source: a dataset name on the hub, a local file (.jsonl / .json / .parquet / .arrow)
            or directory (``save_to_disk`` output or data files), or "synthetic".
        format: "polaris" (problem, answer), "deepcoder" (problem, tests) or "custom"
            (set the field names below).
        problem_field / answer_field / tests_field: field names overriding the format's.
        solution_field: optional field with a worked solution (SFT warm-start targets).
        hub_subset: dataset configuration name on the hub (e.g. DeepCoder "lcbv5").
        hub_split: split to load (hub datasets and local files alike).
        cache_dir: where generated synthetic data is written; empty: a temp directory.
        val_size: held-out validation prompts (ScaleRL: 1,000); 0 disables validation.
        split_seed: seed of the validation split.
        shuffle: shuffle training prompts each epoch.
        sampler_seed: seed of the per-epoch shuffle.
        use_chat_template: render prompts with the tokenizer's chat template when it has
            one, tokenized as ``apply_chat_template(tokenize=True)`` does (the template
            writes the BOS: Llama's one ``<|begin_of_text|>``); otherwise (or False)
            ``prompt_template`` alone is used, with the tokenizer's BOS. ``train --dry-run``
            prints the first prompt's text and token ids.
        prompt_template: text of the user turn; ``{problem}`` is replaced by the problem.
        system_prompt: optional system turn (chat template only).
        think_start: opening tag of the thinking section.
        think_end: closing tag; the answer follows it.
        prefill_think: append ``think_start`` to the rendered prompt so the model starts
            inside its thinking (skipped when the chat template already ends with it).
        max_prompt_tokens: drop prompts longer than this after rendering (0: keep all).
        dynamic_sampling: DAPO dynamic sampling (Yu et al. 2025, section 3.2): every group is
            scored as it completes; one whose rewards are all equal is dropped (its rewards
            still enter the No-Positive-Resampling history) and a new prompt is drawn in its
            place, until the batch holds ``batch.prompts_per_step`` groups with reward
            variance. Works in both off-policy modes without loosening the lag bound (see
            ``megatron_rl.trainer.rollout_source``). Metrics per step: ``prompts_drawn``,
            ``groups_kept``, ``groups_dropped``, ``groups_kept_over_cap``.
        dynamic_sampling_max_rounds: the cap R: at most R x B prompts are drawn for one batch
            of B groups (PPO-off-policy-k: R x k x B for the k batches of one generation),
            i.e. at most (R - 1) x B groups are dropped; past it, zero-variance groups are
            kept (``algorithm.zero_variance_filter`` then gives them no loss) where DAPO's
            ``max_num_gen_batches`` stops the run. R = 1: no refill.
        synthetic: settings of the synthetic arithmetic task.
        synthetic_code: settings of the synthetic code task (``source: synthetic_code``).
        domain: domain of the single source ("math" / "code"); empty: by the format.
        sources: a mixture of several sources (math + code runs), each with a mixing weight
            and its own validation split; empty: the single source described above. Set
            here, the per-source keys above are defaults of every entry.
    """

    source: str = SYNTHETIC_SOURCE
    format: str = "polaris"
    problem_field: str = ""
    answer_field: str = ""
    tests_field: str = ""
    solution_field: str = "solution"
    hub_subset: str = ""
    hub_split: str = "train"
    cache_dir: str = ""
    val_size: int = 1000
    split_seed: int = 0
    shuffle: bool = True
    sampler_seed: int = 0
    use_chat_template: bool = True
    prompt_template: str = "{problem}"
    system_prompt: str = ""
    think_start: str = "<think>"
    think_end: str = "</think>"
    prefill_think: bool = False
    max_prompt_tokens: int = 0
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 8
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    synthetic_code: SyntheticCodeConfig = field(default_factory=SyntheticCodeConfig)
    domain: str = ""
    sources: list[DataSourceConfig] = field(default_factory=list)

    def fields(self) -> tuple[str, str, str]:
        """Effective (problem, answer, tests) field names; "" where the format has none."""
        problem, answer, tests = FORMAT_FIELDS.get(self.format, ("", "", ""))
        return (
            self.problem_field or problem,
            self.answer_field or answer,
            self.tests_field or tests,
        )

    def effective_domain(self) -> str:
        """This (single-source) config's domain: ``domain``, else "code" when the format
        has tests, else "math"."""
        if self.domain:
            return self.domain
        problem, answer, tests = self.fields()
        return "code" if tests else "math"

    def resolve(self) -> list[ResolvedSource]:
        """The sources of the run, in order: ``sources`` with unset fields taken from this
        config, or this config itself as the only source (weight 1)."""
        if not self.sources:
            return [ResolvedSource(self.effective_domain(), self.effective_domain(), 1.0, self)]
        resolved = []
        for entry in self.sources:
            synthetic_code = entry.source == SYNTHETIC_CODE_SOURCE
            changes = {
                "source": entry.source,
                "format": entry.format or ("deepcoder" if synthetic_code else self.format),
                "val_size": self.val_size if entry.val_size is None else entry.val_size,
                "synthetic": entry.synthetic,
                "synthetic_code": entry.synthetic_code,
                "domain": entry.domain,
                "sources": [],
            }
            for name in ("hub_subset", "hub_split", "problem_field", "answer_field",
                         "tests_field", "solution_field", "prompt_template"):  # fmt: skip
                changes[name] = getattr(entry, name) or getattr(self, name)
            if entry.format and not entry.problem_field:  # the entry's format names its fields
                for name in ("problem_field", "answer_field", "tests_field"):
                    changes[name] = getattr(entry, name)
            config = dataclasses.replace(self, **changes)
            domain = config.effective_domain()
            resolved.append(ResolvedSource(entry.name or domain, domain, entry.weight, config))
        return resolved

    def val_sizes(self) -> dict[str, int]:
        """Held-out prompts of each source, by source name."""
        return {s.name: s.config.val_size for s in self.resolve()}

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        if self.sources:
            self._validate_sources()
        self._validate_single()

    def _validate_sources(self) -> None:
        names = set()
        for i, entry in enumerate(self.sources):
            if not isinstance(entry.source, str) or not entry.source:
                raise ConfigError(f"sources[{i}].source", "must be a non-empty string")
            weight = entry.weight
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not (0 < weight < float("inf"))
            ):
                raise ConfigError(f"sources[{i}].weight", f"must be a number > 0, got {weight!r}")
            if entry.val_size is not None and (
                isinstance(entry.val_size, bool)
                or not isinstance(entry.val_size, int)
                or entry.val_size < 0
            ):
                raise ConfigError(f"sources[{i}].val_size", "must be an int >= 0 or null")
            if entry.domain and entry.domain not in domains():
                raise ConfigError(
                    f"sources[{i}].domain",
                    f"must be one of {domains()}, got {entry.domain!r}",
                )
        for i, source in enumerate(self.resolve()):
            try:
                source.config._validate_single()
            except ConfigError as err:
                raise err.within(f"sources[{i}]") from None
            if source.name in names:
                raise ConfigError(
                    f"sources[{i}].name", f"{source.name!r} is used twice (name the sources)"
                )
            names.add(source.name)

    def _validate_single(self) -> None:
        if self.domain and self.domain not in domains():
            raise ConfigError("domain", f"must be one of {domains()}, got {self.domain!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError("source", f"must be a non-empty string, got {self.source!r}")
        if self.format not in DATA_FORMATS:
            raise ConfigError("format", f"must be one of {list(DATA_FORMATS)}, got {self.format!r}")
        problem, answer, tests = self.fields()
        if not problem:
            raise ConfigError("problem_field", "must be set when format is 'custom'")
        if not answer and not tests:
            raise ConfigError("answer_field", "format 'custom' needs answer_field or tests_field")
        for name in ("val_size", "max_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, f"must be an int >= 0, got {value!r}")
        rounds = self.dynamic_sampling_max_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ConfigError(
                "dynamic_sampling_max_rounds",
                f"must be an int >= 1, got {self.dynamic_sampling_max_rounds!r}",
            )
        for name in ("shuffle", "use_chat_template", "prefill_think", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        for name in ("split_seed", "sampler_seed"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ConfigError(name, f"must be an int, got {getattr(self, name)!r}")
        if "{problem}" not in self.prompt_template:
            raise ConfigError(
                "prompt_template", f"must contain '{{problem}}', got {self.prompt_template!r}"
            )
        if not self.think_start or not self.think_end:
            raise ConfigError("think_start", "think_start and think_end must be non-empty")
        for name in ("synthetic", "synthetic_code"):
            try:
                getattr(self, name).validate()
            except ConfigError as err:
                raise err.within(name) from None
