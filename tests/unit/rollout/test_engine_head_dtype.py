"""``rollout.fp32_head`` reaches the LM head vLLM builds: that of a text-only model and that of
Llama-4 Scout's multimodal ``Llama4ForConditionalGeneration``, whose language model vLLM
builds with its ``text_config`` as the model's config.

On the CPU a float32 engine's head is float32 either way; on a GPU with a BF16 engine a head
that misses the override runs in BF16 while the trainer's runs in FP32 (silently: the
log-probs only drift apart). Scout's own vLLM ``ModelConfig`` needs torchvision, absent from
the CPU build: its config goes through vLLM's own override steps up to the config its
language model's ``LogitsProcessor`` reads."""

from __future__ import annotations

import copy
import tempfile

import torch
from support.hf_configs import hf_dir_with_config, scout_config


def _vllm_head_dtype(hf_dir: str, hf_overrides: dict) -> torch.dtype:
    """The ``head_dtype`` of a multimodal model's language model in a BF16 engine, by vLLM's
    own steps: ``ModelConfig.__post_init__`` splits ``hf_overrides`` into flat ones (applied
    by ``get_config``) and nested ones (``_apply_dict_overrides``);
    ``VllmConfig.with_hf_config`` gives the language model a deep copy of ``text_config``
    (``mllama4.py``: ``with_hf_config(config.text_config, ["LlamaForCausalLM"])``), whose
    ``head_dtype`` ``LogitsProcessor`` reads (``ModelConfig.head_dtype``: ``_get_head_dtype``)."""
    from vllm.config.model import ModelConfig, _get_head_dtype
    from vllm.transformers_utils.config import get_config

    flat = {k: v for k, v in hf_overrides.items() if not isinstance(v, dict)}
    nested = {k: v for k, v in hf_overrides.items() if isinstance(v, dict)}
    config = get_config(hf_dir, trust_remote_code=False, hf_overrides_kw=flat)
    assert type(config).__name__ == "Llama4Config"
    # the method uses only the instance's _update_nested, which uses nothing of it
    ModelConfig._apply_dict_overrides(ModelConfig.__new__(ModelConfig), config, nested)
    language_model = copy.deepcopy(config.text_config)
    return _get_head_dtype(config=language_model, dtype=torch.bfloat16, runner_type="generate")


def test_scouts_language_model_gets_the_fp32_head(tmp_path, monkeypatch):
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import engine_args

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scout = hf_dir_with_config(tmp_path / "scout", scout_config())
    args = engine_args(str(scout), RolloutConfig(fp32_head=True), 0)
    assert _vllm_head_dtype(args.hf_config_path or str(scout), args.hf_overrides) == torch.float32
    # and without rollout.fp32_head the model's dtype
    plain = engine_args(str(scout), RolloutConfig(fp32_head=False), 0)
    assert plain.hf_overrides is None


def test_a_text_only_engine_gets_the_fp32_head_and_its_config_stays_whole(tiny_hf_dirs):
    """vLLM's ModelConfig of a text-only model (tiny-llama4: Llama4ForCausalLM) with the
    engine's overrides: an FP32 head, and no stray ``text_config`` attribute (a nested
    override on a config without one would set a dict there)."""
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import engine_args

    args = engine_args(tiny_hf_dirs["tiny-llama4"], RolloutConfig(fp32_head=True), 0)
    args.dtype = "bfloat16"
    model_config = args.create_model_config()
    assert not model_config.is_multimodal_model
    assert model_config.head_dtype == torch.float32
    assert not isinstance(getattr(model_config.hf_config, "text_config", None), dict)
    assert model_config.hf_config.get_text_config() is model_config.hf_config
