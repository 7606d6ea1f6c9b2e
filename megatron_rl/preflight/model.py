"""The model check: ``model.hf_path`` is a usable HF directory whose config is the recipe's
preset, its tokenizer loads, and the parallel layout divides the model's shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.preflight.context import Outcome, PreflightContext

# HF config fields that decide the architecture (and so the shapes every GPU holds).
ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "intermediate_size_mlp",
    "vocab_size",
    "num_local_experts",
    "num_experts_per_tok",
    "interleave_moe_layer_step",
    "tie_word_embeddings",
)


def resolved_arch_fields(config: Any) -> dict[str, Any]:
    """The architecture fields of an HF config object as transformers resolves them: derived
    defaults included (Llama-3.1's config.json has no ``head_dim``; transformers derives
    hidden_size / num_attention_heads), the text model's for a multimodal Llama-4, except
    ``tie_word_embeddings``, read from the config of the model that holds the LM head (the
    top level: Llama4ForConditionalGeneration ties by its own config, not text_config's)."""
    text = config.get_text_config()
    fields = {key: getattr(text, key) for key in ARCH_FIELDS if hasattr(text, key)}
    fields["tie_word_embeddings"] = bool(getattr(config, "tie_word_embeddings", False))
    return fields


def config_differences(found: Any, preset: Any) -> list[str]:
    """'field: found X, preset Y' for every architecture field the two HF configs (config
    objects, as transformers builds them) resolve differently. Fields the preset's model
    does not have (experts of a dense preset) are not compared; its ``model_type`` is."""
    have, want = resolved_arch_fields(found), resolved_arch_fields(preset)
    return [
        f"{key}: {have.get(key)!r} here, {want[key]!r} in the preset"
        for key in ARCH_FIELDS
        if key in want and have.get(key) != want[key]
    ]


def _check_hf_dir(ctx: PreflightContext) -> tuple[list[str], str, dict]:
    from megatron_rl.models.hf_config import load_hf_config, load_tokenizer

    model = ctx.config.model
    path = Path(model.hf_path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        return [f"model.hf_path {path} {what}"], "missing", {}
    problems = []
    weights = sorted(p.name for p in path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not weights:
        problems.append(f"model.hf_path {path}: no *.safetensors weights")
    if model.preset is not None:
        from megatron_rl.models.presets import preset_hf_config

        try:
            found = load_hf_config(path)
        except Exception as err:  # any failure to read the config is the finding
            problems.append(f"{path / 'config.json'} does not load: {type(err).__name__}: {err}")
            found = None
        diff = [] if found is None else config_differences(found, preset_hf_config(model.preset))
        if diff:
            problems.append(
                f"model.hf_path {path}'s config.json is not model.preset {model.preset!r}: "
                + "; ".join(diff)
            )
    try:
        tok = load_tokenizer(path)
        tokenizer = f"{type(tok).__name__} ({len(tok)} tokens)"
    except Exception as err:  # any failure to load is the finding
        problems.append(f"the tokenizer of {path} does not load: {type(err).__name__}: {err}")
        tokenizer = "does not load"
    value = f"{path}: {len(weights)} weight files, tokenizer {tokenizer}"
    return problems, value, {"weight_files": len(weights), "tokenizer": tokenizer}


def check_model(ctx: PreflightContext) -> Outcome:
    """``model.hf_path`` present with weights, its config equal to ``model.preset``'s (when a
    preset is named too), tokenizer loads, parallel sizes divide the shapes. Without an
    ``hf_path`` the trainer makes a random initialisation of the preset (with the character
    tokenizer: ``trainer.setup.prepare_hf_dir``), which is reported."""
    from megatron_rl.config import ConfigError
    from megatron_rl.config.checks import check_model_shapes, start_weights_problem

    model = ctx.config.model
    problems: list[str] = []
    if model.hf_path:
        problems, value, details = _check_hf_dir(ctx)
        limit = f"config of preset {model.preset!r}" if model.preset else "a loadable HF model"
    else:
        value = (
            f"no model.hf_path: random init of preset {model.preset!r} (seed "
            f"{ctx.config.seed}) with the character tokenizer, made by the trainer"
        )
        limit, details = "preset known", {"random_init": True}
        refused = start_weights_problem(ctx.config)  # a production preset needs its checkpoint
        if refused is not None:
            problems.append(refused)
    if not problems or model.hf_path is None or Path(model.hf_path, "config.json").is_file():
        try:
            check_model_shapes(ctx.config)
        except ConfigError as err:
            problems.append(str(err))
    return Outcome(not problems, value, limit, "; ".join(problems), details)
