"""A model's shapes and the parameters one trainer rank holds, as megatron-core builds them
(no torch import).

``ModelShapes`` reads an HF config the way ``megatron_rl.models.arch`` does (the per-layer
layout: MoE, RoPE, qk-norm, chunked attention); ``rank_parameters`` lists the parameters
megatron's ``GPTModel`` creates on one rank of a TP / PP / EP layout, in the order of
``named_parameters()`` (which fixes megatron's gradient-buffer layout and padding).
``tests/unit/planning/test_plan.py`` checks both against a real megatron model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShapes:
    """What memory depends on, per model (full sizes, before any parallel split).

    Per-layer tuples are indexed by the 0-based layer number. ``chunked``: the layer uses
    Llama-4 chunked local attention; ``temperature``: attention temperature tuning (NoPE
    layers of Llama-4). ``expert_ffn`` / ``shared_ffn`` are 0 for dense models.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int
    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int
    moe: tuple[bool, ...]
    rope: tuple[bool, ...]
    qk_norm: tuple[bool, ...]
    chunk: tuple[int | None, ...]
    temperature: tuple[bool, ...]
    tied_embeddings: bool

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def total_parameters(self) -> int:
        """Parameters of the whole model (every expert, embedding and head)."""
        return sum(p.numel for p in rank_parameters(self, tensor=1, expert=1))


# transformers' Llama4TextConfig defaults (configuration_llama4.py), for keys a config.json
# may leave out.
_LLAMA4_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "moe_layers": None,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "use_qk_norm": True,
}


def shapes_from_fields(fields: dict[str, Any], name: str = "") -> ModelShapes:
    """``ModelShapes`` of an HF config's fields (a preset or config.json as a dict; the text
    model's for multimodal Llama-4). Mirrors ``megatron_rl.models.arch.architecture_from_hf``
    and ``transformer_config`` without importing transformers or torch (the tests assert the
    two agree)."""
    text = fields.get("text_config") if isinstance(fields.get("text_config"), dict) else fields
    n = text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    if str(text.get("model_type", "")).startswith("llama4"):
        c = {**_LLAMA4_DEFAULTS, **text}
        rope = tuple(
            bool(x)
            for x in c["no_rope_layers"]
            or [(i + 1) % c["no_rope_layer_interval"] != 0 for i in range(n)]
        )
        step = c["interleave_moe_layer_step"]
        moe_layers = set(
            c["moe_layers"] if c["moe_layers"] is not None else range(step - 1, n, step)
        )
        moe = tuple(i in moe_layers for i in range(n))
        chunk = tuple(c["attention_chunk_size"] if r else None for r in rope)
        temperature = tuple(bool(c["attn_temperature_tuning"]) and not r for r in rope)
        qk_norm = tuple(bool(c["use_qk_norm"]) and r for r in rope)
        ffn, experts = c["intermediate_size_mlp"], c["num_local_experts"]
        topk, expert_ffn = c["num_experts_per_tok"], c["intermediate_size"]
        shared_ffn = c["intermediate_size"]
    else:
        rope, moe, qk_norm = (True,) * n, (False,) * n, (False,) * n
        chunk, temperature = (None,) * n, (False,) * n
        ffn, experts, topk, expert_ffn, shared_ffn = text["intermediate_size"], 0, 0, 0, 0
    return ModelShapes(
        name=name,
        hidden=text["hidden_size"],
        layers=n,
        heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        vocab=text["vocab_size"],
        ffn=ffn,
        experts=experts,
        topk=topk,
        expert_ffn=expert_ffn,
        shared_ffn=shared_ffn,
        moe=moe,
        rope=rope,
        qk_norm=qk_norm,
        chunk=chunk,
        temperature=temperature,
        tied_embeddings=bool(text.get("tie_word_embeddings", False)),
    )


def model_shapes(model: Any) -> ModelShapes:
    """``ModelShapes`` of a recipe's ``model`` section (a ``ModelConfig``): ``hf_path``'s
    config.json, else the preset, read as plain JSON / dicts, as the config checks read them
    (``megatron_rl.config.checks.model_fields``)."""
    from types import SimpleNamespace

    from megatron_rl.config.checks import model_fields

    fields, source = model_fields(SimpleNamespace(model=model))
    return shapes_from_fields(fields, model.hf_path or model.preset or source)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of a rank.

    ``expert``: a routed expert's weight, which megatron's DDP keeps in the expert-parallel
    buffers (reduced over expert-data-parallel ranks) when expert parallelism is on.
    ``shared``: a tied embedding's copy on the first or last pipeline stage (megatron's
    ``shared_embedding``; the distributed optimizer gives it a bucket of its own).
    """

    name: str
    numel: int
    expert: bool = False
    shared: bool = False


def stage_layers(shapes: ModelShapes, pipeline: int, stage: int) -> range:
    """The 0-based layers of pipeline stage ``stage`` (megatron's even split)."""
    per = shapes.layers // pipeline
    return range(stage * per, (stage + 1) * per)


@functools.lru_cache(maxsize=256)
def rank_parameters(
    shapes: ModelShapes,
    tensor: int = 1,
    expert: int = 1,
    expert_tensor: int = 1,
    pipeline: int = 1,
    stage: int = 0,
    te: bool = False,
) -> tuple[ParamSpec, ...]:
    """The parameters of one rank of pipeline stage ``stage``, in ``named_parameters()``
    order. ``te``: Transformer Engine layer specs (GPU), whose fused layer-norm linears hold
    the norm weights (``linear_qkv.layer_norm_weight``) instead of separate norm modules."""
    s, t = shapes, tensor
    h, hd = s.hidden, s.head_dim
    qkv_rows = (s.heads + 2 * s.kv_heads) * hd // t
    out: list[ParamSpec] = []
    first, last = stage == 0, stage == pipeline - 1
    shared = s.tied_embeddings and pipeline > 1
    if first:
        out.append(ParamSpec("embedding.word_embeddings.weight", s.vocab // t * h, shared=shared))
    for i in stage_layers(s, pipeline, stage):
        p = f"decoder.layers.{i - stage_layers(s, pipeline, stage).start}."
        attn = [ParamSpec(p + "self_attention.linear_proj.weight", h * s.heads * hd // t)]
        if te:
            attn.append(ParamSpec(p + "self_attention.linear_qkv.layer_norm_weight", h))
        else:
            out.append(ParamSpec(p + "input_layernorm.weight", h))
        attn.append(ParamSpec(p + "self_attention.linear_qkv.weight", qkv_rows * h))
        out.extend(attn)
        if s.moe[i]:
            out.append(ParamSpec(p + "pre_mlp_layernorm.weight", h))
            out.append(ParamSpec(p + "mlp.router.weight", s.experts * h))
            fe = s.expert_ffn // expert_tensor
            routed = expert > 1  # megatron marks expert weights allreduce=False only under EP
            for e in range(s.experts // expert):
                q = f"{p}mlp.experts.local_experts.{e}."
                out.append(ParamSpec(q + "linear_fc1.weight", 2 * fe * h, expert=routed))
                out.append(ParamSpec(q + "linear_fc2.weight", h * fe, expert=routed))
            fs = s.shared_ffn // t
            out.append(ParamSpec(p + "mlp.shared_experts.linear_fc1.weight", 2 * fs * h))
            out.append(ParamSpec(p + "mlp.shared_experts.linear_fc2.weight", h * fs))
        else:
            if te:
                out.append(ParamSpec(p + "mlp.linear_fc1.layer_norm_weight", h))
            else:
                out.append(ParamSpec(p + "pre_mlp_layernorm.weight", h))
            out.append(ParamSpec(p + "mlp.linear_fc1.weight", 2 * (s.ffn // t) * h))
            out.append(ParamSpec(p + "mlp.linear_fc2.weight", h * (s.ffn // t)))
    if last:
        out.append(ParamSpec("decoder.final_layernorm.weight", h))
        if not s.tied_embeddings or pipeline > 1:
            # the FP32 head computes in fp32 from a weight of the model's dtype
            out.append(ParamSpec("output_layer.weight", s.vocab // t * h, shared=shared))
    return tuple(out)
