"""Checkpoint keys of the two layer specs: Transformer Engine's (GPU) and the local one (CPU,
the background HF export, hf-to-mcore) must name every tensor alike, so that either loads
the other's checkpoints. TE is not installed here: its layer specs are built by
megatron-core's own spec functions (which only name TE's classes) and the keys derived from
their structure, the derivation checked against a real local-spec model."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models.specs import decoder_layer_specs

NORMS = ("input_layernorm", "pre_mlp_layernorm")


@pytest.fixture
def te_layer_specs(monkeypatch):
    """megatron-core's TE layer specs without TE: ``gpt_layer_specs`` imports its
    ``TESpecProvider`` only when TE imports, and the expert MLP's choice reads TE's version.
    Without TE, megatron's TE classes are MagicMocks (extensions/transformer_engine.py), which
    ``copy.deepcopy`` cannot copy: the specs are used as megatron's functions return them (a
    new spec per call)."""
    from types import SimpleNamespace

    from megatron.core import utils
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from packaging.version import Version

    from megatron_rl.models import specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", TESpecProvider, raising=False)
    monkeypatch.setattr(utils, "_te_version", Version("2.9.0"))
    monkeypatch.setattr(specs, "copy", SimpleNamespace(deepcopy=lambda spec: spec))


def norm_keys_of_spec(spec) -> dict[str, str]:
    """The checkpoint keys of a layer's two norms, read off its ModuleSpec: a norm that is
    IdentityOp lives in the next linear (TE's LayerNorm-linear: ``layer_norm_weight``), else in
    its own module (``weight``); then the layer's ``sharded_state_dict_keys_map``, applied as
    megatron's TransformerLayer does (first matching prefix)."""
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    sub = spec.submodules
    fused_into = {
        "input_layernorm": ("self_attention.linear_qkv", sub.self_attention.submodules.linear_qkv),
        "pre_mlp_layernorm": ("mlp.linear_fc1", getattr(sub.mlp.submodules, "linear_fc1", None)),
    }
    keys = {}
    for norm in NORMS:
        if getattr(sub, norm) is IdentityOp:
            name, linear = fused_into[norm]
            assert linear is TELayerNormColumnParallelLinear, (norm, linear)  # fused there
            key = f"{name}.layer_norm_weight"
        else:
            key = f"{norm}.weight"
        for old, new in sub.sharded_state_dict_keys_map.items():
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        keys[norm] = key
    return keys


def _arch_and_config(name: str):
    from megatron_rl.models.arch import architecture_from_hf, transformer_config
    from megatron_rl.models.presets import preset_hf_config
    from megatron_rl.platform import ParallelConfig

    arch = architecture_from_hf(preset_hf_config(name))
    return arch, transformer_config(arch, ParallelConfig(), torch.float32, True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama4", "llama4-scout"])
def test_te_and_local_specs_give_the_norms_the_same_checkpoint_keys(te_layer_specs, name):
    arch, config = _arch_and_config(name)
    te = [norm_keys_of_spec(s) for s in decoder_layer_specs(config, arch, use_te=True)]
    local = [norm_keys_of_spec(s) for s in decoder_layer_specs(config, arch, use_te=False)]
    assert local == te
    if arch.layout.moe[-1]:  # TE keeps a separate norm before a MoE layer
        assert te[-1]["pre_mlp_layernorm"] == "pre_mlp_layernorm.weight"


def test_the_derivation_gives_a_local_models_real_checkpoint_keys(
    tiny_hf_dirs, megatron_single_rank
):
    """norm_keys_of_spec against megatron: the keys a local-spec tiny-llama4 (dense and MoE
    layers) really writes into its dist checkpoint."""
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    cfg = ModelConfig(hf_path=tiny_hf_dirs["tiny-llama4"], dtype="float32", layer_spec="local")
    model = build_model(cfg, ParallelConfig())
    sharded = model.sharded_state_dict()
    arch, config = _arch_and_config("tiny-llama4")
    specs = decoder_layer_specs(config, arch, use_te=False)
    for i, spec in enumerate(specs):
        derived = norm_keys_of_spec(spec)
        for norm in NORMS:
            assert sharded[f"decoder.layers.{i}.{norm}.weight"].key == (
                f"decoder.layers.{i}.{derived[norm]}"
            )
    assert any(arch.layout.moe) and not all(arch.layout.moe)


def _old_local_layer_spec(config, moe: bool, use_te: bool):
    """models.specs._layer_spec before it kept TE's name: megatron's local spec as it is."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert not use_te
    return copy.deepcopy(
        get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if moe else None,
            moe_grouped_gemm=config.moe_grouped_gemm,
            normalization="RMSNorm",
        )
    )


def _moments(optimizer) -> list[torch.Tensor]:
    return [
        state[key]
        for opt in getattr(optimizer, "chained_optimizers", [optimizer])
        for group in opt.optimizer.param_groups
        for p in group["params"]
        for state in [opt.optimizer.state[p]]
        for key in ("exp_avg", "exp_avg_sq")
    ]


def _trainer(hf_dir: str):
    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig
    from megatron_rl.trainer.optim import _materialize_state, build_optimizer, wrap_model

    cfg = ModelConfig(hf_path=hf_dir, dtype="float32", layer_spec="local")
    model = build_model(cfg, ParallelConfig())
    optimizer = build_optimizer(wrap_model(model), OptimizerConfig(lr=1e-3)).optimizer
    _materialize_state(optimizer)
    return model, optimizer


def test_a_checkpoint_with_the_old_local_names_still_loads(
    tiny_hf_dirs, megatron_single_rank, tmp_path, monkeypatch
):
    """Checkpoints the local spec wrote before it kept TE's name (every hf-to-mcore conversion
    of Scout, every CPU run) name a MoE layer's pre-MLP norm mlp.linear_fc1.layer_norm_weight:
    model and optimizer load (conversion.checkpoint.with_legacy_keys)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.conversion import checkpoint
    from megatron_rl.models import specs
    from megatron_rl.models.presets import preset_hf_config
    from megatron_rl.trainer.optim import load_optimizer, save_optimizer

    hf_dir = tiny_hf_dirs["tiny-llama4"]
    with monkeypatch.context() as old:
        old.setattr(specs, "_layer_spec", _old_local_layer_spec)
        model, optimizer = _trainer(hf_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*model.parameters(), *_moments(optimizer)]:
            t.copy_(torch.randn(t.shape, generator=gen))
    ckpt = tmp_path / "old"
    checkpoint.save_model(model, ckpt, preset_hf_config("tiny-llama4"))
    save_optimizer(optimizer, model, tmp_path / "old_optimizer")
    stored = set(dist_checkpointing.load_tensors_metadata(str(ckpt / checkpoint.MODEL_SUBDIR)))
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in stored  # MoE layer 1
    assert not any("pre_mlp_layernorm" in key for key in stored)

    new_model, new_optimizer = _trainer(hf_dir)
    assert new_model.sharded_state_dict()["decoder.layers.1.pre_mlp_layernorm.weight"].key == (
        "decoder.layers.1.pre_mlp_layernorm.weight"
    )
    checkpoint.load_model(new_model, ckpt)
    load_optimizer(new_optimizer, new_model, tmp_path / "old_optimizer")
    for (name, a), b in zip(model.state_dict().items(), new_model.state_dict().values()):
        if isinstance(a, torch.Tensor) and "_extra" not in name:
            assert torch.equal(a, b), name
    for a, b in zip(_moments(optimizer), _moments(new_optimizer), strict=True):
        assert torch.equal(a, b)
