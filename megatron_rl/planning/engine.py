"""Memory of one GPU of a vLLM engine (no torch import).

- Weights: the model split ``rollout.tensor_parallel`` ways as vLLM does (embedding, head,
  attention heads, MLP and every expert's width; KV heads replicated when fewer than TP;
  norms and the router whole). With ``rollout.expert_parallel`` the routed experts are
  placed whole instead, ``tensor_parallel`` GPUs sharing them (the fullest GPU is counted). The FP32 head costs nothing extra on CUDA: vLLM keeps the
  head weight in the model dtype and accumulates in fp32 (GPU.md), and the trainer pushes it
  in the model dtype.
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

    @property
    def parts(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "KV cache": self.kv_cache,
            "weight receive buffers": self.receive_buffers,
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
    weights = engine_weight_elements(s, tp, rollout.expert_parallel) * d
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
    )
