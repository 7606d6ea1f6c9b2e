"""Activation memory of one trainer rank for one micro-batch (no torch import).

The method is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv 2205.05198), section 4: count, tensor by tensor, what each
operation of a layer saves for its backward; with tensor parallelism t and sequence
parallelism every per-layer term is divided by t. Their per-layer total, sbh(34 + 5as/h)
bytes, is for a GPT layer with dropout, multi-head attention and a 4h GELU MLP. Ours is the
same count redone for the layers megatron-core 0.16.1 builds for Llama-3 / Llama-4 in this
project (``megatron_rl.models``): no dropout, RMSNorm, GQA with RoPE, SwiGLU computed by
megatron's unfused ``glu`` (bias_activation_fusion is off), FP32 head, and MoE layers
(alltoall dispatch, experts of full width under expert-TP 1, shared expert, probabilities
applied on the expert input). Per token, with d the activation dtype's bytes, T tokens per
micro-batch and s the sequence length (quantities with /t are per tensor-parallel rank):

attention block
    norm input + output         2 h d + 4       (rstd; + h d: torch's CPU RMSNorm saves x*rstd)
    fused qkv output            (nq + 2 nkv) hd d   (kept alive by the v view the kernel saves)
    RoPE'd q and k              (nq + nkv) hd d     (RoPE layers)
    qk L2 norm (Llama-4)        nq hd d + 4 (nq + nkv)   (reshaped q, per-head rsqrt)
    temperature-scaled q        nq hd d             (Llama-4 NoPE layers)
    flash attention             nq hd d + 4 nq      (output, log-sum-exp)
    chunked attention (Llama-4, sequences longer than a chunk: block-diagonal causal SDPA over
    the chunks as a batch, ``megatron_rl.models.attention``): the chunk-major copies of q, k,
    v, (nq + 2 nkv) hd d, and the output copied back to [s, b, h hd], nq hd d; the RoPE'd q, k
    and the qkv output stay saved only through a last partial chunk (or the k norm).
dense MLP                       2 h d (norm) + 2 f d (fc1) + 3 f d (silu, x_linear, product)
MoE layer                       2 h d (norm) + 5 f_shared d + 9 E + 8 k + 8 (router, routing)
                                + k (2 h d + 5 f_expert d + 4) per routed token (on its
                                expert's rank; balanced routing assumed: ``expert_load``)
FP32 head                       h d + 4 (final norm) + h 4 (upcast input) + V 4 (softmax
                                saved by the vocab-parallel cross entropy) + 17 (targets,
                                masks); per micro-batch, the fp32 copy of the model-dtype head
                                weight the output layer saves (V h 4 / t)

Transient (not saved, alive at the peak): the logits in the model's output layout and one
gradient of them, 2 V 4 per token, and the fp32 head weight's gradient.

Full recompute (megatron ``recompute_granularity="full"``, uniform, one layer per checkpoint)
saves only each layer's input h d and recomputes one layer at a time during the backward.
Pipeline parallelism (1F1B) keeps PP - stage micro-batches in flight on a stage.

``tests/unit/planning/test_plan.py`` measures the saved tensors of a real forward on CPU (saved-tensor
hooks, unique storages) and compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.planning.shapes import ModelShapes, stage_layers

FP32 = 4
Kernels = Literal["gpu", "cpu"]


@dataclass(frozen=True)
class ActivationSettings:
    """How one micro-batch runs on one rank.

    Attributes:
        tokens: tokens of the micro-batch (sequences x padded length).
        seq_len: padded length of its sequences.
        dtype_bytes: bytes per activation element (the model's dtype).
        tensor / sequence_parallel / expert / pipeline / stage / context: the layout.
        fp32_head: the output layer runs in float32.
        recompute: megatron's full activation recomputation.
        kernels: "gpu" (Transformer Engine layers: fused RMSNorm saves input and rstd) or
            "cpu" (megatron's local layers: torch's decomposed RMSNorm also saves x*rstd).
            Attention is flash-like on both (SDPA with ``is_causal``).
        expert_load: routed tokens on the busiest expert rank over the balanced share.
        in_flight: micro-batches whose activations a stage holds (None: PP - stage, 1F1B).
    """

    tokens: int
    seq_len: int
    dtype_bytes: int = 2
    tensor: int = 1
    sequence_parallel: bool = False
    expert: int = 1
    pipeline: int = 1
    stage: int = 0
    context: int = 1
    fp32_head: bool = True
    recompute: bool = False
    kernels: Kernels = "gpu"
    expert_load: float = 1.0
    in_flight: int | None = None


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one rank.

    ``saved``: what the forward of one micro-batch saves for its backward, by part;
    ``in_flight``: micro-batches held at once; ``transient``: the largest extra alive at
    the peak (head logits and gradients, or one recomputed layer); ``peak``: in_flight x
    saved + transient.
    """

    saved: dict[str, int]
    in_flight: int
    transient: int
    transient_what: str
    layer_bytes: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def saved_total(self) -> int:
        return sum(self.saved.values())

    @property
    def peak(self) -> int:
        return self.in_flight * self.saved_total + self.transient


def layer_saved(shapes: ModelShapes, i: int, st: ActivationSettings) -> tuple[int, int]:
    """(attention block, MLP or MoE block) bytes layer ``i`` saves for backward."""
    s = shapes
    t, d = st.tensor, st.dtype_bytes
    T = st.tokens // st.context  # context parallelism splits the sequence
    T_seq = T // t if st.sequence_parallel else T  # tokens in the sequence-parallel region
    h, hd, nq, nkv = s.hidden, s.head_dim, s.heads // t, s.kv_heads // t
    norm_copies = 3 if st.kernels == "cpu" else 2  # x (+ x*rstd on CPU) + output
    norm = T_seq * (norm_copies * h * d + FP32)
    chunk = s.chunk[i]
    chunked = chunk is not None and st.seq_len > chunk
    tail = T - T // st.seq_len * (st.seq_len // chunk * chunk) if chunked else T
    attn = norm
    if not chunked or tail or s.qk_norm[i]:
        attn += T * (nq + 2 * nkv) * hd * d  # fused qkv output (v, or k under the norm)
    if s.rope[i]:
        attn += 4 * st.seq_len * hd * d  # cos / sin of q and k
        if not chunked or tail:
            attn += T * (nq + nkv) * hd * d  # RoPE'd q and k
    if s.qk_norm[i]:
        attn += T * (nq * hd * d + FP32 * (nq + nkv))
    if s.temperature[i]:
        attn += T * nq * hd * d
    attn += T * nq * (hd * d + FP32)  # output, log-sum-exp
    if chunked:
        attn += (T - tail) * (nq + 2 * nkv) * hd * d  # chunk-major q, k, v
        attn += T * nq * hd * d  # the output back in [s, b, h hd]
    if s.moe[i]:
        routed = int(T_seq * s.topk * st.expert_load)
        mlp = norm + T * 5 * (s.shared_ffn // t) * d
        mlp += T_seq * (9 * s.experts + 8 * s.topk + 8)
        mlp += routed * (2 * h * d + 5 * s.expert_ffn * d + FP32)
    else:
        mlp = norm + T * 5 * (s.ffn // t) * d
    return attn, mlp


def activation_bytes(shapes: ModelShapes, st: ActivationSettings) -> ActivationBytes:
    """Activation memory of pipeline stage ``st.stage``'s ranks for one micro-batch."""
    s, t = shapes, st.tensor
    T = st.tokens // st.context
    T_seq = T // t if st.sequence_parallel else T
    b = max(1, st.tokens // st.seq_len)
    first, last = st.stage == 0, st.stage == st.pipeline - 1
    saved = {"attention": 0, "mlp": 0, "moe": 0, "layer inputs": 0, "embedding": 0, "head": 0}
    per_layer: dict[int, int] = {}
    for i in stage_layers(s, st.pipeline, st.stage):
        attn, mlp = layer_saved(s, i, st)
        per_layer[i] = attn + mlp
        if st.recompute:
            saved["layer inputs"] += T_seq * s.hidden * st.dtype_bytes
        else:
            saved["attention"] += attn
            saved["moe" if s.moe[i] else "mlp"] += mlp
    if first:
        saved["embedding"] = st.tokens * 8  # token ids
    head_transient = 0
    if last:
        d = st.dtype_bytes
        upcast = st.fp32_head and d < FP32
        norm_copies = 3 if st.kernels == "cpu" else 2
        head = T_seq * ((norm_copies - 1) * s.hidden * d + FP32)  # final norm x (, x*rstd)
        head += T_seq * s.hidden * (FP32 if upcast else d)  # the output layer's input
        weight = s.vocab // t * s.hidden * FP32 if upcast else 0  # fp32 copy of the head
        rows = T - b  # log-probs of tokens 1..s-1
        head += weight + rows * (s.vocab // t * FP32 + 17)
        saved["head"] = head
        head_transient = 2 * T * (s.vocab // t) * FP32 + weight
    if st.recompute:
        options = {
            "head logits": head_transient,
            "one recomputed layer": max(per_layer.values(), default=0),
        }
    else:
        options = {"head logits": head_transient}
    what, transient = max(options.items(), key=lambda kv: kv[1])
    in_flight = st.in_flight if st.in_flight is not None else st.pipeline - st.stage
    saved = {k: v for k, v in saved.items() if v}
    return ActivationBytes(saved, in_flight, transient, what, per_layer)
