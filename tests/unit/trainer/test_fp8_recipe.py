"""The FP8 scaling recipe is a recipe key (issue 27, 2.5): it reaches megatron-core's
TransformerConfig, and a micro-batch's tokens pad to what that recipe's GEMMs need."""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "tiny_cpu.yaml"
FP8 = ["model.dtype=bfloat16", "model.fp8=hybrid"]
# Transformer Engine's alignment of the token dimension per recipe: MXFP8 scales blocks of 32
# elements (one E8M0 scale per 32 values), the others need 16 for the FP8 tensor-core GEMMs.
ALIGN = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}


class _Built(Exception):
    """Stops build_model once the TransformerConfig exists (no TE model on CPU)."""


@pytest.mark.parametrize("recipe", [None, "delayed", "tensorwise", "mxfp8", "blockwise"])
def test_the_fp8_recipe_key_reaches_megatrons_transformer_config(recipe, monkeypatch):
    """``model.fp8_recipe`` (null: delayed) is megatron's ``fp8_recipe``, through
    ``build_model``, in a real TransformerConfig (its __post_init__ checks run); it was
    'delayed' whatever the recipe said."""
    from megatron_rl.config import load_run_config
    from megatron_rl.models import provider
    from megatron_rl.platform.device import Platform

    overrides = FP8 + ([f"model.fp8_recipe={recipe}"] if recipe else [])
    cfg = load_run_config(RECIPE, overrides)
    built = []

    def real_config(*args, **kwargs):
        built.append(provider.transformer_config.__wrapped__(*args, **kwargs))
        raise _Built

    real_config.__wrapped__ = provider.transformer_config
    monkeypatch.setattr(provider, "transformer_config", real_config)
    # build_model's TE check on a GPU with TE; the config is built before any TE module
    monkeypatch.setattr(provider, "get_platform", lambda: Platform("cuda", "nccl", True))
    with pytest.raises(_Built):
        provider.build_model(cfg.model, cfg.parallel)
    (config,) = built
    assert (config.fp8, config.fp8_recipe) == ("hybrid", recipe or "delayed")


@pytest.mark.parametrize("recipe", sorted(ALIGN))
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (4, False), (2, True), (4, True)])
def test_tokens_pad_to_the_recipes_alignment(recipe, tp, sp):
    """MXFP8 needs sequences that divide by 32 (per TP rank with sequence parallelism), the
    other recipes 16; no FP8: no padding."""
    from megatron_rl.trainer.batch import padded_length, token_multiple

    multiple = token_multiple(recipe, tp, sp)
    assert multiple == ALIGN[recipe] * (tp if sp else 1)
    for length in (1, 17, 33, 100):
        per_rank = padded_length(length, multiple) // (tp if sp else 1)
        assert per_rank % ALIGN[recipe] == 0
    assert token_multiple(None, tp, sp) == 1


def test_the_loops_padding_follows_the_recipe_key():
    """What the loop passes: ``ModelConfig.fp8_scaling`` of the loaded recipe."""
    from megatron_rl.config import load_run_config
    from megatron_rl.trainer.batch import token_multiple

    mx = load_run_config(RECIPE, [*FP8, "model.fp8_recipe=mxfp8"]).model
    assert token_multiple(mx.fp8_scaling, 2, True) == 64
    assert load_run_config(RECIPE, FP8).model.fp8_scaling == "delayed"
    assert load_run_config(RECIPE, []).model.fp8_scaling is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.fp8_recipe=mxfp8"], r"model.fp8_recipe.*'mxfp8' needs fp8"),
        ([*FP8, "model.fp8_recipe=nvfp4"], r"model.fp8_recipe"),
    ],
)
def test_bad_fp8_recipe_names_the_key(overrides, message):
    from megatron_rl.config import load_run_config

    with pytest.raises(ValueError, match=message):
        load_run_config(RECIPE, overrides)
