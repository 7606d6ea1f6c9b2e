"""The run config: one typed tree for a whole RL run, mirrored by the YAML recipes.

``RunConfig`` gathers the component configs (model, parallel, algorithm, data, reward,
rollout; each defined next to its code) and the run-level sections of
:mod:`megatron_rl.config.sections` (optimizer, batch, off-policy mode, validation,
checkpoints, budget, warm start, logging, Slurm cluster) and the live forecast
(:mod:`megatron_rl.scaling.config`).
Field defaults are the ScaleRL 8B run (docs/paper.md sections 2-3) wherever the paper gives a
value; where it is silent the default is documented as ours.

``RunConfig.validate()`` checks combinations across sections (pure, no I/O); the checks that
need the model's shapes live in :mod:`megatron_rl.config.checks`. ``load_run_config`` runs
both. Importing it loads no torch, transformers, scipy or numpy (the packages' ``__init__``
files load their heavy modules on first use; ``tests/unit/config/test_config_errors.py`` guards it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.config.loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    read_recipe,
    to_dict,
)
from megatron_rl.config.sections import (
    BatchConfig,
    CheckpointConfig,
    ClusterConfig,
    LoggingConfig,
    OffPolicyConfig,
    OptimizerConfig,
    TrainingConfig,
    ValidationConfig,
    WarmStartConfig,
)
from megatron_rl.data.config import DataConfig
from megatron_rl.models.config import ModelConfig
from megatron_rl.platform.config import ParallelConfig
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.scaling.config import ForecastConfig

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Keys that two sections share: when a recipe sets only one of a pair, the other follows it.
LINKED_KEYS: tuple[tuple[str, str], ...] = (
    ("batch.samples_per_prompt", "rollout.samples_per_prompt"),
    ("model.fp32_head", "rollout.fp32_head"),
)


def _fail(key: str, message: str) -> None:
    raise ConfigError(key, message)


@dataclass
class RunConfig:
    """Everything one RL run needs; the root of every recipe.

    ``name`` defaults to the recipe file's stem (``load_run_config``) and names the default
    run directory ``runs/<name>``.
    """

    # The run's name (default: the recipe file's stem); the default run directory is runs/<name>.
    name: str = ""
    seed: int = 1234  # seeds sampling, data order and initialisation
    # `megatron-rl launch` jobs run `megatron-rl preflight` on the allocation before training
    # and stop with its report when a check fails (ours; see megatron_rl/preflight/).
    preflight: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def validate(self) -> None:
        """Cross-section checks; raise ConfigError naming the dotted key."""
        if not _RUN_NAME.match(self.name):
            _fail("name", f"must be a plain name (letters, digits, _ . -), got {self.name!r}")
        if self.batch.samples_per_prompt != self.rollout.samples_per_prompt:
            _fail(
                "rollout.samples_per_prompt",
                f"{self.rollout.samples_per_prompt} differs from batch.samples_per_prompt "
                f"{self.batch.samples_per_prompt} (set one of them; the other follows)",
            )
        self._validate_validation()
        self._validate_pool_fill()
        self._validate_mismatch_reference()
        self._validate_lengths()
        self._validate_cluster()
        from megatron_rl.config.checks import check_gpu_paths

        check_gpu_paths(self)
        probe_tokens = self.training.logprob_probe_max_tokens
        if probe_tokens > self.rollout.max_tokens:  # a probe sample fits where samples fit
            _fail(
                "training.logprob_probe_max_tokens",
                f"{probe_tokens} exceeds rollout.max_tokens {self.rollout.max_tokens}",
            )
        if self.warm_start.steps > 0 and not self.data.solution_field:
            _fail(
                "warm_start.steps", "a warm start needs worked solutions: set data.solution_field"
            )

    def _validate_validation(self) -> None:
        if not self.validation.enabled:
            return
        held_out = max(self.data.val_sizes().values())
        if held_out == 0:
            _fail(
                "validation.enabled",
                "validation needs held-out prompts but data.val_size is 0 "
                "(set data.val_size > 0 or validation.enabled: false)",
            )
        if self.validation.num_prompts is not None and self.validation.num_prompts > held_out:
            _fail(
                "validation.num_prompts",
                f"{self.validation.num_prompts} exceeds the held-out prompts of every source "
                f"(data.val_size = {held_out})",
            )

    def _validate_pool_fill(self) -> None:
        seats = self.off_policy.pool_fill * self.rollout.engines * self.rollout.max_num_seqs
        if self.off_policy.mode == "pipeline_rl" and seats < self.batch.samples_per_prompt:
            _fail(
                "off_policy.pool_fill",
                f"{self.off_policy.pool_fill:g} x rollout.engines {self.rollout.engines} x "
                f"rollout.max_num_seqs {self.rollout.max_num_seqs} = {seats:g} sequences in "
                f"flight hold no prompt of batch.samples_per_prompt "
                f"{self.batch.samples_per_prompt} samples",
            )

    def _validate_mismatch_reference(self) -> None:
        if self.algorithm.recompute and self.off_policy.mode != "ppo":
            _fail(
                "algorithm.mismatch_reference",
                f"recompute needs off_policy.mode ppo, got {self.off_policy.mode!r}: it "
                "recomputes the log-probs at the weights that generated the samples, and a "
                "PipelineRL sample spans several policy versions whose weights are gone (use "
                "update there)",
            )

    def max_response_tokens(self) -> int:
        """Longest response the generator can return (interruption text not counted)."""
        rollout = self.rollout
        if rollout.interruption.enabled:
            cut = rollout.interruption.thinking_budget[1] + rollout.interruption.answer_budget
            return max(rollout.max_tokens, cut)
        return rollout.max_tokens

    def _validate_lengths(self) -> None:
        prompt = self.data.max_prompt_tokens
        longest = prompt + self.max_response_tokens()
        what = (
            f"data.max_prompt_tokens {prompt} + longest response {self.max_response_tokens()}"
            if prompt
            else f"the longest response {self.max_response_tokens()}"
        )
        limits = {
            "rollout.max_model_len": self.rollout.max_model_len,
            "model.max_sequence_length": self.model.max_sequence_length,
            "batch.micro_batch_tokens": self.batch.micro_batch_tokens,
        }
        for key, limit in limits.items():
            if limit is not None and limit < longest:
                _fail(key, f"{limit} is shorter than {what} = {longest} tokens")

    def _validate_cluster(self) -> None:
        c, p = self.cluster, self.parallel
        if c.trainer_gpus + c.generator_gpus != c.nodes * c.gpus_per_node:
            _fail(
                "cluster.trainer_gpus",
                f"trainer_gpus {c.trainer_gpus} + generator_gpus {c.generator_gpus} must equal "
                f"nodes {c.nodes} x gpus_per_node {c.gpus_per_node} = {c.nodes * c.gpus_per_node}",
            )
        if c.trainer_gpus % p.model_parallel_size:
            _fail(
                "cluster.trainer_gpus",
                f"{c.trainer_gpus} is not divisible by parallel.tensor x pipeline x context = "
                f"{p.tensor} x {p.pipeline} x {p.context}",
            )
        expert_ranks = c.trainer_gpus // (p.pipeline * p.context)
        if expert_ranks % (p.expert * p.expert_tensor):
            _fail(
                "parallel.expert",
                f"expert x expert_tensor = {p.expert} x {p.expert_tensor} does not divide the "
                f"{expert_ranks} trainer GPUs per pipeline stage (cluster.trainer_gpus "
                f"{c.trainer_gpus} / (pipeline x context))",
            )
        tp = self.rollout.tensor_parallel
        if c.generator_gpus % tp:
            _fail(
                "cluster.generator_gpus",
                f"{c.generator_gpus} is not divisible by rollout.tensor_parallel {tp}",
            )
        if self.rollout.engines * tp > c.generator_gpus:
            _fail(
                "rollout.engines",
                f"{self.rollout.engines} engines x rollout.tensor_parallel {tp} need more than "
                f"cluster.generator_gpus {c.generator_gpus}",
            )


def link_shared_keys(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Where a recipe sets only one key of a ``LINKED_KEYS`` pair, copy it to the other.

    Returns the completed mapping and {copied key: the key it was copied from}.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    copied: dict[str, str] = {}
    for pair in LINKED_KEYS:
        present = [
            key
            for key in pair
            if isinstance(out.get(key.split(".")[0]), dict)
            and key.split(".")[1] in out[key.split(".")[0]]
        ]
        if len(present) != 1:
            continue
        source = present[0]
        target = pair[1] if source == pair[0] else pair[0]
        (src_section, src_key), (dst_section, dst_key) = source.split("."), target.split(".")
        if out.get(dst_section) is None:
            out[dst_section] = {}
        if isinstance(out[dst_section], dict):
            out[dst_section][dst_key] = out[src_section][src_key]
            copied[target] = source
    return out, copied


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from a resolved recipe mapping (linked keys filled in)."""
    linked, copied = link_shared_keys(data)
    try:
        return from_dict(RunConfig, linked)
    except ConfigError as err:
        if err.key not in copied:
            raise
        # Blame the key the recipe set, not the copy made of it.
        raise ConfigError(copied[err.key], err.message) from None


def load_run_config(
    path: str | Path, overrides: Sequence[str] = (), check_model: bool = True
) -> RunConfig:
    """Read a recipe (with its ``base`` chain), apply ``dotted.key=value`` overrides, build
    and validate the RunConfig. ``check_model`` also checks the parallel sizes against the
    model's shapes (reads the preset or ``model.hf_path``/config.json) and, for episodes with
    ``tool_format: auto``, that the model's tokenizer has a known tool format. Raises
    ConfigError."""
    data = apply_overrides(read_recipe(path), list(overrides))
    data.setdefault("name", Path(path).stem)
    config = run_config_from_dict(data)
    if check_model:
        from megatron_rl.config.checks import check_model_shapes, check_tool_format

        check_model_shapes(config)
        check_tool_format(config)
    return config


def to_yaml(config: RunConfig) -> str:
    """The resolved config as YAML (loads back to an equal RunConfig)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)


def save_run_config(config: RunConfig, path: str | Path) -> Path:
    """Write ``to_yaml(config)`` to ``path`` (e.g. ``RUN_DIR/config.yaml``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(config))
    return path


def diff_keys(a: Any, b: Any, prefix: str = "") -> set[str]:
    """Dotted keys whose values differ between two configs (dataclasses or mappings)."""
    a, b = to_dict(a), to_dict(b)
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return set() if a == b else {prefix}
    keys: set[str] = set()
    for key in set(a) | set(b):
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in a or key not in b:
            keys.add(path)
        else:
            keys |= diff_keys(a[key], b[key], path)
    return keys
