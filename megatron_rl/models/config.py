"""Model selection for a recipe (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import ConfigError

# megatron-core's load-balancing types that add an auxiliary loss (moe_router_load_balancing_type).
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
# megatron-core 0.16.1's TransformerConfig.fp8_recipe values but 'custom' (which needs a
# quantizer factory of one's own).
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


@dataclass
class MoERouterConfig:
    """Router training settings of an MoE model (``model.moe``), mapped one to one to
    megatron-core's options (a dense model with any of them set is an error).

    The defaults train the router as the generator runs it: plain top-k, no auxiliary loss,
    no token dropping. A capacity factor makes the trainer drop tokens that vLLM (dropless)
    does route, so the two compute different functions for those tokens.
    """

    # moe_router_load_balancing_type: "none", or the auxiliary loss that aux_loss_coeff scales
    # (GShard/Switch per micro-batch, per sequence, or over the global batch).
    load_balancing: Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss"] = "none"
    aux_loss_coeff: float = 0.0  # moe_aux_loss_coeff
    z_loss_coeff: float | None = None  # moe_z_loss_coeff (ST-MoE router z-loss); None: off
    # moe_expert_capacity_factor: each expert takes at most factor x tokens x topk / experts
    # tokens per micro-batch (and rank); None: dropless.
    capacity_factor: float | None = None
    token_drop_policy: Literal["probs", "position"] = "probs"  # moe_token_drop_policy
    pad_to_capacity: bool = False  # moe_pad_expert_input_to_capacity

    def validate(self) -> None:
        if self.aux_loss_coeff < 0:
            raise ConfigError("aux_loss_coeff", f"must be >= 0, got {self.aux_loss_coeff}")
        if self.aux_loss_coeff > 0 and self.load_balancing not in AUX_LOSS_TYPES:
            raise ConfigError(
                "aux_loss_coeff",
                f"{self.aux_loss_coeff} needs model.moe.load_balancing set to one of "
                f"{list(AUX_LOSS_TYPES)} (it is {self.load_balancing!r})",
            )
        if self.load_balancing in AUX_LOSS_TYPES and self.aux_loss_coeff == 0:
            raise ConfigError(
                "load_balancing",
                f"{self.load_balancing!r} needs model.moe.aux_loss_coeff > 0 (with 0 "
                "megatron-core computes no loss); use 'none' for no balancing loss",
            )
        if self.z_loss_coeff is not None and self.z_loss_coeff <= 0:
            raise ConfigError("z_loss_coeff", f"must be > 0 or null (off), got {self.z_loss_coeff}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            # megatron-core silently reads a negative factor as "no capacity".
            raise ConfigError(
                "capacity_factor", f"must be > 0 or null (dropless), got {self.capacity_factor}"
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ConfigError("pad_to_capacity", "needs model.moe.capacity_factor")

    def is_default(self) -> bool:
        return self == MoERouterConfig()


@dataclass
class ModelConfig:
    """Which model to train and how to run it.

    ``preset`` names a built-in architecture (``llama3-8b``, ``llama4-scout``, ``tiny-llama``,
    ``tiny-llama4``); ``hf_path`` points to a Hugging Face model directory (config.json, and
    weights to start from). With both, the HF directory's config wins and ``preset`` is ignored.

    Without ``hf_path`` a run starts from a random initialisation of the preset, written by rank
    0 as an fp32 HF model with the character tokenizer: what the tiny CPU presets are for. A
    production preset (``llama3-8b``: ~32 GB, ``llama4-scout``: ~431 GB of host memory and disk)
    refuses to start that way unless ``allow_random_init`` is true
    (``megatron_rl.config.checks.check_start_weights``).
    """

    preset: str | None = None  # a built-in architecture (llama3-8b, llama4-scout, tiny-*)
    hf_path: str | None = None  # HF model directory to start from (its config wins)
    dtype: Literal["float32", "bfloat16"] = "bfloat16"  # parameter dtype of the policy
    # ScaleRL: compute the LM head (logits, log-probs) in FP32 even in a BF16 model.
    fp32_head: bool = True
    # GPU only: Transformer Engine FP8 format for the linear layers.
    fp8: Literal["e4m3", "hybrid"] | None = None
    # With fp8: megatron-core's FP8 scaling recipe; null: delayed. Hopper: delayed, tensorwise
    # or blockwise (CUDA >= 12.9); Blackwell: those or mxfp8 (tokens then pad to multiples of
    # 32, not 16). Checked against cluster.gpu at load (planning.gpus.fp8_recipes).
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] | None = None
    # "auto": Transformer Engine specs on GPU (an error if TE does not import there), local
    # specs with torch SDPA on CPU; "local" on GPU runs without TE (no FP8).
    layer_spec: Literal["auto", "te", "local"] = "auto"
    recompute_activations: bool = False  # full activation recompute (memory for compute)
    # GPU: megatron-core's fused kernels where their libraries import (Platform.kernels:
    # gradient accumulation, RoPE, SwiGLU, masked softmax); false: none of them (A/B
    # measurements, or a kernel that misbehaves). CPU: never fused.
    kernel_fusion: bool = True
    max_sequence_length: int | None = None  # default: the HF config's max_position_embeddings
    moe: MoERouterConfig = field(default_factory=MoERouterConfig)  # MoE models only
    allow_random_init: bool = False  # production presets without hf_path: start from random

    @property
    def fp8_scaling(self) -> str | None:
        """The FP8 recipe in force: None without FP8, else ``fp8_recipe`` (default delayed)."""
        return None if self.fp8 is None else (self.fp8_recipe or "delayed")

    def validate(self) -> None:
        if self.preset is None and self.hf_path is None:
            raise ConfigError("", "set either 'preset' or 'hf_path'")
        if self.fp8 is not None and self.dtype != "bfloat16":
            raise ConfigError("fp8", "needs model.dtype: bfloat16")
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(
                "fp8_recipe", f"must be one of {', '.join(FP8_RECIPES)}; got {self.fp8_recipe!r}"
            )
        if self.fp8_recipe is not None and self.fp8 is None:
            raise ConfigError("fp8_recipe", f"{self.fp8_recipe!r} needs fp8 (e4m3 or hybrid)")
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ConfigError("max_sequence_length", "must be >= 1")
