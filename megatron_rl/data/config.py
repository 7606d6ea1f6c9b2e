"""Recipe-facing configuration of the prompt data (imports no torch).

Defaults follow ScaleRL (SCALERL.md sections 1-3): 1,000 prompts held out at random by seed
for validation, Polaris-53K fields (problem, answer), thinking as ``<think> ... </think>``
followed by the answer, No-Positive-Resampling handled by the sampler, no dynamic sampling
(zero-variance groups are filtered by the algorithm, not refilled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DATA_FORMATS: tuple[str, ...] = ("polaris", "deepcoder", "custom")
SYNTHETIC_OPERATIONS: tuple[str, ...] = ("add", "sub", "mul")
SYNTHETIC_SOURCE = "synthetic"

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
    """

    operations: tuple[str, ...] = ("add",)
    min_digits: int = 1
    max_digits: int = 2
    num_problems: int = 5000
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        ops = tuple(self.operations)
        if not ops or any(op not in SYNTHETIC_OPERATIONS for op in ops):
            raise ValueError(
                f"synthetic.operations must be a non-empty subset of {list(SYNTHETIC_OPERATIONS)},"
                f" got {self.operations!r}"
            )
        for name in ("min_digits", "max_digits", "num_problems"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"synthetic.{name} must be an int >= 1, got {value!r}")
        if self.max_digits < self.min_digits:
            raise ValueError(
                f"synthetic.max_digits ({self.max_digits}) must be >= synthetic.min_digits "
                f"({self.min_digits})"
            )
        if self.max_digits > 18:
            raise ValueError(f"synthetic.max_digits must be <= 18, got {self.max_digits}")
        if not isinstance(self.seed, int):
            raise ValueError(f"synthetic.seed must be an int, got {self.seed!r}")


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
            one; otherwise (or False) ``prompt_template`` alone is used.
        prompt_template: text of the user turn; ``{problem}`` is replaced by the problem.
        system_prompt: optional system turn (chat template only).
        think_start: opening tag of the thinking section.
        think_end: closing tag; the answer follows it.
        prefill_think: append ``think_start`` to the rendered prompt so the model starts
            inside its thinking (skipped when the chat template already ends with it).
        max_prompt_tokens: drop prompts longer than this after rendering (0: keep all).
        dynamic_sampling: DAPO-style refill: keep drawing prompts until the batch holds
            enough groups with non-zero reward variance (``sampler.refill_until``).
        dynamic_sampling_max_rounds: most draws per batch before giving up with fewer.
        synthetic: settings of the synthetic arithmetic task.
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

    def fields(self) -> tuple[str, str, str]:
        """Effective (problem, answer, tests) field names; "" where the format has none."""
        problem, answer, tests = FORMAT_FIELDS.get(self.format, ("", "", ""))
        return (
            self.problem_field or problem,
            self.answer_field or answer,
            self.tests_field or tests,
        )

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be a non-empty string, got {self.source!r}")
        if self.format not in DATA_FORMATS:
            raise ValueError(f"format must be one of {list(DATA_FORMATS)}, got {self.format!r}")
        problem, answer, tests = self.fields()
        if not problem:
            raise ValueError("problem_field must be set when format is 'custom'")
        if not answer and not tests:
            raise ValueError("format 'custom' needs answer_field or tests_field")
        for name in ("val_size", "max_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.dynamic_sampling_max_rounds, int) or (
            self.dynamic_sampling_max_rounds < 1
        ):
            raise ValueError(
                "dynamic_sampling_max_rounds must be an int >= 1, got "
                f"{self.dynamic_sampling_max_rounds!r}"
            )
        for name in ("shuffle", "use_chat_template", "prefill_think", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("split_seed", "sampler_seed"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        if "{problem}" not in self.prompt_template:
            raise ValueError(
                f"prompt_template must contain '{{problem}}', got {self.prompt_template!r}"
            )
        if not self.think_start or not self.think_end:
            raise ValueError("think_start and think_end must be non-empty")
        self.synthetic.validate()
