"""Checks of a RunConfig against the model's shapes (heads, experts, layers, vocabulary).

Kept apart from the schema because they read the model's HF config: a preset's fields
(``megatron_rl.models.presets``, which imports transformers but no torch) or
``model.hf_path``/config.json (read as JSON by ``megatron_rl.models.hf_config``, and
validated by transformers as every reader of the run will). Called by ``load_run_config``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_rl.config.loader import ConfigError
from megatron_rl.config.schema import RunConfig


def model_fields(config: RunConfig) -> tuple[dict[str, Any], str]:
    """The model's HF config fields (the text model's, for multimodal Llama-4) and a phrase
    saying where they come from."""
    model = config.model
    if model.hf_path is not None:
        from megatron_rl.models.hf_config import (
            SUPPORTED_ARCHITECTURES,
            config_from_dict,
            read_config_dict,
        )

        path = Path(model.hf_path) / "config.json"
        if not path.is_file():
            raise ConfigError("model.hf_path", f"no config.json in {model.hf_path}")
        try:
            # read as every reader of the run reads it (known fields coerced), and refused
            # here, at load, where one of them would refuse it
            fields = read_config_dict(path)
            config_from_dict(fields, path)
        except ValueError as err:
            raise ConfigError("model.hf_path", str(err)) from None
        architecture = (fields.get("architectures") or [None])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            # at load (and --dry-run), not minutes later when the trainer builds the model
            raise ConfigError(
                "model.hf_path",
                f"{path}: architecture {architecture!r} is not supported; megatron_rl trains "
                f"Llama 3.x and Llama 4: {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        source = f"model.hf_path {model.hf_path}"
    else:
        from megatron_rl.models.presets import PRESETS

        if model.preset not in PRESETS:
            raise ConfigError(
                "model.preset",
                f"unknown preset {model.preset!r}; known: {', '.join(sorted(PRESETS))}",
            )
        fields = PRESETS[model.preset]
        source = f"model.preset '{model.preset}'"
    if isinstance(fields.get("text_config"), dict):
        fields = fields["text_config"]
    return fields, source


def _divides(key: str, size: int, count: Any, what: str, source: str) -> None:
    if isinstance(count, int) and size > 1 and count % size:
        raise ConfigError(key, f"{size} does not divide the {count} {what} of {source}")


def check_model_shapes(config: RunConfig) -> None:
    """Raise ConfigError (naming the dotted key) when a parallel size does not fit the model
    or the longest sequence does not fit its position embeddings."""
    fields, source = model_fields(config)
    p = config.parallel
    heads = fields.get("num_attention_heads")
    _divides("parallel.tensor", p.tensor, heads, "attention heads", source)
    _divides(
        "parallel.tensor",
        p.tensor,
        fields.get("num_key_value_heads", heads),
        "key/value heads",
        source,
    )
    _divides("parallel.tensor", p.tensor, fields.get("vocab_size"), "vocabulary entries", source)
    _divides("parallel.pipeline", p.pipeline, fields.get("num_hidden_layers"), "layers", source)
    _divides("rollout.tensor_parallel", config.rollout.tensor_parallel, heads, "heads", source)
    experts = fields.get("num_local_experts")
    if p.expert > 1 and not experts:
        raise ConfigError("parallel.expert", f"{p.expert} needs an MoE model; {source} is dense")
    _divides("parallel.expert", p.expert, experts, "experts", source)
    if config.rollout.expert_parallel and not experts:
        raise ConfigError(
            "rollout.expert_parallel",
            f"places routed experts on the engines' GPUs; {source} is dense",
        )
    if not experts and not config.model.moe.is_default():
        raise ConfigError("model.moe", f"{source} is dense (no router to configure)")
    if experts and p.tensor > 1 and not p.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel",
            f"megatron-core trains the MoE layers of "
            f"{source} with tensor parallelism ({p.tensor}) only under sequence parallelism; "
            "set parallel.sequence_parallel: true",
        )
    if config.algorithm.routing_replay:
        _check_routing_replay(config, bool(experts), source)
    positions = fields.get("max_position_embeddings")
    longest = config.data.max_prompt_tokens + config.max_response_tokens()
    if isinstance(positions, int) and longest > positions:
        raise ConfigError(
            "rollout.max_tokens",
            f"prompt ({config.data.max_prompt_tokens}) + longest "
            f"response ({config.max_response_tokens()}) = {longest} tokens exceeds the "
            f"{positions} positions of {source}",
        )


def check_tool_format(config: RunConfig) -> None:
    """Raise ConfigError (``rollout.environment.tool_format``) when multi-turn episodes leave
    the tool format to "auto" and the model's tokenizer is of no family with a known format
    (``environments.formats.detect_format``): such a recipe fell back to the markdown format
    silently (Llama-4 before its format was known). Reads the tokenizer of
    ``model.hf_path``; a preset starts with the character tokenizer, which has none."""
    env = config.rollout.environment
    if not config.rollout.episodes or env.tool_format != "auto":
        return
    from megatron_rl.environments.formats import FORMATS, KNOWN_FAMILIES, detect_format

    key = "rollout.environment.tool_format"
    if config.model.hf_path is None:
        found, source = None, f"model.preset '{config.model.preset}' (the character tokenizer)"
    else:
        from megatron_rl.models.hf_config import load_tokenizer

        try:
            tokenizer = load_tokenizer(config.model.hf_path)
        except Exception as err:  # noqa: BLE001 - any reason it does not load, said with the key
            raise ConfigError(
                key,
                f"'auto' reads the tokenizer of {config.model.hf_path}, which does not "
                f"load: {type(err).__name__}: {err}",
            ) from None
        found, source = detect_format(tokenizer), f"the tokenizer of {config.model.hf_path}"
    if found is None:
        raise ConfigError(
            key,
            f"'auto' finds no tool format for {source} ({KNOWN_FAMILIES}); name the one "
            f"the model was trained with: {', '.join(FORMATS)}",
        )


def _check_routing_replay(config: RunConfig, moe: bool, source: str) -> None:
    key = "algorithm.routing_replay"
    if not moe:
        raise ConfigError(key, f"replays MoE routing; {source} is dense")
    if not config.rollout.enforce_eager:
        # The engines record routing in the forward; CUDA graphs captured before the capture
        # hooks are bound would replay without them.
        raise ConfigError(
            "rollout.enforce_eager",
            "must be true with algorithm.routing_replay "
            "(the engines record routed experts in eager forwards)",
        )
    if config.model.moe.capacity_factor is not None:
        # vLLM never drops a token: a capacity would drop some of the replayed assignments.
        raise ConfigError(
            key,
            "needs dropless experts (model.moe.capacity_factor null); the generator "
            "drops no tokens",
        )
    if config.model.recompute_activations and config.parallel.pipeline > 1:
        # A pipeline schedule runs other micro-batches' forwards between a micro-batch's
        # forward and its recompute: the replayed indices would be another micro-batch's.
        raise ConfigError(
            key,
            "not supported with model.recompute_activations under pipeline "
            "parallelism (parallel.pipeline > 1)",
        )


# -- GPU-only paths a recipe asks for, checked at load (and again where they run) ----------


def m2n_layout_problem(
    tensor: int, expert: int, pipeline: int = 1, expert_tensor: int = 1
) -> str | None:
    """Why ``rollout.weight_transport: nccl_m2n`` cannot take this trainer layout, or None.

    vLLM's m2n source mesh is the first ``max(TP, EP)`` ranks of the trainer, each holding one
    shard of every tensor (``rollout.weights.m2n``): TP and EP must each be 1 or that size
    (TP 2 / EP 4 would shard dense and expert tensors over different rank sets), pipeline
    parallel 1 (a stage holds only its layers: m2n has no placement for "held by some ranks
    only"), expert tensor parallel 1 (experts whole on their EP rank). The one statement of
    these limits: the recipe is refused at load (:func:`check_gpu_paths`) and the weight
    stream's ``source_layout`` must agree."""
    if pipeline != 1:
        return (
            f"'nccl_m2n' needs parallel.pipeline 1 (got {pipeline}): a pipeline stage holds only "
            "its layers, which m2n's placements cannot describe; use 'nccl'"
        )
    if expert_tensor != 1:
        return (
            f"'nccl_m2n' needs parallel.expert_tensor 1 (got {expert_tensor}): experts must be "
            "whole on their EP rank; use 'nccl'"
        )
    size = max(tensor, expert)
    for name, value in (("tensor", tensor), ("expert", expert)):
        if value not in (1, size):
            return (
                f"'nccl_m2n' needs parallel.tensor and parallel.expert each 1 or max(TP, EP) "
                f"(got parallel.{name} {value}, max {size}: TP {tensor}, EP {expert}): one source "
                "mesh of max(TP, EP) ranks cannot describe tensors sharded over different rank "
                "sets; use 'nccl'"
            )
    return None


def fp8_recipe_problem(model: Any, gpu: str, recipes: Sequence[str]) -> tuple[str, str] | None:
    """(key, why) when the model's FP8 recipe (``model.fp8_scaling``) is not one that
    ``gpu`` runs (``recipes``: ``planning.gpus.fp8_recipes`` of its compute capability), or
    None. Serves the load-time check against ``cluster.gpu`` and the preflight's ``fp8``
    check against the GPU it runs on."""
    recipe = model.fp8_scaling
    if recipe is None or recipe in recipes:
        return None
    key = "model.fp8_recipe" if model.fp8_recipe is not None else "model.fp8"
    runs = ", ".join(recipes) if recipes else "no FP8"
    return key, (
        f"FP8 recipe {recipe!r} (model.fp8 {model.fp8!r}) does not run on {gpu} "
        f"(Transformer Engine runs {runs} there): pick one of those for model.fp8_recipe, "
        "or set model.fp8: null"
    )


def check_gpu_paths(config: RunConfig) -> None:
    """Raise ConfigError naming the key when the recipe asks for a GPU path that its layout
    or its GPU (``cluster.gpu``) cannot run: ``nccl_m2n`` on a layout it cannot describe
    (:func:`m2n_layout_problem`), an FP8 recipe the GPU lacks (:func:`fp8_recipe_problem`),
    FP8 rollouts (``rollout.quantization``) on a GPU without FP8 or with a float32 engine
    (:func:`rollout_quantization_problem`). Pure (no I/O): part of ``RunConfig.validate``, so a recipe fails at load, not after the
    model is built on the allocation."""
    from megatron_rl.planning.gpus import get_gpu

    p = config.parallel
    if config.rollout.weight_transport == "nccl_m2n":
        why = m2n_layout_problem(p.tensor, p.expert, p.pipeline, p.expert_tensor)
        if why is not None:
            raise ConfigError("rollout.weight_transport", why)
    gpu = get_gpu(config.cluster.gpu)
    problem = fp8_recipe_problem(config.model, f"cluster.gpu {gpu.name}", gpu.fp8_recipes)
    if problem is not None:
        raise ConfigError(*problem)
    why = rollout_quantization_problem(config, f"cluster.gpu {gpu.name}", gpu.capability)
    if why is not None:
        raise ConfigError("rollout.quantization", why)


def rollout_quantization_problem(
    config: RunConfig, where: str, capability: tuple[int, int] | None
) -> str | None:
    """Why FP8 rollouts (``rollout.quantization``) cannot run for ``config`` on ``where`` (a
    GPU of compute ``capability``; None: no GPU), or None. Serves the load-time check
    against ``cluster.gpu``, ``megatron-rl plan --gpu`` and the preflight's engine check
    against the GPU it runs on."""
    from megatron_rl.rollout.quantization import quantization_problem

    rollout = config.rollout
    if rollout.quantization is None:
        return None
    engine_dtype = config.model.dtype if rollout.dtype == "auto" else rollout.dtype
    if engine_dtype == "float32":
        return (
            f"{rollout.quantization!r} needs an engine dtype of bfloat16 or float16 (vLLM's FP8 "
            "methods take no float32 model); the engines run float32 (rollout.dtype "
            f"{rollout.dtype!r}, model.dtype {config.model.dtype!r}): set rollout.dtype: "
            "bfloat16"
        )
    return quantization_problem(rollout.quantization, where, capability)


def prompt_token_limit(config: RunConfig) -> int | None:
    """Longest prompt (tokens, BOS included) the run can take: the tightest of
    ``rollout.max_model_len``, ``model.max_sequence_length``, ``batch.micro_batch_tokens`` and
    the model's position embeddings, less the longest response (the rule of
    ``RunConfig._validate_lengths``); None when nothing bounds it.

    The data loader drops longer prompts whatever ``data.max_prompt_tokens`` says (that key
    may only lower the limit): with ``max_prompt_tokens: 0`` one over-long row otherwise
    reached the warm start (a 327 GB allocation) or failed the RL step that drew it."""
    positions = model_fields(config)[0].get("max_position_embeddings")
    limits = [
        config.rollout.max_model_len,
        config.model.max_sequence_length,
        config.batch.micro_batch_tokens,
        positions if isinstance(positions, int) else None,
    ]
    known = [limit for limit in limits if limit is not None]
    if not known:
        return None
    return max(0, min(known) - config.max_response_tokens())


def start_weights_problem(config: RunConfig) -> str | None:
    """Why ``config`` must not start (a production preset with no checkpoint and no
    ``model.allow_random_init``), or None. Without ``model.hf_path`` rank 0 writes a random fp32
    HF model of the preset to the run directory with the character tokenizer
    (``trainer.setup.prepare_hf_dir``): fine for the tiny presets, hundreds of GB of host
    memory and disk and a run that learns nothing for a production one."""
    from megatron_rl.models.presets import RANDOM_INIT_PRESETS

    model = config.model
    if model.hf_path is not None or model.allow_random_init:
        return None
    if model.preset in RANDOM_INIT_PRESETS:
        return None
    from megatron_rl.planning.shapes import model_shapes

    fp32_gb = model_shapes(model).total_parameters() * 4 / 1e9
    return (
        f"recipe key 'model.hf_path': not set, so the run would start from a random "
        f"initialisation of model.preset '{model.preset}' (rank 0 writes a ~{fp32_gb:,.0f} GB "
        f"fp32 HF model and the run uses the character tokenizer). Set "
        f"model.hf_path=/path/to/checkpoint (an HF directory: config.json, weights, "
        f"tokenizer), or model.allow_random_init=true to start from random weights on purpose"
    )


def check_start_weights(config: RunConfig) -> None:
    """Raise ConfigError when ``config`` would train a production preset from random weights
    (see :func:`start_weights_problem`). Called before any work by ``megatron-rl train`` /
    ``launch`` and by every rank in ``trainer.setup.build_run``."""
    problem = start_weights_problem(config)
    if problem is not None:
        raise ConfigError(problem)
