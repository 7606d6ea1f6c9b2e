"""Fused kernels (issue 31, section 4): a GPU model asks megatron-core for the fusions its
libraries provide (decided by the platform layer), a CPU model for none, and megatron's own
TransformerConfig validation accepts the GPU config."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl.models import ModelConfig
from megatron_rl.platform import FusedKernels, ParallelConfig

FUSIONS = (
    "gradient_accumulation_fusion",
    "apply_rope_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
)
ALL = FusedKernels(True, True, True, True, True)


class _Built(Exception):
    """Stops build_model once the TransformerConfig exists (no TE model on CPU)."""


def _gpu_config(monkeypatch, preset: str, kernels: FusedKernels, **model):
    """The TransformerConfig that ``build_model`` makes on a GPU machine with Transformer
    Engine and ``kernels``: megatron's real ``__post_init__`` runs, with TE's fused RoPE (the
    one thing it imports to check) stood in for, as on a machine with TE >= 2.3."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import transformer_config as megatron_config

    from megatron_rl.models import provider
    from megatron_rl.models.arch import transformer_config
    from megatron_rl.platform.device import Platform

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(megatron_config, "is_te_min_version", lambda *a, **k: True)
    built = []

    def real_config(*args, **kwargs):
        built.append(transformer_config(*args, **kwargs))
        raise _Built

    monkeypatch.setattr(provider, "transformer_config", real_config)
    gpu = Platform("cuda", "nccl", True, kernels=kernels)
    monkeypatch.setattr(provider, "get_platform", lambda: gpu)
    with pytest.raises(_Built):
        provider.build_model(
            ModelConfig(preset=preset, dtype="bfloat16", **model), ParallelConfig()
        )
    (config,) = built
    return config


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama4"])
def test_the_gpu_config_asks_for_every_available_fusion(preset, monkeypatch):
    config = _gpu_config(monkeypatch, preset, ALL)
    assert {name: getattr(config, name) for name in FUSIONS} == dict.fromkeys(FUSIONS, True)
    assert config.rotary_interleaved == (preset == "tiny-llama4")
    assert config.moe_grouped_gemm is False  # modelopt's packed-expert import (models/arch.py)


def test_kernel_fusion_false_asks_for_none(monkeypatch):
    config = _gpu_config(monkeypatch, "tiny-llama4", ALL, kernel_fusion=False)
    assert not any(getattr(config, name) for name in FUSIONS)


def test_fused_rope_follows_the_rope_layout(monkeypatch):
    """A TE older than 2.3 fuses plain RoPE but not Llama-4's interleaved RoPE."""
    old_te = FusedKernels(True, True, False, True, True)
    assert _gpu_config(monkeypatch, "tiny-llama", old_te).apply_rope_fusion is True
    assert _gpu_config(monkeypatch, "tiny-llama4", old_te).apply_rope_fusion is False


def test_megatron_rejects_rope_fusion_without_transformer_engine():
    """What the platform's decision protects against: megatron's own check (nothing stood in
    for) refuses a fused RoPE where TE does not import, as on this machine."""
    from megatron_rl.models.arch import architecture_from_hf, transformer_config
    from megatron_rl.models.presets import preset_hf_config

    arch = architecture_from_hf(preset_hf_config("tiny-llama"))
    args = (arch, ParallelConfig(), torch.bfloat16, True)
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        transformer_config(*args, kernels=FusedKernels(apply_rope_fusion=True))
    plain = transformer_config(*args, kernels=FusedKernels(bias_activation_fusion=True))
    assert plain.bias_activation_fusion and not plain.apply_rope_fusion


def test_the_cpu_platform_asks_for_none(megatron_single_rank):
    from megatron_rl.models.arch import architecture_from_hf, transformer_config
    from megatron_rl.models.presets import preset_hf_config
    from megatron_rl.platform import get_platform

    platform = get_platform()
    assert not platform.is_gpu and platform.kernels == FusedKernels()
    arch = architecture_from_hf(preset_hf_config("tiny-llama4"))
    config = transformer_config(
        arch, ParallelConfig(), torch.float32, True, kernels=platform.kernels
    )
    assert not any(getattr(config, name) for name in FUSIONS)


def test_detection_maps_each_library_to_its_fusion(monkeypatch):
    # Agrees with megatron's own probes on this machine (no apex, no TE).
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    from megatron_rl.platform import kernels

    assert kernels._imports("fused_weight_gradient_mlp_cuda") == layers._grad_accum_fusion_available
    assert kernels._te_rope()[0] == (rope_utils.fused_apply_rotary_pos_emb is not None)

    def detect(modules: set[str], rope: tuple[bool, bool], cc: bool = True) -> FusedKernels:
        monkeypatch.setattr(kernels, "_imports", lambda name: name in modules)
        grad_accum = "fused_weight_gradient_mlp_cuda" in modules
        monkeypatch.setattr(kernels, "_grad_accum_fusion", lambda: grad_accum)
        monkeypatch.setattr(kernels, "_te_rope", lambda: rope)
        monkeypatch.setattr(kernels, "_c_compiler", lambda: cc)
        return kernels.detect_fused_kernels.__wrapped__()

    assert detect(set(), (False, False)) == FusedKernels()
    apex = {"fused_weight_gradient_mlp_cuda", "scaled_masked_softmax_cuda"}
    apex.add("scaled_upper_triang_masked_softmax_cuda")
    assert detect(apex, (False, False)) == FusedKernels(
        gradient_accumulation_fusion=True, masked_softmax_fusion=True
    )
    assert detect({"triton"}, (True, True)) == FusedKernels(
        apply_rope_fusion=True, interleaved_rope_fusion=True, bias_activation_fusion=True
    )
    # Triton without a C compiler cannot build its launcher: torch.compile would fail.
    assert detect({"triton"}, (False, False), cc=False) == FusedKernels()


def test_an_extension_that_is_found_but_does_not_import_is_off(tmp_path, monkeypatch):
    # apex's kernels after vLLM's install replaced torch: the extension is on the path
    # (find_spec finds it) but its import raises; megatron then leaves its flag False and
    # ColumnParallelLinear refuses gradient_accumulation_fusion, so we must not ask for it.
    import importlib.util

    from megatron.core.tensor_parallel import layers

    from megatron_rl.platform import kernels

    for name in (
        "fused_weight_gradient_mlp_cuda",
        "scaled_masked_softmax_cuda",
        "scaled_upper_triang_masked_softmax_cuda",
    ):
        (tmp_path / f"{name}.py").write_text(
            "raise ImportError('undefined symbol: _ZN3c1017RegisterOperators')\n"
        )
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    assert not kernels._imports("scaled_masked_softmax_cuda")
    found = kernels.detect_fused_kernels.__wrapped__()
    assert not found.gradient_accumulation_fusion
    assert not found.masked_softmax_fusion
    # and it is megatron's own flag that decides: where its import succeeded, on
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    assert kernels.detect_fused_kernels.__wrapped__().gradient_accumulation_fusion


class _WgradAccumulation:
    """apex's ``fused_weight_gradient_mlp_cuda`` in torch: ``main_grad += d_out^T @ input``
    (fp32 accumulation), what megatron's local linears call under gradient-accumulation
    fusion."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.float().t() @ total_input.float())

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _bf16_grads(monkeypatch, preset: str, kernels: FusedKernels, state=None):
    """Build ``preset`` in bf16 with the FP32 head and ``kernels``, train one step inside
    megatron's DDP (as the trainer does) and return (state_dict, {name: main_grad})."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_rl.models import provider
    from megatron_rl.models.logprobs import token_logprobs
    from megatron_rl.platform.device import Platform

    monkeypatch.setattr(
        provider, "get_platform", lambda: Platform("cpu", "gloo", False, None, kernels)
    )
    torch.manual_seed(0)
    model = provider.build_model(ModelConfig(preset=preset, dtype="bfloat16"), ParallelConfig())
    if state is not None:
        model.load_state_dict(state)
    model.train()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    ddp.zero_grad_buffer()
    tokens = torch.randint(3, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    (-token_logprobs(ddp, tokens).float().mean()).backward()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    return model.state_dict(), grads, model


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-tied"])
def test_fused_weight_gradients_equal_unfused_ones_with_the_fp32_head(
    preset, monkeypatch, megatron_single_rank
):
    """With gradient-accumulation fusion (apex's kernel stood in for by torch), a BF16 model
    with the FP32 head trains to the same gradients as without: the head's upcast weight has
    no main_grad to accumulate into, so its wgrad stays unfused (it crashed before)."""
    from megatron.core.tensor_parallel import layers

    state, reference, _ = _bf16_grads(monkeypatch, preset, FusedKernels())
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", _WgradAccumulation, raising=False)
    fused_kernels = FusedKernels(gradient_accumulation_fusion=True)
    _, fused, model = _bf16_grads(monkeypatch, preset, fused_kernels, state)
    assert model.decoder.layers[0].mlp.linear_fc1.gradient_accumulation_fusion
    assert not model.output_layer.gradient_accumulation_fusion
    assert fused.keys() == reference.keys()
    for name, grad in reference.items():
        assert grad.abs().sum() > 0, name
        error = (fused[name] - grad).norm() / grad.norm()
        assert error < 2e-2, (name, error.item())


def test_megatron_drops_interleaved_on_a_packed_micro_batchs_fused_rope(monkeypatch):
    # What the detection below rests on (megatron-core 0.16.1, rope_utils.apply_rotary_pos_emb):
    # with apply_rope_fusion and cu_seqlens (a packed micro-batch, the GPU default) the TE
    # THD kernel is called without ``interleaved``, whatever rotary_interleaved says. When
    # megatron passes it, this fails: then let _te_rope turn interleaved fusion back on.
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    calls = []

    def thd(t, cu_seqlens, freqs, *args, **kwargs):
        calls.append((args, kwargs))
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", thd)
    config = SimpleNamespace(
        apply_rope_fusion=True, rotary_interleaved=True, multi_latent_attention=False
    )
    group = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    t = torch.zeros(8, 1, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    rope_utils.apply_rotary_pos_emb(
        t, torch.zeros(8, 1, 1, 4), config, cu_seqlens=cu, cp_group=group
    )
    assert len(calls) == 1
    args, kwargs = calls[0]
    assert "interleaved" not in kwargs and True not in args


def test_interleaved_rope_is_not_fused_where_megatron_would_drop_it(monkeypatch):
    # A Transformer Engine >= 2.3 whose fused RoPE megatron imported: plain RoPE is fused,
    # Llama-4's interleaved RoPE is not (the test above: packed micro-batches would rotate
    # the wrong dimensions, silently).
    import megatron.core.utils as mcore_utils
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.platform import kernels

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(mcore_utils, "is_te_min_version", lambda *a, **k: True)
    assert kernels._te_rope() == (True, False)
