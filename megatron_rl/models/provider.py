"""Build a megatron-core GPTModel from a model config (preset or HF directory)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import transformers
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_rl.models.arch import architecture_from_hf, transformer_config
from megatron_rl.models.config import ModelConfig
from megatron_rl.models.hf_config import load_hf_config as read_hf_config
from megatron_rl.models.presets import preset_hf_config
from megatron_rl.models.specs import decoder_block_spec
from megatron_rl.platform import ParallelConfig, get_platform

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_hf_config(model: ModelConfig) -> transformers.PretrainedConfig:
    """The HF config of ``model``: from ``hf_path`` if set, else from the preset."""
    if model.hf_path is not None:
        path = Path(model.hf_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.hf_path: no config.json in {path}")
        return read_hf_config(path)
    return preset_hf_config(model.preset)


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    hf_config: transformers.PretrainedConfig | None = None,
    meta: bool = False,
) -> GPTModel:
    """Build this rank's part of the model (TP/PP/EP from the initialised parallel state).

    Weights are randomly initialised; load them with ``megatron_rl.conversion``. ``meta``:
    parameters on the meta device (no storage, not initialised), for conversions that
    materialise one layer at a time (``module.to_empty``). The model uses the fused kernels of
    the platform (``Platform.kernels``) unless ``model.kernel_fusion`` is false; with
    gradient-accumulation fusion its backward needs
    megatron's ``DistributedDataParallel`` around it (``trainer.optim.wrap_model``).
    """
    platform = get_platform()
    arch = architecture_from_hf(hf_config or load_hf_config(model))
    use_te = {"auto": platform.is_gpu, "te": True, "local": False}[model.layer_spec]
    if use_te and not platform.transformer_engine:
        # On GPU, 'auto' means TE: a missing or broken TE must not silently give a slower,
        # different model (local specs, no FP8). Local specs on GPU are asked for by name.
        raise ValueError(
            f"model.layer_spec: {model.layer_spec!r} needs Transformer Engine, which does not "
            f"import here ({platform.transformer_engine_error or 'no GPU'}); "
            "set model.layer_spec: local to run without it"
        )
    if model.fp8 is not None and not use_te:
        raise ValueError("model.fp8 needs Transformer Engine layer specs (a GPU with TE)")
    config = transformer_config(
        arch,
        parallel,
        DTYPES[model.dtype],
        use_cpu_initialization=meta or not platform.is_gpu,
        fp8=model.fp8,
        recompute=model.recompute_activations,
        moe=model.moe,
        fp8_recipe=model.fp8_scaling or "delayed",
        kernels=platform.kernels if model.kernel_fusion else None,
    )
    if meta:
        config.perform_initialization = False
    with torch.device("meta") if meta else contextlib.nullcontext():
        gpt = _gpt_model(model, config, arch, use_te)
    _set_rope_frequencies(gpt, arch.text_config)
    # Norm weights are created in fp32 whatever params_dtype says (the GPU path casts through
    # megatron's Float16Module); cast here so every parameter has the model's dtype.
    gpt.to(DTYPES[model.dtype])
    if model.fp32_head:
        enable_fp32_head(gpt)
    gpt.architecture = arch  # for conversion and weight export
    if platform.is_gpu and not meta:
        gpt.cuda()
    return gpt


def _gpt_model(model: ModelConfig, config, arch, use_te: bool) -> GPTModel:
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    text = arch.text_config
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(config, arch, use_te, pp_rank=pp_rank),
        vocab_size=text.vocab_size,
        max_sequence_length=model.max_sequence_length or text.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_parameters(text).get("rope_theta", 10000.0)),
    )


def rope_parameters(text: transformers.PretrainedConfig) -> dict:
    """The RoPE base and scaling of an HF text config. transformers 5 keeps them in
    ``rope_parameters``; 4.x (e.g. the lent GPU machine's, tools/gpu_check.sh) in
    ``rope_theta`` and ``rope_scaling``."""
    params = getattr(text, "rope_parameters", None)
    if params:
        return params
    scaling = getattr(text, "rope_scaling", None) or {}
    return {"rope_theta": getattr(text, "rope_theta", 10000.0), **scaling}


def _set_rope_frequencies(gpt: GPTModel, text: transformers.PretrainedConfig) -> None:
    """Use transformers' own RoPE initialisation (default, llama3, linear ... scaling with all
    their parameters); megatron's llama3 scaling hard-codes low/high frequency factors."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None:
        return
    params = rope_parameters(text)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = rope.inv_freq.numel() * 2
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, device=torch.device("cpu"))
    if scaling != 1.0:
        raise ValueError(
            f"rope_type {rope_type!r} with attention scaling {scaling} is not supported"
        )
    rope.inv_freq = inv_freq.to(rope.inv_freq.device, rope.inv_freq.dtype)


def enable_fp32_head(gpt: GPTModel) -> None:
    """Run the output layer in FP32: FP32 input, FP32 matmul, FP32 logits (ScaleRL's FP32 head).

    The head *weight* keeps the model's dtype and is upcast on the fly (as a tied embedding
    weight is), so the trainer computes its logits from exactly the values the generator
    holds: vLLM's ``head_dtype: float32`` keeps a BF16 model's lm_head weight in BF16 and
    only accumulates in FP32 (``logits_processor._apply_head``); an FP32 trainer weight would
    be rounded on every push (on CPU that adds little to the bf16 kernels' own gap: 2.39e-3
    -> 2.36e-3 mean with ``check-parity --dtype bfloat16``). The optimizer keeps FP32 main
    parameters, as for every layer.
    """
    layer = getattr(gpt, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return

    def upcast(module, args, kwargs):
        args = tuple(a.float() if torch.is_tensor(a) else a for a in args)
        weight = kwargs.get("weight")
        if weight is None and module.weight is not None:
            weight = module.weight
        if weight is not None:
            kwargs["weight"] = weight.float()
        return args, kwargs

    layer.register_forward_pre_hook(upcast, with_kwargs=True)
    # The upcast weight of a BF16 model is a new tensor without megatron DDP's main_grad, into
    # which a fused weight-gradient accumulation would write: the head's wgrad stays unfused
    # (autograd carries it to the weight, and DDP's hook adds it to main_grad).
    layer.gradient_accumulation_fusion = False
    gpt.fp32_head = True
