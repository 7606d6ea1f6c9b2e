"""Run-level sections of the run config: optimizer, batch, off-policy mode, validation,
checkpoints, budget, warm start, logging and the Slurm cluster (no torch import).

Defaults are the ScaleRL 8B run (docs/paper.md sections 2-3) where the paper gives a value;
where it is silent the default is ours and documented as such.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import ConfigError
from megatron_rl.planning.gpus import DEFAULT_GPU, GPUS
from megatron_rl.trainer.tracking import WandbConfig

SIGNAL_NAMES: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
# Slurm --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(section: object, name: str, minimum: int) -> None:
    value = getattr(section, name)
    if not _is_int(value) or value < minimum:
        raise ConfigError(name, f"must be an int >= {minimum}, got {value!r}")


def _check_positive(section: object, name: str, allow_zero: bool = False) -> None:
    value = getattr(section, name)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(name, f"must be a finite number {bound}, got {value!r}")


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
        distributed: megatron's distributed optimizer (optimizer state sharded over
            data-parallel ranks). Default (null): on GPU yes; on CPU it is unavailable.
        overlap_grad_reduce: reduce gradients over data-parallel ranks bucket by bucket
            during the backward of a step's last micro-batch. Default (null): on GPU.
    """

    lr: float = 5e-7
    warmup_steps: int = 100
    eps: float = 1e-15
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    distributed: bool | None = None
    overlap_grad_reduce: bool | None = None

    def validate(self) -> None:
        _check_positive(self, "lr")
        _check_int(self, "warmup_steps", 0)
        _check_positive(self, "eps")
        _check_positive(self, "weight_decay", allow_zero=True)
        _check_positive(self, "grad_clip", allow_zero=True)
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("betas", f"must be in [0, 1), got {list(self.betas)}")

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
        micro_batch_tokens: a token budget per micro-batch: sequences, longest first, as
            many as fit once padded to the micro-batch's longest (so a micro-batch holds
            sequences of similar lengths and little padding).
            Exactly one of the two is set; a single sequence must fit the token budget.
        pack: micro-batches of whole sequences back to back, no padding between them (THD
            layout: positions restart and attention stays within each sequence;
            ``trainer.packing``), filled to ``micro_batch_tokens`` first-fit decreasing (with
            ``micro_batch_size``: that many sequences, packed). The loss and update are the
            padded ones. null (default): on a GPU (Transformer Engine's ``thd`` attention),
            off on the CPU (where packing also measured ~10% faster on tiny-llama: 48
            lognormal samples, 1.0-1.1 s vs 0.92-0.94 s a step; kept off there until the
            whole CPU suite has run packed).
    """

    prompts_per_step: int = 48
    samples_per_prompt: int = 16
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = 16384
    pack: bool | None = None

    def validate(self) -> None:
        _check_int(self, "prompts_per_step", 1)
        if self.pack is not None and not isinstance(self.pack, bool):
            raise ConfigError("pack", f"must be true, false or null, got {self.pack!r}")
        # r_i - mean(group) is identically 0 with one sample: no learning signal at all.
        if not _is_int(self.samples_per_prompt) or self.samples_per_prompt < 2:
            raise ConfigError(
                "samples_per_prompt",
                "must be an int >= 2 (group-relative advantages need at least two samples "
                f"per prompt), got {self.samples_per_prompt!r}",
            )
        if (self.micro_batch_size is None) == (self.micro_batch_tokens is None):
            raise ConfigError(
                "micro_batch_size",
                "micro_batch_size and micro_batch_tokens: set exactly one (the other null), "
                f"got {self.micro_batch_size!r} and {self.micro_batch_tokens!r}",
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
        max_lag: k of PipelineRL-k (read in mode pipeline_rl only). It also bounds what is
            in flight: at most (k + 1) x ``batch.prompts_per_step`` prompts are generating or
            waiting to be trained on (``megatron_rl.trainer.rollout_source``).
        k: updates per generation round (read in mode ppo only).
        pool_fill: PipelineRL's fill target: the generator pool is kept topped up to
            ``pool_fill x rollout.engines x rollout.max_num_seqs`` sequences in flight (within
            the lag bound), also while the trainer updates. 1.0: every engine at capacity;
            above 1, a queue inside the engines covers the time between a sequence finishing
            and its replacement arriving (ours; the paper is silent).
    """

    mode: Literal["pipeline_rl", "ppo"] = "pipeline_rl"
    max_lag: int = 8
    k: int = 8
    pool_fill: float = 1.0

    def validate(self) -> None:
        _check_int(self, "max_lag", 1)
        _check_int(self, "k", 1)
        _check_positive(self, "pool_fill")


@dataclass
class ValidationConfig:
    """Held-out evaluation: mean@G pass rate on the validation split (the curve's R).

    Attributes:
        enabled: evaluate at all (needs ``data.val_size > 0``).
        every_steps: evaluate every this many updates (ScaleRL: 100).
        samples_per_prompt: G of mean@G (ScaleRL: 16).
        num_prompts: evaluate on the first this many held-out prompts of each domain; null:
            all of them.
        temperature: sampling temperature; null: ``rollout.temperature`` (paper silent).
        at_start: evaluate once before the first update (the curve's point at C = 0).
        timeout_minutes: how long the other trainer ranks wait for the main rank's
            validation pass (generation and scoring; hours at paper scale, far beyond
            ``parallel.timeout_minutes``); a pass that takes longer fails the run naming this
            key. ``megatron-rl preflight`` measures a pass against it.
    """

    enabled: bool = True
    every_steps: int = 100
    samples_per_prompt: int = 16
    num_prompts: int | None = None
    temperature: float | None = None
    at_start: bool = True
    timeout_minutes: float = 360.0

    def validate(self) -> None:
        _check_int(self, "every_steps", 1)
        _check_positive(self, "timeout_minutes")
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
        on_signals: signals that trigger a save at the next step and a clean exit, status 0
            (Slurm preemption sends SIGTERM; ``cluster.signal_minutes_before_end`` sends
            SIGUSR1; Ctrl-C is SIGINT, and a second Ctrl-C stops at once, without a save).
        save_at_end: save when training stops at its step or GPU-hour budget.
        export_hf_every: also export the checkpoint of every this many steps to an HF
            directory, ``RUN_DIR/hf/step_NNNNNNNN`` (``trainer/hf_export.py``: a background
            process while training goes on; ``keep_last`` of them are kept); a multiple of
            ``every_steps``. 0: off.
        async_save: the periodic saves are written in the background (megatron-core's async
            dist-checkpoint save) while training goes on; the loop waits only while the
            tensors are staged to host memory (which needs a host copy of this rank's model
            and optimizer state). The save completes (and counts, and older ones are pruned)
            once written; saves on a signal and at the end are synchronous; a save still
            being written when a rank crashes or hangs is lost (the run resumes from the
            one before). Default on: a Scout checkpoint with optimizer state is ~1.5 TB.
    """

    every_steps: int = 100
    keep_last: int = 2
    on_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT")
    save_at_end: bool = True
    export_hf_every: int = 0
    async_save: bool = True

    def validate(self) -> None:
        _check_int(self, "every_steps", 0)
        _check_int(self, "keep_last", 1)
        _check_int(self, "export_hf_every", 0)
        if self.export_hf_every and (
            not self.every_steps or self.export_hf_every % self.every_steps
        ):
            raise ConfigError(
                "export_hf_every",
                f"must be a multiple of checkpoint.every_steps ({self.every_steps}), got "
                f"{self.export_hf_every}: an export converts the checkpoint of its step",
            )
        unknown = [s for s in self.on_signals if s not in SIGNAL_NAMES]
        if unknown:
            raise ConfigError("on_signals", f"must be among {list(SIGNAL_NAMES)}, got {unknown}")


@dataclass
class TrainingConfig:
    """When training stops: whichever budget is reached first.

    Attributes:
        max_steps: optimizer updates (ScaleRL 8B: 7,400; Scout: 7,100); 0: the warm start
            and a checkpoint of step 0 only (a tournament's shared start).
        max_gpu_hours: training GPU-hours (``gpu_hours``, docs/scaling.md: trainers +
            generators on training samples); null: no limit.
        check_logprob_gap: stop the run when the generator's log-probs of tokens sampled with
            the trainer's current weights differ from the trainer's by more than
            ``max_logprob_gap`` (mean |delta| per token, checked every step before the
            update is applied). A generator that silently diverges (a stale tied head, a
            wrong dtype, a failed push) must never train for hours.
        max_logprob_gap: the limit; null: by ``model.dtype`` (:data:`LOGPROB_GAP_LIMITS`).
            Not used with FP8 rollouts (``rollout.quantization``): see below.
        max_logprob_gap_fp8: the limit when the engines run FP8 (``rollout.quantization``),
            whose quantized weights and activations put the engine further from the trainer
            than any dtype does; null: :data:`FP8_LOGPROB_GAP_LIMIT`. It stays below the
            gaps of a broken push (a stale tied head: 0.06-0.13; wrong weights: 0.1-0.5), so
            the per-step check and the post-push probe still catch one.
            The per-step check sees only samples generated entirely by the trainer's
            current weights: in PipelineRL only the first batch has such samples (later
            ones started before the latest push), so the probe below keeps the path guarded.
        logprob_probe_every: every this many updates (at the first push in each window of
            that many steps), right after the push, generate ``logprob_probe_samples``
            short samples with the new weights, score them with the trainer and check their
            gap against the same limit (logged as ``logprob_probe_gap`` /
            ``logprob_probe_tokens``); 0: never. Cost per probe: one blocking generation of
            those samples (its requests queue behind training requests already waiting in
            the engines, so it can wait up to one sample's generation time) and one
            forward-only pass of the trainer over them.
        logprob_probe_samples: prompts (one sample each) per probe, taken in turn from the
            validation split (else the training split); never trained on, never scored.
        logprob_probe_max_tokens: tokens generated per probe sample.
        hang_timeout_minutes: a trainer rank that makes no progress for this long (no phase
            of the loop begins: batch, update, push, validation, checkpoint; the main rank's
            waits on the generator pool count as progress, a wait for the main rank's
            broadcast is not judged) writes every thread's Python stack to
            ``RUN_DIR/hang/rank_N.txt`` and exits with status 75, which the sbatch script
            turns into a requeue (resumed from the last checkpoint). Below the collective
            timeout (``parallel.timeout_minutes``), above the longest phase (a checkpoint
            save). 0: off. See ``megatron_rl.platform.watchdog``.
    """

    max_steps: int = 7400
    max_gpu_hours: float | None = None
    check_logprob_gap: bool = True
    max_logprob_gap: float | None = None
    max_logprob_gap_fp8: float | None = None
    logprob_probe_every: int = 10
    logprob_probe_samples: int = 4
    logprob_probe_max_tokens: int = 16
    hang_timeout_minutes: float = 20.0

    def validate(self) -> None:
        _check_int(self, "max_steps", 0)  # 0: the warm start only (a tournament's shared start)
        _check_positive(self, "hang_timeout_minutes", allow_zero=True)  # 0: off
        if self.max_gpu_hours is not None:
            _check_positive(self, "max_gpu_hours")
        if not isinstance(self.check_logprob_gap, bool):
            raise ConfigError(
                "check_logprob_gap", f"must be a bool, got {self.check_logprob_gap!r}"
            )
        for name in ("max_logprob_gap", "max_logprob_gap_fp8"):
            if getattr(self, name) is not None:
                _check_positive(self, name)
        _check_int(self, "logprob_probe_every", 0)
        _check_int(self, "logprob_probe_samples", 1)
        _check_int(self, "logprob_probe_max_tokens", 1)

    def logprob_gap_limit(self, dtype: str, quantization: str | None = None) -> float | None:
        """The gap limit of a run whose trainer computes in ``dtype`` and whose engines run
        ``quantization`` (``rollout.quantization``; None: unquantized). None: no check."""
        if not self.check_logprob_gap:
            return None
        if quantization is not None:
            if self.max_logprob_gap_fp8 is not None:
                return self.max_logprob_gap_fp8
            return FP8_LOGPROB_GAP_LIMIT
        if self.max_logprob_gap is not None:
            return self.max_logprob_gap
        return LOGPROB_GAP_LIMITS[dtype]

    @staticmethod
    def logprob_gap_key(quantization: str | None = None) -> str:
        """The recipe key of the limit :meth:`logprob_gap_limit` returns (for messages)."""
        if quantization is not None:
            return "training.max_logprob_gap_fp8"
        return "training.max_logprob_gap"


# Default limits of the trainer-vs-generator log-prob gap (mean |delta| per on-policy token).
# float32: a healthy weight path measures ~2e-7 (vLLM CPU vs megatron, dense and MoE, TP/EP),
# a broken one 0.06-0.5 (a stale tied head: 0.06-0.13). bfloat16: both sides round their
# activations to bf16 in different kernels: `megatron-rl check-parity HF_DIR --dtype
# bfloat16` on the tiny Llama (CPU, FP32 head on both sides) measures 2.4e-3 mean, 1e-2 max
# when healthy, so the bf16 limit is 2e-2: ~8x the healthy mean, a third of the smallest
# broken gap seen. Not yet measured on GPU (no GPU was lent so far).
LOGPROB_GAP_LIMITS: dict[str, float] = {"float32": 1e-3, "bfloat16": 2e-2}
# Default limit with FP8 rollouts (rollout.quantization). ASSUMPTION, not measured (no GPU
# with vLLM was lent; tools/gpu_check.sh checks the quantizer, not the gap): FP8 weights carry
# a relative error up to 2^-4 per element (e4m3's 3 mantissa bits), on top of bf16's
# 2.4e-3 healthy gap; the peers correct the larger mismatch with importance weights rather
# than bound it. 5e-2 is 20x the healthy bf16 mean and below the smallest broken gap seen
# (0.06, a stale tied head), so a broken push is still caught; set
# training.max_logprob_gap_fp8 from the first run's logprob_gap.
FP8_LOGPROB_GAP_LIMIT = 5e-2


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
        wandb: Weights & Biases tracking (off by default; see megatron_rl/trainer/tracking.py).
    """

    tensorboard: bool = True
    log_every: int = 1
    progress_bar: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)

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
        nvlink_domain_gpus: GPUs of one NVLink domain (GB200 NVL72: one rack of 72); 0: no
            NVLink between nodes (H100 / H200 HGX).
        segment: ``#SBATCH --segment`` (Slurm >= 24.11, topology/block): the job is allocated
            in segments of this many nodes, each inside one block (rack). None: the smallest
            divisor of ``nodes`` that holds the trainer's nodes within one NVLink domain, so
            the trainer's collectives (EP all-to-all, TP) stay on NVLink; 0: no request.
        nccl_mnnvl: ``NCCL_MNNVL_ENABLE`` (multi-node NVLink). None: NCCL's auto-detect (forcing
            it on fails at init on nodes without an IMEX channel).
        nccl_nvls: ``NCCL_NVLS_ENABLE`` (NVLink SHARP) of the trainer. None: NCCL's default.
        engine_nccl_nvls: NVLS of the vLLM engines' own (tensor-parallel) communicators, a
            vLLM pin (``megatron_rl.rollout.engine.nccl_env``); the communicators they share
            with the trainer keep the job's NCCL settings. Off by default: NVLS buffers take
            engine GPU memory (``megatron-rl plan`` counts them when on) for all-reduces of
            decode-sized activations.
        gpu: the cluster's GPU model (``megatron_rl.planning.gpus.GPUS``): what ``megatron-rl
            plan`` plans for by default and what the recipe's GPU-only settings (the FP8
            recipe) are checked against at load; the preflight checks them again on the GPU
            it runs on.
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
    nvlink_domain_gpus: int = 72
    segment: int | None = None
    nccl_mnnvl: bool | None = None
    nccl_nvls: bool | None = None
    engine_nccl_nvls: bool = False
    gpu: str = DEFAULT_GPU

    def validate(self) -> None:
        if self.gpu not in GPUS:
            raise ConfigError("gpu", f"unknown GPU {self.gpu!r}; known: {', '.join(sorted(GPUS))}")
        for name in ("nodes", "gpus_per_node", "trainer_gpus", "generator_gpus"):
            _check_int(self, name, 1)
        _check_int(self, "signal_minutes_before_end", 0)
        _check_int(self, "nvlink_domain_gpus", 0)
        if self.segment is not None:
            _check_int(self, "segment", 0)
        if not _SLURM_TIME.match(self.time):
            raise ConfigError(
                "time",
                f"must be a Slurm time limit such as '04:00:00' or '2-00:00:00', got {self.time!r}",
            )
        if any(":" not in m for m in self.container_mounts):
            raise ConfigError(
                "container_mounts", f"must be 'src:dst' items, got {self.container_mounts}"
            )
