"""Hugging Face config -> megatron-core TransformerConfig and per-layer layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models.config import MoERouterConfig
from megatron_rl.models.hf_config import SUPPORTED_ARCHITECTURES
from megatron_rl.platform import ParallelConfig
from megatron_rl.platform.kernels import FusedKernels


@dataclass(frozen=True)
class LayerLayout:
    """What differs between decoder layers (index = 0-based layer number)."""

    moe: tuple[bool, ...]
    rope: tuple[bool, ...]  # False = NoPE layer
    qk_l2_norm: tuple[bool, ...]
    chunk_size: tuple[int | None, ...]  # chunked local attention
    temperature: tuple[tuple[float, float] | None, ...]  # (floor_scale, attn_scale)


@dataclass(frozen=True)
class Architecture:
    """A model architecture in the terms megatron needs."""

    hf_architecture: str
    text_config: transformers.PretrainedConfig
    layout: LayerLayout

    @property
    def is_llama4(self) -> bool:
        return self.hf_architecture.startswith("Llama4")

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def tie_embeddings(self) -> bool:
        return bool(getattr(self.text_config, "tie_word_embeddings", False))


def architecture_from_hf(config: transformers.PretrainedConfig) -> Architecture:
    """Read the architecture from an HF config; raises ValueError for unsupported ones."""
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (config.json 'architectures'); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    text = (
        getattr(config, "text_config", config)
        if arch == "Llama4ForConditionalGeneration"
        else config
    )
    n = text.num_hidden_layers
    if not arch.startswith("Llama4"):
        layout = LayerLayout((False,) * n, (True,) * n, (False,) * n, (None,) * n, (None,) * n)
        return Architecture(arch, text, layout)
    rope = tuple(bool(x) for x in text.no_rope_layers)
    moe_layers = set(text.moe_layers)
    chunk = text.attention_chunk_size
    temp = (
        (float(text.floor_scale), float(text.attn_scale)) if text.attn_temperature_tuning else None
    )
    layout = LayerLayout(
        moe=tuple(i in moe_layers for i in range(n)),
        rope=rope,
        qk_l2_norm=tuple(bool(text.use_qk_norm) and r for r in rope),
        chunk_size=tuple(chunk if r else None for r in rope),
        temperature=tuple(None if r else temp for r in rope),
    )
    return Architecture(arch, text, layout)


def check_divisibility(arch: Architecture, parallel: ParallelConfig) -> None:
    """Clear errors when the parallel sizes do not divide the model's shapes."""
    c = arch.text_config
    checks = [
        ("num_attention_heads", c.num_attention_heads, parallel.tensor, "parallel.tensor"),
        ("num_key_value_heads", c.num_key_value_heads, parallel.tensor, "parallel.tensor"),
        ("vocab_size", c.vocab_size, parallel.tensor, "parallel.tensor"),
        ("num_hidden_layers", c.num_hidden_layers, parallel.pipeline, "parallel.pipeline"),
    ]
    if arch.is_llama4:
        checks.append(
            ("num_local_experts", c.num_local_experts, parallel.expert, "parallel.expert")
        )
        if parallel.expert_tensor != 1:
            raise ValueError(
                "parallel.expert_tensor must be 1 for Llama-4: modelopt 0.47 imports packed "
                "experts with expert tensor parallelism incorrectly (fused gate/up cut contiguously)"
            )
    elif parallel.expert > 1:
        raise ValueError(
            f"parallel.expert={parallel.expert} but {arch.hf_architecture} has no experts"
        )
    for field, value, size, key in checks:
        if value % size:
            raise ValueError(f"{key}={size} does not divide the model's {field}={value}")


def transformer_config(
    arch: Architecture,
    parallel: ParallelConfig,
    dtype: torch.dtype,
    use_cpu_initialization: bool,
    fp8: str | None = None,
    recompute: bool = False,
    moe: MoERouterConfig | None = None,
    fp8_recipe: str = "delayed",
    kernels: FusedKernels | None = None,
) -> TransformerConfig:
    """megatron-core TransformerConfig equivalent to the HF architecture, with the router
    training settings ``moe`` (``model.moe``) on an MoE model. ``fp8``: the FP8 format
    (``model.fp8``), with the scaling recipe ``fp8_recipe`` (``model.fp8_recipe``).
    ``kernels``: the fusions to use (the platform's, ``Platform.kernels``); None: none."""
    check_divisibility(arch, parallel)
    moe = moe or MoERouterConfig()
    if not arch.is_llama4 and not moe.is_default():
        raise ValueError(f"model.moe: {arch.hf_architecture} has no experts to route")
    c = arch.text_config
    kwargs = dict(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.intermediate_size_mlp if arch.is_llama4 else c.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(c, "attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(c, "initializer_range", 0.02),
        **(kernels or FusedKernels()).transformer_config_options(arch.is_llama4),
        # Off everywhere: with no dropout and no biases the fused bias-dropout-add is a plain
        # add; persist_layer_norm is apex's LayerNorm kernel (our norms are RMSNorm).
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor,
        context_parallel_size=parallel.context,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu_initialization,
        pipeline_dtype=dtype,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )
    if fp8 is not None:
        kwargs.update(fp8=fp8, fp8_recipe=fp8_recipe)
    if arch.is_llama4:  # rotary_interleaved: transformer_config_options(arch.is_llama4) above
        layout = arch.layout
        kwargs.update(
            rotary_interleaved=True,
            no_rope_freq=[0 if r else 1 for r in layout.rope],
            num_moe_experts=c.num_local_experts,
            moe_layer_freq=[1 if m else 0 for m in layout.moe],
            moe_ffn_hidden_size=c.intermediate_size,
            moe_shared_expert_intermediate_size=c.intermediate_size,
            moe_router_topk=c.num_experts_per_tok,
            moe_router_score_function="sigmoid",
            moe_apply_probs_on_input=True,
            **moe_router_options(moe),
            moe_token_dispatcher_type="alltoall",
            # Off on GPU too: modelopt 0.47 imports Llama-4's packed experts only into
            # SequentialMLP.local_experts (megatron_importer.py, "local_experts.linear_fc1_ep"),
            # and our weight stream (conversion/weight_stream.py), the parity check and the
            # planner's shapes expect that module, not TEGroupedMLP's weight0..N.
            moe_grouped_gemm=False,
        )
    return TransformerConfig(**kwargs)


def moe_router_options(moe: MoERouterConfig) -> dict:
    """megatron-core's TransformerConfig options for the ``model.moe`` settings."""
    return dict(
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=moe.token_drop_policy,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
    )
