"""Named model architectures as Hugging Face configs.

The production shapes (Llama-3.1-8B, Llama-4 Scout text model) and tiny test models that run
on a CPU. A preset is an HF config, so the same code path serves presets and HF directories.
"""

from __future__ import annotations

from typing import Any

import transformers

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Llama-3.1-8B shapes.
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": dict(_LLAMA3_ROPE),
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Llama-4 Scout text model: 17B active, 16 experts, top-1, shared expert, NoPE every 4th layer.
    "llama4-scout": {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 10485760,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "use_qk_norm": True,
        "attention_chunk_size": 8192,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
    },
    # Tiny dense GQA Llama (4 query heads over 2 KV heads, head_dim 64 as vLLM CPU requires).
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 31337.0},
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    },
    # tiny-llama with the output layer tied to the embedding (as Llama-3.2-1B / 3B).
    "tiny-llama-tied": {},  # filled in below
    # Tiny Llama-4 text MoE: 4 experts top-1 + shared expert, dense/MoE interleaved, NoPE on
    # layer 4, chunked attention (chunk 32) on RoPE layers, temperature tuning on NoPE layers.
    "tiny-llama4": {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "vocab_size": 128,
        "hidden_size": 256,
        "intermediate_size": 128,
        "intermediate_size_mlp": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "use_qk_norm": True,
        "attention_chunk_size": 32,
        "attn_temperature_tuning": True,
        "floor_scale": 16,
        "attn_scale": 0.1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    },
}

PRESETS["tiny-llama-tied"] = {**PRESETS["tiny-llama"], "tie_word_embeddings": True}

# Presets a run may initialise randomly on the host (the embedded default, tests). Any other
# preset needs model.hf_path, or model.allow_random_init: true (config/checks.py).
RANDOM_INIT_PRESETS = frozenset({"tiny-llama", "tiny-llama-tied", "tiny-llama4"})


def preset_names() -> list[str]:
    return sorted(PRESETS)


def _for_installed_transformers(fields: dict[str, Any]) -> dict[str, Any]:
    """Preset fields as the installed transformers reads them: 5.x takes the RoPE base and
    scaling as ``rope_parameters``; 4.x (the lent GPU machine's, tools/gpu_check.sh) as
    ``rope_theta`` and ``rope_scaling`` and would keep its default base of 10000 otherwise."""
    if int(transformers.__version__.split(".")[0]) >= 5 or "rope_parameters" not in fields:
        return fields
    rope = dict(fields.pop("rope_parameters"))
    fields["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = rope
    return fields


def preset_hf_config(name: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The HF config of a preset (``overrides`` replace fields, e.g. ``vocab_size``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}")
    fields = _for_installed_transformers({**PRESETS[name], **overrides})
    model_type = fields.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **fields)


def make_hf_model(
    config: transformers.PretrainedConfig,
    out_dir: str,
    seed: int = 0,
    tokenizer_dir: str | None = None,
) -> str:
    """Write a randomly initialised HF model (fixed seed) with ``config`` to ``out_dir``.

    Used by tests and the embedded default: models are made locally, never downloaded.
    """
    import shutil
    from pathlib import Path

    import torch

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for path in Path(tokenizer_dir).iterdir():
            if path.is_file() and path.name != "config.json":
                shutil.copy(path, Path(out_dir) / path.name)
    return out_dir
