"""A run's memory plan: the trainer's and an engine's GPU against the GPU's memory, and the
smallest change of the trainer's layout that fits (no torch import).

``plan_run(config)`` reads everything from the RunConfig: model shapes (preset or HF config),
``parallel`` and ``model.recompute_activations`` (the layout), ``cluster.trainer_gpus`` (the
data-parallel sizes), ``batch.micro_batch_tokens`` and the longest sequence (activations),
``optimizer.distributed`` / ``overlap_grad_reduce`` (GPU defaults: on), ``rollout`` (engines;
multi-turn episodes: ``episodes.py``).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, replace

from megatron_rl.planning.activations import ActivationBytes, ActivationSettings, activation_bytes
from megatron_rl.planning.engine import EngineBytes, engine_bytes, largest_pushed_tensor
from megatron_rl.planning.episodes import EpisodePlan, episode_plan, kv_block_size
from megatron_rl.planning.gpus import (
    ENGINE_RUNTIME_RESERVE,
    FRAGMENTATION,
    GPU,
    NCCL_BUFFSIZE,
    NCCL_CHANNELS_PER_PEER,
    NVLS_BYTES_PER_COMMUNICATOR,
    TRAINER_RUNTIME_RESERVE,
    GiB,
    get_gpu,
)
from megatron_rl.planning.shapes import (
    DTYPE_BYTES,
    ModelShapes,
    model_shapes,
    rank_parameters,
)
from megatron_rl.planning.states import StateBytes, state_bytes

DEFAULT_HEADROOM = 0.20  # fraction of the GPU left free: fragmentation, imbalance, spikes


@dataclass(frozen=True)
class Layout:
    """The trainer's parallel layout as the planner varies it (expert-TP 1, CP 1)."""

    tensor: int
    pipeline: int
    expert: int
    recompute: bool

    @classmethod
    def of(cls, config) -> Layout:
        p = config.parallel
        return cls(p.tensor, p.pipeline, p.expert, config.model.recompute_activations)

    def overrides(self) -> dict[str, object]:
        """The recipe keys of this layout."""
        return {
            "parallel.tensor": self.tensor,
            "parallel.sequence_parallel": self.tensor > 1,
            "parallel.pipeline": self.pipeline,
            "parallel.expert": self.expert,
            "model.recompute_activations": self.recompute,
        }

    def changes_from(self, other: Layout) -> dict[str, object]:
        """The recipe keys whose values differ from ``other``'s."""
        mine, theirs = self.overrides(), other.overrides()
        return {k: v for k, v in mine.items() if theirs[k] != v}

    def describe(self) -> str:
        parts = [f"TP {self.tensor}", f"PP {self.pipeline}"]
        if self.expert > 1:
            parts.append(f"EP {self.expert}")
        parts.append("recompute" if self.recompute else "no recompute")
        return ", ".join(parts)


@dataclass(frozen=True)
class TrainerPlan:
    """One trainer GPU (the fullest pipeline stage's): states, activations, push, reserve."""

    layout: Layout
    dp: int
    expert_dp: int
    stage: int
    states: StateBytes
    activations: ActivationBytes
    push_extra: int
    reserve: int
    capacity: int
    nvls: int = 0  # NVLS buffers of the trainer's NCCL groups (cluster.nccl_nvls not false)
    fragmentation: int = 0  # of the activations (gpus.FRAGMENTATION)
    transfer: int = 0  # NCCL buffers of the weight-transfer communicators (transfer_buffer_bytes)

    @property
    def working(self) -> int:
        """The larger of the two phases: a micro-batch's activations, or a weight push."""
        return max(self.activations.peak, self.push_extra)

    @property
    def total(self) -> int:
        return (
            self.states.total
            + self.reserve
            + self.working
            + self.nvls
            + self.fragmentation
            + self.transfer
        )

    @property
    def headroom(self) -> float:
        return 1.0 - self.total / self.capacity


@dataclass(frozen=True)
class EnginePlan:
    """One engine GPU."""

    bytes: EngineBytes
    reserve: int
    capacity: int
    transfer: int = 0  # NCCL buffers of its weight-transfer communicator (transfer_buffer_bytes)

    @property
    def total(self) -> int:
        return sum(self.bytes.parts.values()) + self.reserve + self.transfer

    @property
    def headroom(self) -> float:
        return 1.0 - self.total / self.capacity


@dataclass(frozen=True)
class Plan:
    """The plan of one run: its trainer and engine GPUs, and layouts that fit better."""

    name: str
    shapes: ModelShapes
    gpu: GPU
    headroom_target: float
    trainer: TrainerPlan
    engine: EnginePlan
    tokens: int
    seq_len: int
    alternatives: tuple[TrainerPlan, ...]
    trainer_gpus: int
    engines: int
    engine_tp: int
    max_num_seqs: int
    episode: EpisodePlan | None = None  # multi-turn episodes (rollout.max_turns > 1)
    engines_per_node: int = 0
    # When the engines do not fit: the smallest change that makes them (overrides, and the
    # engine plan with it); None when they fit or nothing tried does.
    engine_fix: tuple[tuple[str, ...], EnginePlan] | None = None

    @property
    def trainer_fits(self) -> bool:
        return self.trainer.headroom >= self.headroom_target

    @property
    def engine_fits(self) -> bool:
        return self.engine.headroom >= self.headroom_target

    @property
    def suggestion(self) -> TrainerPlan | None:
        """The smallest layout change that fits (None when the recipe's layout fits)."""
        if self.trainer_fits or not self.alternatives:
            return None
        return self.alternatives[0]


def micro_batch_shape(config, gpu: bool = True) -> tuple[int, int]:
    """(tokens, sequence length) of the largest micro-batch the trainer builds: sequences of
    the longest length, as many as ``batch.micro_batch_tokens`` holds (at least one;
    ``megatron_rl.trainer.batch.plan_micro_batches``), or ``batch.micro_batch_size`` of them.

    Packed (``batch.pack``; null packs on a ``gpu``, ``trainer.step.resolve_pack``) with a
    token budget, a micro-batch is filled first-fit to ``batch.micro_batch_tokens`` with
    shorter sequences (``trainer.packing.plan_packed``): up to the whole budget, not only the
    longest sequences that fit it whole (16384 with 12k-token sequences: 16384 tokens, not
    12k)."""
    longest = config.data.max_prompt_tokens + config.max_response_tokens()
    if config.batch.micro_batch_size:
        return config.batch.micro_batch_size * longest, longest
    pack = gpu if config.batch.pack is None else config.batch.pack
    if pack:
        return max(config.batch.micro_batch_tokens, longest), longest
    count = max(1, config.batch.micro_batch_tokens // longest)
    return count * longest, longest


def push_extra_bytes(shapes: ModelShapes, config) -> int:
    """Extra memory of the trainer rank that streams a weight push
    (``megatron_rl.conversion.weight_stream``): one decoder layer in full, all experts
    included, or the full head, plus two buckets (the one being sent and the next being built,
    ``rollout.weights.push.prefetched``; a bucket may overshoot by its last tensor), of
    ``rollout.weight_bucket_mb``'s GPU size."""
    s, d = shapes, DTYPE_BYTES[config.model.dtype]
    full = rank_parameters(s)
    layer = {}
    for p in full:
        if p.name.startswith("decoder.layers."):
            key = p.name.split(".")[2]
            layer[key] = layer.get(key, 0) + p.numel * d
    head = s.vocab * s.hidden * d  # pushed in the model's dtype, like every weight
    largest, _ = largest_pushed_tensor(s, d)
    bucket = config.rollout.weight_bucket_bytes_on(gpu=True) + largest
    return max([head, *layer.values()]) + 2 * bucket


def trainer_nvls_bytes(config, layout: Layout, dp: int, expert_dp: int) -> int:
    """NVLS buffers of one trainer GPU: one set per NCCL group of more than one rank that runs
    collectives (TP, DP, EP, expert-DP; pipeline stages only send and receive), unless the
    recipe turns NVLS off (``cluster.nccl_nvls: false``; None leaves NCCL's default, which
    uses NVLS on NVSwitch systems)."""
    if config.cluster.nccl_nvls is False:
        return 0
    groups = [layout.tensor, dp] + ([layout.expert, expert_dp] if layout.expert > 1 else [])
    return NVLS_BYTES_PER_COMMUNICATOR * sum(size > 1 for size in groups)


def transfer_buffer_bytes(config) -> tuple[int, int]:
    """NCCL buffers of the weight-transfer communicators beyond the runtime reserve: (on a
    trainer source rank, on an engine GPU). ``rollout.weight_transport: nccl_m2n`` forms one
    communicator per engine, joined by every trainer source rank (``max(parallel.tensor,
    parallel.expert)`` of them) and that engine's workers; a source rank reshards into every
    worker (peers: ``rollout.tensor_parallel`` per engine), a worker receives from every source
    rank. Per peer, ``NCCL_CHANNELS_PER_PEER`` x ``NCCL_BUFFSIZE`` (gpus.py, with sources). The
    other transports' one group is in the reserve."""
    rollout = config.rollout
    if rollout.weight_transport != "nccl_m2n":
        return 0, 0
    per_peer = NCCL_CHANNELS_PER_PEER * NCCL_BUFFSIZE
    sources = max(config.parallel.tensor, config.parallel.expert)
    return rollout.engines * rollout.tensor_parallel * per_peer, sources * per_peer


def plan_trainer(
    shapes: ModelShapes,
    config,
    layout: Layout,
    capacity: int,
    kernels: str = "gpu",
    expert_load: float = 1.0,
    push: int | None = None,
) -> TrainerPlan:
    """The fullest stage's GPU of ``layout`` (every stage is computed; the largest total)."""
    gpus = config.cluster.trainer_gpus
    dp = gpus // (layout.tensor * layout.pipeline)
    expert_dp = gpus // (layout.pipeline * layout.expert)
    opt = config.optimizer
    distributed = True if opt.distributed is None else opt.distributed
    overlap = True if opt.overlap_grad_reduce is None else opt.overlap_grad_reduce
    d = DTYPE_BYTES[config.model.dtype]
    tokens, seq_len = micro_batch_shape(config, gpu=kernels == "gpu")
    push = push_extra_bytes(shapes, config) if push is None else push
    nvls = trainer_nvls_bytes(config, layout, dp, expert_dp)
    transfer, _ = transfer_buffer_bytes(config)
    best = None
    for stage in range(layout.pipeline):
        params = rank_parameters(
            shapes,
            tensor=layout.tensor,
            expert=layout.expert,
            pipeline=layout.pipeline,
            stage=stage,
            te=kernels == "gpu",
        )
        states = state_bytes(params, d, dp, expert_dp, distributed, overlap, stage=stage)
        settings = ActivationSettings(
            tokens=tokens,
            seq_len=seq_len,
            dtype_bytes=d,
            tensor=layout.tensor,
            sequence_parallel=layout.tensor > 1,
            expert=layout.expert,
            pipeline=layout.pipeline,
            stage=stage,
            fp32_head=config.model.fp32_head,
            recompute=layout.recompute,
            kernels=kernels,
            expert_load=expert_load,
        )
        acts = activation_bytes(shapes, settings)
        plan = TrainerPlan(
            layout,
            dp,
            expert_dp,
            stage,
            states,
            acts,
            push if stage == 0 else 0,
            TRAINER_RUNTIME_RESERVE,
            capacity,
            nvls=nvls,
            fragmentation=int(FRAGMENTATION * acts.peak),
            transfer=transfer if stage == 0 else 0,  # source ranks: first stage (m2n: PP 1)
        )
        if best is None or plan.total > best.total:
            best = plan
    return best


def _divisors(n: int, limit: int) -> list[int]:
    return [k for k in range(1, min(n, limit) + 1) if n % k == 0]


def candidate_layouts(shapes: ModelShapes, config) -> list[Layout]:
    """Layouts of the trainer's GPUs that pass every config check: TP up to 8 (one NVLink
    tray group), PP and EP dividing what they split, recompute on or off."""
    from megatron_rl.config import ConfigError
    from megatron_rl.config.checks import check_model_shapes

    gpus = config.cluster.trainer_gpus
    out = []
    tensors = _divisors(gpus, 8)
    pipelines = _divisors(shapes.layers, 8)
    experts = _divisors(shapes.experts, gpus) if shapes.is_moe else [1]
    for tp, pp, ep, rc in itertools.product(tensors, pipelines, experts, (False, True)):
        layout = Layout(tp, pp, ep, rc)
        trial = copy.deepcopy(config)
        trial.parallel = replace(
            trial.parallel, tensor=tp, pipeline=pp, expert=ep, sequence_parallel=tp > 1
        )
        trial.model = replace(trial.model, recompute_activations=rc)
        try:
            trial.parallel.validate()
            trial.validate()
            check_model_shapes(trial)
        except (ConfigError, ValueError):
            continue
        out.append(layout)
    return out


def change_cost(layout: Layout, current: Layout) -> tuple:
    """How big a change ``layout`` is from ``current``: fewer keys first, then no
    recompute (a third more compute), no extra pipeline stages (bubbles), less TP."""
    changed = layout.changes_from(current)
    keys = {k for k in changed if k != "parallel.sequence_parallel"}
    return (
        len(keys),
        layout.recompute and not current.recompute,
        layout.pipeline > current.pipeline,
        abs(layout.tensor - current.tensor),
        abs(layout.expert - current.expert),
    )


def plan_run(
    config,
    gpu: str | None = None,
    headroom: float = DEFAULT_HEADROOM,
    expert_load: float = 1.0,
    search: bool = True,
) -> Plan:
    """The memory plan of ``config`` (a RunConfig) on ``gpu`` (None: the recipe's
    ``cluster.gpu``); with ``search``, every valid layout that meets ``headroom``, smallest
    change first. ``expert_load``: see ``ActivationSettings``."""
    device = get_gpu(gpu or config.cluster.gpu)
    shapes = model_shapes(config.model)
    current = Layout.of(config)
    push = push_extra_bytes(shapes, config)
    trainer = plan_trainer(
        shapes,
        config,
        current,
        device.memory_bytes,
        expert_load=expert_load,
        push=push,
    )
    engine = _engine_plan(config, shapes, device)
    alternatives: list[TrainerPlan] = []
    if search:
        for layout in candidate_layouts(shapes, config):
            if layout == current:
                continue
            plan = plan_trainer(
                shapes,
                config,
                layout,
                device.memory_bytes,
                expert_load=expert_load,
                push=push,
            )
            if plan.headroom >= headroom:
                alternatives.append(plan)
        alternatives.sort(key=lambda p: (change_cost(p.layout, current), p.total))
    tokens, seq_len = micro_batch_shape(config)
    fix = None
    if engine.headroom < headroom:
        fix = engine_fix(config, shapes, device, engine, headroom)
    return Plan(
        config.name,
        shapes,
        device,
        headroom,
        trainer,
        engine,
        tokens,
        seq_len,
        tuple(alternatives),
        trainer_gpus=config.cluster.trainer_gpus,
        engines=config.rollout.engines,
        engine_tp=config.rollout.tensor_parallel,
        max_num_seqs=config.rollout.max_num_seqs,
        episode=episode_plan(config, kv_block_size(shapes.chunk)),
        engines_per_node=max(1, config.cluster.gpus_per_node // config.rollout.tensor_parallel),
        engine_fix=fix,
    )


def _engine_plan(config, shapes: ModelShapes, device) -> EnginePlan:
    return EnginePlan(
        engine_bytes(
            shapes,
            config.rollout,
            config.model.dtype,
            device.vllm_max_graph_size,
            config.cluster.engine_nccl_nvls,
        ),
        ENGINE_RUNTIME_RESERVE,
        device.memory_bytes,
        transfer=transfer_buffer_bytes(config)[1],
    )


def engine_fix(
    config, shapes: ModelShapes, device, engine: EnginePlan, headroom: float
) -> tuple[tuple[str, ...], EnginePlan] | None:
    """The smallest change that fits engines that do not: a smaller KV cache
    (``rollout.kv_cache_gb``, whole GiB) while it still holds a full-length sequence, else
    twice the engine's tensor parallelism (its weights and KV spread over more GPUs; the same
    GPUs hold half the engines), with the KV cache it then fits."""

    def with_rollout(**changes):
        return replace(config, rollout=replace(config.rollout, **changes))

    def fitting_kv(cfg, plan: EnginePlan) -> int | None:
        excess = plan.total - (1.0 - headroom) * plan.capacity
        kv = int((plan.bytes.kv_cache - max(excess, 0)) // GiB)
        if kv * GiB < plan.bytes.kv_bytes_per_sequence:
            return None
        return min(kv, int(cfg.rollout.kv_cache_gb))

    kv = fitting_kv(config, engine)
    if kv is not None:
        cfg = with_rollout(kv_cache_gb=float(kv))
        plan = _engine_plan(cfg, shapes, device)
        if plan.headroom >= headroom:
            return (f"rollout.kv_cache_gb={kv}",), plan
    tp = config.rollout.tensor_parallel * 2
    engines = config.rollout.engines // 2
    if engines < 1 or shapes.heads % tp:
        return None
    cfg = with_rollout(tensor_parallel=tp, engines=engines)
    plan = _engine_plan(cfg, shapes, device)
    changes = (f"rollout.tensor_parallel={tp}", f"rollout.engines={engines}")
    if plan.headroom >= headroom:
        return changes, plan
    kv = fitting_kv(cfg, plan)
    if kv is None:
        return None
    cfg = with_rollout(tensor_parallel=tp, engines=engines, kv_cache_gb=float(kv))
    plan = _engine_plan(cfg, shapes, device)
    return ((*changes, f"rollout.kv_cache_gb={kv}"), plan) if plan.headroom >= headroom else None
