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

Efficiency factors are ours (assumptions, stated, not measured on a GB200); override them
with ``CostModel(..., train_mfu=...)`` or the tool's flags.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_rl.planning.engine import engine_bytes, engine_weight_elements
from megatron_rl.planning.gpus import GPUS
from megatron_rl.planning.shapes import DTYPE_BYTES, ModelShapes

TB = 10**12
GB = 10**9


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


HARDWARE: dict[str, Hardware] = {
    # GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72): 72 GPUs with
    # 576 TB/s HBM3e (8 TB/s each), 13.4 TB HBM3e (186 GB each), FP16/BF16 Tensor Core
    # 360 PFLOPS for the rack *with sparsity* -> 2.5 PFLOPS dense per GPU, NVLink 5
    # 130 TB/s (1.8 TB/s per GPU both directions, 900 GB/s each way). Compute trays:
    # ConnectX-7 400 Gb/s InfiniBand per GPU (50 GB/s).
    "gb200": Hardware(
        "gb200",
        8.0 * TB,
        2.5e15,
        GPUS["gb200"].memory_bytes,
        900 * GB,
        50 * GB,
        72,
        "GB200 NVL72 datasheet; ConnectX-7 400 Gb/s per GPU",
    ),
    # H200 SXM datasheet (nvidia.com/en-us/data-center/h200): 4.8 TB/s HBM3e, 141 GB,
    # BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 TFLOPS dense, NVLink 900 GB/s
    # (both directions: 450 GB/s each way) within an 8-GPU HGX board; NDR 400 Gb/s per GPU.
    "h200": Hardware(
        "h200",
        4.8 * TB,
        0.989e15,
        GPUS["h200"].memory_bytes,
        450 * GB,
        50 * GB,
        8,
        "H200 SXM datasheet; HGX H200 8-GPU NVLink; NDR 400 Gb/s per GPU",
    ),
}

# Assumptions (ours): fraction of the peak each kind of work reaches.
HBM_EFFICIENCY = 0.7  # vLLM decode kernels (weights GEMV + paged attention) vs HBM peak
DECODE_MFU = 0.5  # decode GEMMs when a step is compute-bound (large batches)
PREFILL_MFU = 0.5  # chunked prefill GEMMs
TRAIN_MFU_DENSE = 0.40  # Megatron-Core dense Llama training, BF16, long packed sequences
TRAIN_MFU_MOE = 0.30  # MoE (all-to-all, grouped GEMMs) runs below dense
STEP_OVERHEAD = 0.002  # per decode step: scheduler, sampler, CUDA-graph launch (s)
LINK_EFFICIENCY = 0.8  # NCCL bus bandwidth vs link peak on large messages


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
        return max(memory, compute) + self.step_overhead

    def prefill(self, tokens: int) -> float:
        """Prefill of ``tokens`` prompt tokens on one engine (its TP GPUs together)."""
        flops = 2 * self.active_params * tokens / self.engine_tp
        return flops / (self.hardware.bf16_dense_flops * self.prefill_mfu)

    def train_flops(self, sequence_lengths: list[int]) -> float:
        """FLOPs of one update on sequences of these lengths (prompt + response)."""
        passes = 4 if self.recompute else 3  # forward + backward (2x forward) [+ recompute]
        dense = 2 * passes * self.active_params * sum(sequence_lengths)
        attention = 0.0
        for s in sequence_lengths:
            attention += sum(2 * d * s * min(s, c or s) for d, c in self.attention_dims)
        return dense + passes * attention

    def train_step(self, sequence_lengths: list[int]) -> float:
        """Seconds of one update on all trainer GPUs."""
        peak = self.trainer_gpus * self.hardware.bf16_dense_flops * self.train_mfu
        return self.train_flops(sequence_lengths) / peak

    def push(self) -> float:
        """Seconds of one weight push, trainer to every engine."""
        hw = self.hardware
        link = hw.nvlink_bytes_per_s if self.push_link == "nvlink" else hw.ib_bytes_per_s
        copies = self.engines if self.push_transport == "serial" else 1
        return copies * self.push_bytes / (link * self.link_efficiency)


def cost_model(config, hardware: str = "gb200") -> CostModel:
    """The cost model of a recipe (``RunConfig``) on ``hardware`` ("gb200" or "h200")."""
    from megatron_rl.planning.shapes import model_shapes

    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(sorted(HARDWARE))}")
    hw = HARDWARE[hardware]
    shapes = model_shapes(config.model)
    rollout = config.rollout
    dtype = config.model.dtype if rollout.dtype == "auto" else rollout.dtype
    d = DTYPE_BYTES[dtype]
    eb = engine_bytes(shapes, rollout, config.model.dtype)
    length = rollout.max_model_len or 16384
    # Engine GPUs read this GPU's KV share; a full-length sequence's bytes over its length
    # average the chunked-attention layers (which keep at most a chunk) over the sequence.
    kv_per_token = eb.kv_bytes_per_sequence / length
    push = shapes.total_parameters() * d  # the FP32 head too is pushed in the model dtype
    d_attn = shapes.heads * shapes.head_dim
    cluster = config.cluster
    all_gpus = cluster.trainer_gpus + cluster.generator_gpus
    return CostModel(
        hardware=hw,
        total_params=shapes.total_parameters(),
        active_params=active_parameters(shapes),
        engine_tp=rollout.tensor_parallel,
        engine_weight_bytes=engine_weight_elements(
            shapes, rollout.tensor_parallel, rollout.expert_parallel
        )
        * d,
        kv_read_bytes_per_token=kv_per_token,
        kv_capacity_tokens=int(eb.kv_cache // kv_per_token) if kv_per_token else 2**62,
        push_bytes=push,
        trainer_gpus=cluster.trainer_gpus,
        attention_dims=tuple((d_attn, c) for c in shapes.chunk),
        recompute=bool(config.model.recompute_activations),
        train_mfu=TRAIN_MFU_MOE if shapes.is_moe else TRAIN_MFU_DENSE,
        push_link="nvlink" if all_gpus <= hw.nvlink_domain_gpus else "ib",
        engines=rollout.engines,
    )
