"""Layer specs: Transformer Engine on GPU, megatron local modules + SDPA attention on CPU.

The platform layer decides which (``Platform.transformer_engine``); this module only builds
the per-layer ModuleSpecs, swapping parts through specs rather than forking model code.
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import L2Norm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_rl.models.arch import Architecture
from megatron_rl.models.attention import SDPACoreAttention


def _layer_spec(config: TransformerConfig, moe: bool, use_te: bool) -> ModuleSpec:
    num_experts = config.num_moe_experts if moe else None
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=config.moe_grouped_gemm
        )
        return copy.deepcopy(spec)
    spec = copy.deepcopy(
        get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            normalization="RMSNorm",
        )
    )
    if moe:
        # Checkpoint keys are TE's (the GPU layout). megatron-core 0.16.1's local spec maps
        # the pre-MLP norm to the name of TE's fused norm-linear (mlp.linear_fc1.layer_norm_*)
        # for every layer, but TE's spec fuses it only before a dense MLP: a MoE layer keeps
        # a separate pre_mlp_layernorm (TENorm). Keep that name here too, so that either
        # spec loads the other's checkpoints (older local-spec checkpoints:
        # conversion.checkpoint.LEGACY_KEYS).
        keys = spec.submodules.sharded_state_dict_keys_map
        spec.submodules.sharded_state_dict_keys_map = {
            old: new for old, new in keys.items() if old != "pre_mlp_layernorm."
        }
    return spec


def decoder_layer_specs(
    config: TransformerConfig, arch: Architecture, use_te: bool
) -> list[ModuleSpec]:
    """One ModuleSpec per decoder layer of the whole model (all pipeline stages)."""
    layout = arch.layout
    specs = []
    for i in range(config.num_layers):
        spec = _layer_spec(config, layout.moe[i], use_te)
        attn = spec.submodules.self_attention.submodules
        norm = L2Norm if layout.qk_l2_norm[i] else IdentityOp
        attn.q_layernorm = norm
        attn.k_layernorm = norm
        custom = layout.chunk_size[i] is not None or layout.temperature[i] is not None
        if not use_te or custom:
            attn.core_attention = ModuleSpec(
                module=SDPACoreAttention,
                params={"chunk_size": layout.chunk_size[i], "temperature": layout.temperature[i]},
            )
        specs.append(spec)
    return specs


def decoder_block_spec(
    config: TransformerConfig, arch: Architecture, use_te: bool, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder layers of this pipeline stage."""
    specs = decoder_layer_specs(config, arch, use_te)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        # Not gpt_layer_specs.LNImpl: where apex is installed (NGC images) that is apex's
        # FusedLayerNorm, which asserts normalization == "LayerNorm"; Llama needs RMSNorm.
        # The local layer specs use WrappedTorchNorm for RMSNorm too.
        from megatron.core.transformer.torch_norm import WrappedTorchNorm as norm
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=norm)
