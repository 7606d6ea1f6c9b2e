"""The simulator's cost model, in one place: hardware constants (with sources) and the time of
each thing the engines and the trainer do (no torch import).

Times, in seconds, of:

- a decode step of an engine running ``B`` sequences holding ``ctx`` context tokens in all
  (HBM roofline: every step reads the engine GPU's weights once and the KV cache of every
  running sequence; compute only matters if it is slower):

      max((weight_bytes + kv_read_bytes_per_token * ctx) / (HBM_bandwidth * HBM_EFFICIENCY),
          2 * active_params / tp * B / (peak_flops * DECODE_MFU)) + STEP_OVERHEAD

- a prefill of ``n`` prompt tokens (compute-bound): 2 * active_params / tp * n /
  (peak_flops * PREFILL_MFU);
- a train step on a batch (all trainer GPUs): 6 * active_params * tokens (8 x with full
  activation recompute: one more forward) plus causal attention, 3 (4) x sum over sequences
  and layers of 2 * d_attn * S * min(S, chunk), over (trainer_gpus * peak_flops * TRAIN_MFU),
  on every sequence of the batch, times ``SimSettings.trained_fraction`` (the trainer skips
  the groups of zero reward variance, ``trainer.step.policy_update``; the simulator has no
  rewards: the fraction is an input, 1.0 by default, an upper bound of the update's cost);
- a weight push: pushed bytes / link bandwidth (LINK_EFFICIENCY of it), once per push for a
  pipelined broadcast (NCCL), engines x for a serial push to one engine after another (the
  host transport before fan-out). The engines pause for the whole push (a conservative
  reading of "pause only to swap a bucket in"). Expert-parallel engines receive on each GPU
  only its experts, but the sender still emits every byte once: the push bytes are the
  model's either way.

For MoE models FLOPs use the *active* parameters (top-k routed experts + shared expert) and
weight bytes the *total* parameters (at decode batch sizes every expert is hit every step).

Two readings of the same model:

- **physical limit** (the defaults here): the roofline above with the efficiency factors
  below, which are assumptions; no published RL run reaches it.
- **expected** (``calibrated()``): generation and update slowed by factors fitted on published
  RL runs (``simulation/calibration.py``, ``tools/simulate_run.py --calibrate``), the
  fitted values stored below in ``CALIBRATED`` with the cases that fit them.

What-if switches for this project's own code (issue 31, items 2-4): ``push_bytes_per_s``
(today's host-path weight push, or one at link speed), ``kernel_slowdown`` (unfused kernels;
the calibrated MFU is that of a trainer with them) and, in ``run.SimSettings``, how groups go to
data-parallel ranks (``dp_assignment``).

Every constant cites its source or says ``assumption``; ``tests/unit/simulation/test_simulation.py`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_rl.planning.engine import engine_bytes, engine_weight_elements
from megatron_rl.planning.gpus import GPUS
from megatron_rl.planning.shapes import DTYPE_BYTES, ModelShapes

TB = 10**12  # source: SI (datasheets give decimal TB/s)
GB = 10**9  # source: SI


@dataclass(frozen=True)
class Hardware:
    """One GPU model and its links (per GPU, one direction)."""

    name: str
    hbm_bytes_per_s: float
    bf16_dense_flops: float
    memory_bytes: int
    nvlink_bytes_per_s: float
    ib_bytes_per_s: float
    nvlink_domain_gpus: int
    source: str


# Every number below carries its source ("source:") or says it is ours ("assumption:"), on its
# line or in the comment right above it; tests/unit/simulation/test_simulation.py checks that none is bare.
# Links are per GPU and per direction (NVLink's datasheet figures count both directions).
HARDWARE: dict[str, Hardware] = {
    "gb200": Hardware(
        name="gb200",
        # source: GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72): 576 TB/s
        # HBM3e for 72 GPUs
        hbm_bytes_per_s=8.0 * TB,
        # source: same datasheet, FP16/BF16 Tensor Core 360 PFLOPS per rack *with sparsity*:
        # 2.5 PFLOPS dense per GPU
        bf16_dense_flops=2.5e15,
        memory_bytes=GPUS["gb200"].memory_bytes,  # source: planning/gpus.py (nvidia-smi)
        # source: same datasheet, NVLink 5 1.8 TB/s per GPU both directions
        nvlink_bytes_per_s=900 * GB,
        # source: GB200 compute tray, ConnectX-7 400 Gb/s InfiniBand per GPU
        ib_bytes_per_s=50 * GB,
        nvlink_domain_gpus=72,  # source: NVL72, one NVLink domain per rack
        source="GB200 NVL72 datasheet; ConnectX-7 400 Gb/s per GPU",
    ),
    "h200": Hardware(
        name="h200",
        hbm_bytes_per_s=4.8 * TB,  # source: H200 SXM datasheet (nvidia.com/en-us/data-center/h200)
        # source: same datasheet, BF16 Tensor Core 1,979 TFLOPS with sparsity: 989 dense
        bf16_dense_flops=0.989e15,
        memory_bytes=GPUS["h200"].memory_bytes,  # source: planning/gpus.py (nvidia-smi)
        # source: same datasheet, NVLink 900 GB/s both directions in an 8-GPU HGX board
        nvlink_bytes_per_s=450 * GB,
        ib_bytes_per_s=50 * GB,  # source: DGX/HGX H200, one NDR 400 Gb/s adapter per GPU
        nvlink_domain_gpus=8,  # source: HGX H200 8-GPU board
        source="H200 SXM datasheet; HGX H200 8-GPU NVLink; NDR 400 Gb/s per GPU",
    ),
    "h100": Hardware(
        name="h100",
        # source: H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): 3.35 TB/s HBM3
        hbm_bytes_per_s=3.35 * TB,
        # source: same datasheet, BF16 Tensor Core 1,979 TFLOPS with sparsity: 989 dense
        bf16_dense_flops=0.989e15,
        memory_bytes=GPUS["h100"].memory_bytes,  # source: planning/gpus.py (nvidia-smi)
        # source: same datasheet, NVLink 900 GB/s both directions (4th generation, HGX board)
        nvlink_bytes_per_s=450 * GB,
        ib_bytes_per_s=50 * GB,  # source: DGX H100, eight ConnectX-7 NDR 400 Gb/s per 8 GPUs
        nvlink_domain_gpus=8,  # source: DGX H100 / HGX H100 8-GPU board
        source="H100 SXM5 datasheet; DGX H100 (8 GPUs, NDR 400 Gb/s per GPU)",
    ),
}

# The physical limit's efficiency factors: fractions of the peak each kind of work reaches.
# assumption: vLLM decode kernels (weights GEMV + paged attention) vs HBM peak
HBM_EFFICIENCY = 0.7
DECODE_MFU = 0.5  # assumption: decode GEMMs when a step is compute-bound (large batches)
PREFILL_MFU = 0.5  # assumption: chunked prefill GEMMs
# assumption: Megatron-Core dense Llama training, BF16, long packed sequences
TRAIN_MFU_DENSE = 0.40
TRAIN_MFU_MOE = 0.30  # assumption: MoE (all-to-all, grouped GEMMs) runs below dense
STEP_OVERHEAD = 0.002  # assumption: per decode step: scheduler, sampler, CUDA-graph launch (s)
LINK_EFFICIENCY = 0.8  # assumption: NCCL bus bandwidth vs link peak on large messages

# The expected (calibrated) model: factors fitted by `tools/simulate_run.py --calibrate`
# (simulation/calibration.py: `fit`) on the published runs named with each; they replace the
# physical limit's. Refit (`--calibrate --refit`) and paste when the cost model or a case
# changes; test_calibration_cases_reproduce_published_runs says when they are stale. The two
# dense cases pin a ridge, not a point: refits from other starts land within ~7% of these.
CALIBRATED = {
    # fitted: NeMo-RL v0.4 Llama-3.1-8B GRPO on 16 H100, on-policy (97.7 s a step) and one
    # step off-policy (74.6 s); multiplies the speed of every decode step and prefill
    "generation_efficiency": 0.6429,
    # fitted: the same two cases; Megatron-Core MFU of their update (PP 2, recompute, BF16;
    # recompute and the two log-prob forwards counted as work done)
    "train_mfu_dense": 0.4364,
    # fitted: NeMo-RL v0.6 Qwen3-30B-A3B GRPO on 16 GB200 (1,910 tokens/s/GPU) and on 32 H100
    # (1,102), least squares with the two factors above (neither exactly: +18% / -16%)
    "train_mfu_moe": 0.0729,
}

# What-if switches for this project's code today (issue 31, items 2-4).
# source: issue 31 section 2, `check-parity` on the CPU machine: a 542 MB fp32 model pushed in
# 0.58 s (0.93 GB/s), bandwidth-bound through host memory (`.cpu()`, pageable uploads);
# assumption: the GPU path's host copies (one exporting rank, CPU stacking) are no faster
HOST_PUSH_BYTES_PER_S = 1 * GB
# source: issue 31 section 4's estimate, 5-15% of trainer throughput from the fusions
# (gradient-accumulation, RoPE, bias-activation, masked softmax, grouped GEMM) we turn off;
# assumption: the middle of that range, and NeMo-RL's calibrated MFU has them on
UNFUSED_KERNEL_SLOWDOWN = 1.10


def active_parameters(shapes: ModelShapes) -> int:
    """Parameters a token's matmuls touch: every weight but the input embedding, and of the
    routed experts only the top-k (MoE)."""
    s = shapes
    total = s.total_parameters() - s.vocab * s.hidden  # input embedding is a lookup
    if s.tied_embeddings:
        total += s.vocab * s.hidden  # the tied head still multiplies
    per_expert = 3 * s.hidden * s.expert_ffn
    inactive = sum(1 for m in s.moe if m) * (s.experts - s.topk) * per_expert
    return total - inactive


@dataclass(frozen=True)
class CostModel:
    """Seconds of engine and trainer work for one recipe on one kind of GPU."""

    hardware: Hardware
    total_params: int
    active_params: int
    engine_tp: int
    engine_weight_bytes: int  # per engine GPU
    kv_read_bytes_per_token: float  # per engine GPU, per context token, one step
    kv_capacity_tokens: int  # per engine (what the KV cache holds)
    push_bytes: int
    trainer_gpus: int
    attention_dims: tuple[tuple[int, int | None], ...]  # per layer: (d_attn, chunk)
    recompute: bool
    hbm_efficiency: float = HBM_EFFICIENCY
    decode_mfu: float = DECODE_MFU
    prefill_mfu: float = PREFILL_MFU
    train_mfu: float = TRAIN_MFU_DENSE
    step_overhead: float = STEP_OVERHEAD
    link_efficiency: float = LINK_EFFICIENCY
    push_link: str = "ib"  # "ib" or "nvlink": the slowest link between trainers and engines
    push_transport: str = "broadcast"  # "broadcast" (pipelined, once) or "serial" (per engine)
    engines: int = 1
    moe: bool = False
    # Expected-model factors (1.0, 0: the physical limit): generation runs at this fraction of
    # the roofline's speed (decode steps and prefills); the update makes this many extra
    # forward passes over the batch (a framework computing old and reference log-probs: 2).
    generation_efficiency: float = 1.0
    logprob_passes: int = 0
    # What-if switches: the update is this much slower (unfused kernels: UNFUSED_KERNEL_SLOWDOWN);
    # the push moves this many bytes/s end to end (None: the link at link_efficiency;
    # HOST_PUSH_BYTES_PER_S: today's host path).
    kernel_slowdown: float = 1.0
    push_bytes_per_s: float | None = None

    def with_(self, **changes) -> CostModel:
        return replace(self, **changes)

    def decode_step(self, batch: int, context_tokens: float) -> float:
        """One decode step of an engine running ``batch`` sequences with ``context_tokens``
        tokens (prompt + generated) in their KV cache in all."""
        hw = self.hardware
        memory = (self.engine_weight_bytes + self.kv_read_bytes_per_token * context_tokens) / (
            hw.hbm_bytes_per_s * self.hbm_efficiency
        )
        compute = (
            2
            * self.active_params
            / self.engine_tp
            * batch
            / (hw.bf16_dense_flops * self.decode_mfu)
        )
        return max(memory, compute) / self.generation_efficiency + self.step_overhead

    def prefill(self, tokens: int) -> float:
        """Prefill of ``tokens`` prompt tokens on one engine (its TP GPUs together)."""
        flops = 2 * self.active_params * tokens / self.engine_tp
        return flops / (
            self.hardware.bf16_dense_flops * self.prefill_mfu * self.generation_efficiency
        )

    def train_flops(self, sequence_lengths: list[int]) -> float:
        """FLOPs of one update on sequences of these lengths (prompt + response)."""
        passes = 4 if self.recompute else 3  # forward + backward (2x forward) [+ recompute]
        passes += self.logprob_passes
        dense = 2 * passes * self.active_params * sum(sequence_lengths)
        attention = 0.0
        for s in sequence_lengths:
            attention += sum(2 * d * s * min(s, c or s) for d, c in self.attention_dims)
        return dense + passes * attention

    def train_step(self, sequence_lengths: list[int]) -> float:
        """Seconds of one update on all trainer GPUs."""
        peak = self.trainer_gpus * self.hardware.bf16_dense_flops * self.train_mfu
        return self.train_flops(sequence_lengths) / peak * self.kernel_slowdown

    def push(self) -> float:
        """Seconds of one weight push, trainer to every engine."""
        hw = self.hardware
        link = hw.nvlink_bytes_per_s if self.push_link == "nvlink" else hw.ib_bytes_per_s
        rate = self.push_bytes_per_s or link * self.link_efficiency
        copies = self.engines if self.push_transport == "serial" else 1
        return copies * self.push_bytes / rate

    def calibrated(self) -> CostModel:
        """The expected model: the factors fitted on published runs (``CALIBRATED``) in place
        of the physical limit's generation speed and training MFU."""
        return self.with_(
            generation_efficiency=CALIBRATED["generation_efficiency"],
            train_mfu=CALIBRATED["train_mfu_moe" if self.moe else "train_mfu_dense"],
        )


def build_cost_model(
    shapes: ModelShapes,
    hardware: str,
    *,
    engine_tp: int,
    engines: int,
    trainer_gpus: int,
    kv_cache_bytes: int,
    max_model_len: int,
    recompute: bool,
    all_gpus: int,
    dtype: str = "bfloat16",
    expert_parallel: bool = False,
) -> CostModel:
    """The physical-limit cost model of a model's ``shapes`` on ``hardware`` with this engine
    and trainer layout (what ``cost_model`` reads from a recipe; the calibration cases call it
    with the published runs' layouts)."""
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(HARDWARE))}")
    hw = HARDWARE[hardware]
    d = DTYPE_BYTES[dtype]
    kv = max(shapes.kv_heads // engine_tp, 1)
    per_seq = sum(
        2 * kv * shapes.head_dim * d * min(max_model_len, shapes.chunk[i] or max_model_len)
        for i in range(shapes.layers)
    )
    # Engine GPUs read this GPU's KV share; a full-length sequence's bytes over its length
    # average the chunked-attention layers (which keep at most a chunk) over the sequence.
    kv_per_token = per_seq / max_model_len
    d_attn = shapes.heads * shapes.head_dim
    return CostModel(
        hardware=hw,
        total_params=shapes.total_parameters(),
        active_params=active_parameters(shapes),
        engine_tp=engine_tp,
        engine_weight_bytes=engine_weight_elements(shapes, engine_tp, expert_parallel) * d,
        kv_read_bytes_per_token=kv_per_token,
        kv_capacity_tokens=int(kv_cache_bytes // kv_per_token) if kv_per_token else 2**62,
        # the FP32 head too is pushed in the model dtype
        push_bytes=shapes.total_parameters() * d,
        trainer_gpus=trainer_gpus,
        attention_dims=tuple((d_attn, c) for c in shapes.chunk),
        recompute=recompute,
        train_mfu=TRAIN_MFU_MOE if shapes.is_moe else TRAIN_MFU_DENSE,
        push_link="nvlink" if all_gpus <= hw.nvlink_domain_gpus else "ib",
        engines=engines,
        moe=shapes.is_moe,
    )


def cost_model(config, hardware: str = "gb200") -> CostModel:
    """The physical-limit cost model of a recipe (``RunConfig``) on ``hardware`` (a key of
    ``HARDWARE``); ``.calibrated()`` gives the expected one."""
    from megatron_rl.planning.shapes import model_shapes

    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(HARDWARE))}")
    shapes = model_shapes(config.model)
    rollout = config.rollout
    dtype = config.model.dtype if rollout.dtype == "auto" else rollout.dtype
    eb = engine_bytes(shapes, rollout, config.model.dtype)
    cluster = config.cluster
    return build_cost_model(
        shapes,
        hardware,
        engine_tp=rollout.tensor_parallel,
        engines=rollout.engines,
        trainer_gpus=cluster.trainer_gpus,
        kv_cache_bytes=eb.kv_cache,
        max_model_len=rollout.max_model_len or 16384,
        recompute=bool(config.model.recompute_activations),
        all_gpus=cluster.trainer_gpus + cluster.generator_gpus,
        dtype=dtype,
        expert_parallel=rollout.expert_parallel,
    )
