"""Memory of one GPU of a vLLM engine (no torch import).

- Weights: the model split ``rollout.tensor_parallel`` ways as vLLM does (embedding, head,
  attention heads, MLP and every expert's width; KV heads replicated when fewer than TP;
  norms and the router whole). With ``rollout.expert_parallel`` the routed experts are
  placed whole instead, ``tensor_parallel`` GPUs sharing them (the fullest GPU is counted). The FP32 head costs nothing extra on CUDA: vLLM keeps the
  head weight in the model dtype and accumulates in fp32 (GPU.md), and the trainer pushes it
  in the model dtype.
  With ``rollout.quantization`` (FP8 rollouts, ``megatron_rl.rollout.quantization``) the
  linear layers' weights (attention and MLP projections, every expert) are 1 byte each plus
  their float32 scales (one per layer, per expert for routed experts; ``fp8_block``: one per
  128 x 128 block), while embeddings, head, norms and routers keep the model dtype. The bytes
  this frees (``fp8_freed``) are what ``rollout.kv_cache_gb`` can grow by at the same total:
  the report says to how many full-length sequences.
- FP8 reload workspace (``rollout.quantization`` only): a push quantizes on the engine, one
  layer at a time (vLLM's layerwise reload materialises the layer in the model dtype, then
  the quantizer writes its FP8 copy; ``fp8_block`` also makes two float32 intermediates of a
  weight, vLLM ``per_block_cast_to_fp8``): the largest layer's model-dtype and FP8 bytes plus,
  for ``fp8_block``, two float32 copies of its largest weight.
- KV cache: ``rollout.kv_cache_gb`` GiB, which ``megatron_rl.rollout.engine.vllm_engine`` hands vLLM as
  ``kv_cache_memory_bytes`` ("Size of KV Cache per GPU in bytes", vllm/config/cache.py).
  The plan also says how many full-length sequences that holds against ``max_num_seqs``.
- Receive buffers of a weight push: vLLM's packed NCCL consumer
  (``weight_transfer/packed_tensor.py``) keeps ``packed_num_buffers`` = 2 buffers, each at
  least the bucket size and overshooting it by at most one tensor; the host path queues 2
  buckets per engine (``rollout.pool.launchers.WEIGHT_QUEUE_DEPTH``). Counted as 2 x (bucket +
  largest pushed tensor).
- Forward workspace (estimate): vLLM's profile run at ``max_num_batched_tokens`` (16384 on
  GPUs with >= 70 GB, vllm/engine/arg_utils.py) and fp32 sampler logits for
  ``max_num_seqs`` sequences.
- CUDA graphs (unless ``rollout.enforce_eager``): vLLM captures one graph per batch size of
  [1, 2, 4] + multiples of 8 to 256 + multiples of 16 to min(2 x max_num_seqs, 512 or 1024 on
  Blackwell) (vllm/config/vllm.py ``_set_cudagraph_sizes``), in two modes (FULL for decode
  batches, PIECEWISE for mixed ones: the default FULL_AND_PIECEWISE). Counted as vLLM's own
  profile counts them (gpu_model_runner.profile_cudagraph_memory): the first capture's pool,
  here the forward workspace at the largest size, plus a per-capture cost
  (``gpus.CUDA_GRAPH_BYTES_PER_CAPTURE``, an assumption) for every other capture. vLLM takes
  them from memory outside the KV cache we fix with ``kv_cache_memory_bytes``.
- NVLS buffers (``cluster.engine_nccl_nvls`` only; the sbatch scripts turn NVLS off on
  engines otherwise): one NVLS communicator, the engine's TP group.
- Fragmentation of the workspace (``gpus.FRAGMENTATION``, an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.planning.gpus import (
    CUDA_GRAPH_BYTES_PER_CAPTURE,
    FRAGMENTATION,
    NVLS_BYTES_PER_COMMUNICATOR,
)
from megatron_rl.planning.shapes import DTYPE_BYTES, ModelShapes
from megatron_rl.rollout.quantization import BLOCK

FP32 = 4
VLLM_MAX_NUM_BATCHED_TOKENS = 16384
WEIGHT_BUFFERS = 2


@dataclass(frozen=True)
class EngineBytes:
    """One engine GPU: bytes by part, and the KV cache's capacity."""

    weights: int
    kv_cache: int
    receive_buffers: int
    workspace: int
    kv_bytes_per_sequence: int  # one sequence of max_model_len tokens, this GPU's share
    sequences_in_kv: int  # full-length sequences the KV cache holds
    largest_tensor: str
    cuda_graphs: int = 0
    graph_captures: int = 0  # batch sizes x modes vLLM captures (0: enforce_eager)
    nvls: int = 0
    fragmentation: int = 0
    reload_workspace: int = 0  # FP8 rollouts: quantizing the largest layer during a push
    fp8_freed: int = 0  # FP8 rollouts: weight bytes saved against the model dtype
    quantization: str | None = None

    @property
    def parts(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "KV cache": self.kv_cache,
            "weight receive buffers": self.receive_buffers,
            "FP8 reload workspace (estimate)": self.reload_workspace,
            "forward workspace (estimate)": self.workspace,
            "CUDA graphs (estimate)": self.cuda_graphs,
            "NVLS buffers (estimate)": self.nvls,
            "allocator fragmentation (estimate)": self.fragmentation,
        }


def cuda_graph_sizes(max_num_seqs: int, max_graph_size: int = 512) -> list[int]:
    """The batch sizes vLLM 0.32 captures by default (vllm/config/vllm.py
    ``_set_cudagraph_sizes``, decode query length 1)."""
    largest = min(max_num_seqs * 2, max_graph_size)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [n for n in sizes if n <= largest]


def engine_weight_elements(shapes: ModelShapes, tp: int, expert_parallel: bool = False) -> int:
    """Weight elements on one GPU of an engine with tensor parallelism ``tp``; with
    ``expert_parallel`` the routed experts are not split in width but placed whole, ``tp``
    ranks sharing them (vLLM's linear placement: the first ranks take one more when ``tp``
    does not divide them; counted here for the fullest GPU)."""
    s = shapes
    h, hd = s.hidden, s.head_dim
    kv = max(s.kv_heads // tp, 1)
    total = 2 * (s.vocab // tp) * h if not s.tied_embeddings else (s.vocab // tp) * h
    total += h  # final norm
    for i in range(s.layers):
        total += 2 * h + (s.heads // tp + 2 * kv) * hd * h + h * (s.heads // tp) * hd
        if s.moe[i]:
            total += s.experts * h  # router, whole on every GPU
            if expert_parallel:
                total += -(-s.experts // tp) * 3 * h * s.expert_ffn
            else:
                total += s.experts * 3 * h * (s.expert_ffn // tp)
            total += 3 * h * (s.shared_ffn // tp)
        else:
            total += 3 * h * (s.ffn // tp)
    return total


def engine_linear_matrices(
    shapes: ModelShapes, tp: int, expert_parallel: bool = False
) -> list[list[tuple[int, int, int]]]:
    """Per decoder layer, the linear weights vLLM quantizes on one engine GPU as (rows, cols,
    count): fused qkv and o projections, fused gate_up and down projections of the MLP, the
    shared expert, and every local routed expert's w13 / w2 (count: local experts). Their
    elements are part of :func:`engine_weight_elements`."""
    s = shapes
    h, hd = s.hidden, s.head_dim
    kv = max(s.kv_heads // tp, 1)
    layers = []
    for i in range(s.layers):
        mats = [((s.heads // tp + 2 * kv) * hd, h, 1), (h, (s.heads // tp) * hd, 1)]
        if s.moe[i]:
            if expert_parallel:
                local, f = -(-s.experts // tp), s.expert_ffn
            else:
                local, f = s.experts, s.expert_ffn // tp
            mats += [(2 * f, h, local), (h, f, local)]
            if s.shared_ffn:
                mats += [(2 * (s.shared_ffn // tp), h, 1), (h, s.shared_ffn // tp, 1)]
        else:
            mats += [(2 * (s.ffn // tp), h, 1), (h, s.ffn // tp, 1)]
        layers.append([m for m in mats if m[0] and m[1] and m[2]])
    return layers


def _fp8_bytes(rows: int, cols: int, count: int, quantization: str) -> int:
    """FP8 bytes of ``count`` [rows, cols] weights with their float32 scales."""
    if quantization == "fp8_block":
        scales = -(-rows // BLOCK[0]) * -(-cols // BLOCK[1])
    else:
        scales = 1  # fp8: one per layer (per expert for routed experts)
    return count * (rows * cols + 4 * scales)


def engine_weight_bytes(
    shapes: ModelShapes,
    tp: int,
    dtype_bytes: int,
    expert_parallel: bool = False,
    quantization: str | None = None,
) -> tuple[int, int]:
    """(weight bytes, FP8 reload workspace bytes) of one engine GPU: the model dtype's
    ``dtype_bytes`` per element, or with ``quantization`` (``rollout.quantization``) the
    linear weights in FP8 with their scales (see the module docstring)."""
    total = engine_weight_elements(shapes, tp, expert_parallel) * dtype_bytes
    if quantization is None:
        return total, 0
    layers = engine_linear_matrices(shapes, tp, expert_parallel)
    workspace = 0
    for mats in layers:
        unquantized = sum(r * c * n for r, c, n in mats) * dtype_bytes
        fp8 = sum(_fp8_bytes(r, c, n, quantization) for r, c, n in mats)
        total += fp8 - unquantized
        layer = unquantized + fp8
        if quantization == "fp8_block":  # two float32 intermediates of the largest weight
            r, c, _ = max(mats, key=lambda m: m[0] * m[1])
            layer += 2 * 4 * (-(-r // BLOCK[0]) * BLOCK[0]) * (-(-c // BLOCK[1]) * BLOCK[1])
        workspace = max(workspace, layer)
    return total, workspace


def largest_pushed_tensor(shapes: ModelShapes, dtype_bytes: int) -> tuple[int, str]:
    """Bytes and name of the largest HF-named tensor of a weight push (full, unsplit)."""
    s = shapes
    options = {"lm_head": s.vocab * s.hidden * dtype_bytes}
    if s.is_moe:  # HF Llama-4 packs a layer's experts: gate_up_proj [E, h, 2 f]
        options["experts.gate_up_proj"] = s.experts * s.hidden * 2 * s.expert_ffn * dtype_bytes
    if any(not m for m in s.moe):
        options["mlp.gate_proj"] = s.ffn * s.hidden * dtype_bytes
    name = max(options, key=options.get)
    return options[name], name


def engine_bytes(
    shapes: ModelShapes,
    rollout,
    model_dtype: str,
    max_graph_size: int = 512,
    nvls: bool = False,
) -> EngineBytes:
    """Memory of one GPU of an engine of ``rollout`` (``RolloutConfig``); ``max_graph_size``:
    vLLM's default largest CUDA-graph batch on the GPU (``gpus.GPU``); ``nvls``: the engines
    run NCCL with NVLS (``cluster.engine_nccl_nvls``)."""
    s, tp = shapes, rollout.tensor_parallel
    dtype = model_dtype if rollout.dtype == "auto" else rollout.dtype
    d = DTYPE_BYTES[dtype]
    quantization = getattr(rollout, "quantization", None)
    weights, reload_workspace = engine_weight_bytes(s, tp, d, rollout.expert_parallel, quantization)
    unquantized = engine_weight_elements(s, tp, rollout.expert_parallel) * d
    kv_cache = int(rollout.kv_cache_gb * 2**30)
    length = rollout.max_model_len or 2**31
    kv = max(s.kv_heads // tp, 1)
    per_seq = sum(
        2 * kv * s.head_dim * d * min(length, s.chunk[i] or length) for i in range(s.layers)
    )
    largest, name = largest_pushed_tensor(s, d)
    receive = WEIGHT_BUFFERS * (rollout.weight_bucket_bytes_on(gpu=True) + largest)
    ffn = max([s.ffn] + ([s.expert_ffn * s.topk + s.shared_ffn] if s.is_moe else []))
    per_token = (2 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim // tp + 3 * ffn // tp) * d
    workspace = VLLM_MAX_NUM_BATCHED_TOKENS * per_token
    workspace += 2 * rollout.max_num_seqs * s.vocab * FP32  # fp32 logits and log-probs
    graphs = captures = 0
    if not rollout.enforce_eager:
        sizes = cuda_graph_sizes(rollout.max_num_seqs, max_graph_size)
        captures = 2 * len(sizes)  # FULL and PIECEWISE
        pool = max(sizes) * per_token + 2 * max(sizes) * (s.vocab // tp) * FP32
        graphs = pool + (captures - 1) * CUDA_GRAPH_BYTES_PER_CAPTURE
    return EngineBytes(
        weights=weights,
        kv_cache=kv_cache,
        receive_buffers=receive,
        workspace=workspace,
        kv_bytes_per_sequence=per_seq,
        sequences_in_kv=kv_cache // per_seq if per_seq else 0,
        largest_tensor=name,
        cuda_graphs=graphs,
        graph_captures=captures,
        nvls=NVLS_BYTES_PER_COMMUNICATOR if nvls and tp > 1 else 0,
        fragmentation=int(FRAGMENTATION * workspace),
        reload_workspace=reload_workspace,
        fp8_freed=unquantized - weights,
        quantization=quantization,
    )
