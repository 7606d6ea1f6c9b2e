"""The run config: one typed tree for a whole RL run, mirrored by the YAML recipes.

``RunConfig`` gathers the component configs (model, parallel, algorithm, data, reward,
rollout; each defined next to its code) and the run-level sections defined here (optimizer,
batch, off-policy mode, validation, checkpoints, budget, warm start, logging, Slurm cluster).
Field defaults are the ScaleRL 8B run (SCALERL.md sections 2-3) wherever the paper gives a
value; where it is silent the default is documented as ours.

``RunConfig.validate()`` checks combinations across sections (pure, no I/O); the checks that
need the model's shapes live in :mod:`megatron_rl.config.checks`. ``load_run_config`` runs
both. This module itself imports no torch. (Note: ``megatron_rl.platform``'s package
``__init__`` imports torch eagerly, so importing ``ParallelConfig`` from it currently pulls
torch in; the schema's own code never does.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.config.loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    read_recipe,
    to_dict,
)
from megatron_rl.data.config import DataConfig
from megatron_rl.models.config import ModelConfig
from megatron_rl.platform.config import ParallelConfig
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import RolloutConfig

SIGNAL_NAMES: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
# Slurm --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Keys that two sections share: when a recipe sets only one of a pair, the other follows it.
LINKED_KEYS: tuple[tuple[str, str], ...] = (
    ("batch.samples_per_prompt", "rollout.samples_per_prompt"),
    ("model.fp32_head", "rollout.fp32_head"),
)


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"recipe key '{key}': {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(section: object, name: str, minimum: int) -> None:
    value = getattr(section, name)
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_positive(section: object, name: str, allow_zero: bool = False) -> None:
    value = getattr(section, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup then a constant learning rate (ScaleRL: 5e-7 after 100 steps).

    Attributes:
        lr: peak (constant) learning rate.
        warmup_steps: linear warmup steps; 0 starts at ``lr``.
        eps: AdamW epsilon (ScaleRL: 1e-15, far below the usual 1e-8).
        weight_decay: decoupled weight decay (ScaleRL: 0.01).
        betas: AdamW betas. The paper is silent; default: the AdamW defaults (0.9, 0.999).
        grad_clip: global gradient-norm clip. The paper is silent; default 1.0 (Megatron's
            default); 0 disables clipping.
    """

    lr: float = 5e-7
    warmup_steps: int = 100
    eps: float = 1e-15
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0

    def validate(self) -> None:
        _check_positive(self, "lr")
        _check_int(self, "warmup_steps", 0)
        _check_positive(self, "eps")
        _check_positive(self, "weight_decay", allow_zero=True)
        _check_positive(self, "grad_clip", allow_zero=True)
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be in [0, 1), got {list(self.betas)}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` for the update with 0-based index ``step`` (for LambdaLR):
        ``(step + 1) / warmup_steps`` during warmup, then 1."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0


@dataclass
class BatchConfig:
    """Samples per optimizer step and how they are split into micro-batches.

    Attributes:
        prompts_per_step: prompts per update (ScaleRL: 48).
        samples_per_prompt: G, generations per prompt (ScaleRL: 16; 48 x 16 = 768 samples).
            ``rollout.samples_per_prompt`` follows it when a recipe sets only this one.
        micro_batch_size: sequences per forward/backward micro-batch; or
        micro_batch_tokens: a token budget per micro-batch (sequences are packed up to it).
            Exactly one of the two is set; a single sequence must fit the token budget.
    """

    prompts_per_step: int = 48
    samples_per_prompt: int = 16
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = 16384

    def validate(self) -> None:
        _check_int(self, "prompts_per_step", 1)
        # r_i - mean(group) is identically 0 with one sample: no learning signal at all.
        if not _is_int(self.samples_per_prompt) or self.samples_per_prompt < 2:
            raise ValueError(
                "samples_per_prompt must be an int >= 2 (group-relative advantages need at "
                f"least two samples per prompt), got {self.samples_per_prompt!r}"
            )
        if (self.micro_batch_size is None) == (self.micro_batch_tokens is None):
            raise ValueError(
                "micro_batch_size and micro_batch_tokens: set exactly one (the other null), got "
                f"{self.micro_batch_size!r} and {self.micro_batch_tokens!r}"
            )
        for name in ("micro_batch_size", "micro_batch_tokens"):
            if getattr(self, name) is not None:
                _check_int(self, name, 1)

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


@dataclass
class OffPolicyConfig:
    """How generation and training overlap.

    Attributes:
        mode: "pipeline_rl": generators never stop, weights are pushed in flight after every
            update and the trainer waits rather than train on a sample more than ``max_lag``
            policy versions old (ScaleRL: PipelineRL-8). "ppo": generate ``k`` batches of
            ``batch.prompts_per_step`` prompts with one policy, then make ``k`` updates on
            them (PPO-off-policy-k).
        max_lag: k of PipelineRL-k (read in mode pipeline_rl only).
        k: updates per generation round (read in mode ppo only).
    """

    mode: Literal["pipeline_rl", "ppo"] = "pipeline_rl"
    max_lag: int = 8
    k: int = 8

    def validate(self) -> None:
        _check_int(self, "max_lag", 1)
        _check_int(self, "k", 1)


@dataclass
class ValidationConfig:
    """Held-out evaluation: mean@G pass rate on the validation split (the curve's R).

    Attributes:
        enabled: evaluate at all (needs ``data.val_size > 0``).
        every_steps: evaluate every this many updates (ScaleRL: 100).
        samples_per_prompt: G of mean@G (ScaleRL: 16).
        num_prompts: evaluate on the first this many held-out prompts; null: all of them.
        temperature: sampling temperature; null: ``rollout.temperature`` (paper silent).
        at_start: evaluate once before the first update (the curve's point at C = 0).
    """

    enabled: bool = True
    every_steps: int = 100
    samples_per_prompt: int = 16
    num_prompts: int | None = None
    temperature: float | None = None
    at_start: bool = True

    def validate(self) -> None:
        _check_int(self, "every_steps", 1)
        _check_int(self, "samples_per_prompt", 1)
        if self.num_prompts is not None:
            _check_int(self, "num_prompts", 1)
        if self.temperature is not None:
            _check_positive(self, "temperature")


@dataclass
class CheckpointConfig:
    """Checkpoints under ``RUN_DIR/checkpoints`` (model + optimizer + loop state).

    Attributes:
        every_steps: save every this many updates; 0: only on signals and at the end.
            The paper is silent; default 100 (with validation).
        keep_last: complete checkpoints kept (older ones are deleted after a good save).
        on_signals: signals that trigger a save and a clean exit (Slurm preemption sends
            SIGTERM; ``cluster.signal_minutes_before_end`` sends SIGUSR1).
        save_at_end: save when training stops at its step or GPU-hour budget.
    """

    every_steps: int = 100
    keep_last: int = 2
    on_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    save_at_end: bool = True

    def validate(self) -> None:
        _check_int(self, "every_steps", 0)
        _check_int(self, "keep_last", 1)
        unknown = [s for s in self.on_signals if s not in SIGNAL_NAMES]
        if unknown:
            raise ValueError(f"on_signals must be among {list(SIGNAL_NAMES)}, got {unknown}")


@dataclass
class TrainingConfig:
    """When training stops: whichever budget is reached first.

    Attributes:
        max_steps: optimizer updates (ScaleRL 8B: 7,400; Scout: 7,100).
        max_gpu_hours: GPU-hours of the whole run (trainers + generators); null: no limit.
    """

    max_steps: int = 7400
    max_gpu_hours: float | None = None

    def validate(self) -> None:
        _check_int(self, "max_steps", 1)
        if self.max_gpu_hours is not None:
            _check_positive(self, "max_gpu_hours")


@dataclass
class WarmStartConfig:
    """A short supervised phase on the data's worked solutions before RL (``steps: 0``: off).

    Used by the tiny CPU recipes, whose model starts from random weights; production runs
    start from an SFT'd checkpoint (``model.hf_path``) and leave it off.

    Attributes:
        steps: SFT updates on ``(prompt, data.solution_field)`` pairs of training prompts.
        lr: SFT learning rate (AdamW, no weight decay).
        batch_size: examples per SFT update.
    """

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 32

    def validate(self) -> None:
        _check_int(self, "steps", 0)
        _check_positive(self, "lr")
        _check_int(self, "batch_size", 1)


@dataclass
class LoggingConfig:
    """Metrics output: ``RUN_DIR/metrics.jsonl`` always, TensorBoard and a progress bar.

    Attributes:
        tensorboard: also write TensorBoard scalars to ``RUN_DIR/tensorboard``.
        log_every: write a training record every this many updates (validation records are
            always written).
        progress_bar: show a progress bar with the key numbers.
    """

    tensorboard: bool = True
    log_every: int = 1
    progress_bar: bool = True

    def validate(self) -> None:
        _check_int(self, "log_every", 1)


@dataclass
class ClusterConfig:
    """The Slurm allocation of a run (read by ``megatron-rl launch``). Defaults: the ScaleRL
    8B run, 80 GPUs = 20 GB200 nodes x 4, of which 16 train and 64 generate.

    Attributes:
        nodes: nodes of the job.
        gpus_per_node: GPUs per node (GB200 NVL72 compute trays: 4).
        trainer_gpus: GPUs of the Megatron trainer (TP x PP x CP x DP).
        generator_gpus: GPUs of the vLLM engines (``rollout.engines x rollout.tensor_parallel``
            at most).
        partition / account: Slurm partition and account; empty: the cluster's default.
        time: Slurm time limit, e.g. "04:00:00" (quote it in YAML: unquoted it reads as a
            number of seconds).
        container_image: container image (pyxis ``--container-image``); empty: none.
        container_mounts: ``src:dst`` mounts of the container.
        requeue: let Slurm requeue the job after preemption (it resumes from the latest
            checkpoint).
        signal_minutes_before_end: Slurm sends SIGUSR1 this long before the time limit so a
            checkpoint is saved; 0: no signal.
    """

    nodes: int = 20
    gpus_per_node: int = 4
    trainer_gpus: int = 16
    generator_gpus: int = 64
    partition: str = ""
    account: str = ""
    time: str = "04:00:00"
    container_image: str = ""
    container_mounts: list[str] = field(default_factory=list)
    requeue: bool = True
    signal_minutes_before_end: int = 5

    def validate(self) -> None:
        for name in ("nodes", "gpus_per_node", "trainer_gpus", "generator_gpus"):
            _check_int(self, name, 1)
        _check_int(self, "signal_minutes_before_end", 0)
        if not _SLURM_TIME.match(self.time):
            raise ValueError(
                f"time must be a Slurm time limit such as '04:00:00' or '2-00:00:00', "
                f"got {self.time!r}"
            )
        if any(":" not in m for m in self.container_mounts):
            raise ValueError(
                f"container_mounts must be 'src:dst' items, got {self.container_mounts}"
            )


@dataclass
class RunConfig:
    """Everything one RL run needs; the root of every recipe.

    ``name`` defaults to the recipe file's stem (``load_run_config``) and names the default
    run directory ``runs/<name>``.
    """

    name: str = ""
    seed: int = 1234
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
        self._validate_lengths()
        self._validate_cluster()
        if self.warm_start.steps > 0 and not self.data.solution_field:
            _fail(
                "warm_start.steps", "a warm start needs worked solutions: set data.solution_field"
            )

    def _validate_validation(self) -> None:
        if not self.validation.enabled:
            return
        if self.data.val_size == 0:
            _fail(
                "validation.enabled",
                "validation needs held-out prompts but data.val_size is 0 "
                "(set data.val_size > 0 or validation.enabled: false)",
            )
        if self.validation.num_prompts is not None and self.validation.num_prompts > (
            self.data.val_size
        ):
            _fail(
                "validation.num_prompts",
                f"{self.validation.num_prompts} exceeds the held-out prompts "
                f"(data.val_size = {self.data.val_size})",
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
        # Blame the key the recipe set, not the copy made of it.
        message = str(err)
        for target, source in copied.items():
            message = message.replace(f"recipe key '{target}'", f"recipe key '{source}'")
        raise ConfigError(message) from None


def load_run_config(
    path: str | Path, overrides: Sequence[str] = (), check_model: bool = True
) -> RunConfig:
    """Read a recipe (with its ``base`` chain), apply ``dotted.key=value`` overrides, build
    and validate the RunConfig. ``check_model`` also checks the parallel sizes against the
    model's shapes (reads the preset or ``model.hf_path``/config.json). Raises ConfigError."""
    data = apply_overrides(read_recipe(path), list(overrides))
    data.setdefault("name", Path(path).stem)
    config = run_config_from_dict(data)
    if check_model:
        from megatron_rl.config.checks import check_model_shapes

        check_model_shapes(config)
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
