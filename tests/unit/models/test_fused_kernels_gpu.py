"""The fused kernels this GPU machine can load (``platform.kernels.detect_fused_kernels``),
each built into a real model and checked against the unfused one (issue 36, 13). On the lent
H200 (no apex, no Transformer Engine) that is megatron's SwiGLU fusion, compiled by
``torch.compile`` / Triton. Skipped without CUDA (conftest)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import ModelConfig
from megatron_rl.platform import FusedKernels, ParallelConfig

pytestmark = pytest.mark.gpu


def _step(monkeypatch, kernels: FusedKernels, state=None):
    """tiny-llama in bf16 with ``kernels`` on this GPU, one forward and backward inside
    megatron's DDP: (state_dict, log-probs, {name: main_grad}, model config)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_rl.models import provider
    from megatron_rl.models.logprobs import token_logprobs
    from megatron_rl.platform.device import Platform

    gpu = Platform("cuda", "nccl", False, None, kernels)  # local layer specs: no TE here
    monkeypatch.setattr(provider, "get_platform", lambda: gpu)
    torch.manual_seed(0)
    config = ModelConfig(preset="tiny-llama", dtype="bfloat16", layer_spec="local")
    model = provider.build_model(config, ParallelConfig())
    if state is not None:
        model.load_state_dict(state)
    model.train()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 128, (2, 64), generator=gen).cuda()
    logprobs = token_logprobs(ddp, tokens).float()
    (-logprobs.mean()).backward()
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    return model.state_dict(), logprobs.detach(), grads, model.config


def test_every_fusion_this_gpu_loads_runs_and_matches_the_unfused_model(
    monkeypatch, megatron_single_rank
):
    from megatron_rl.platform import get_platform

    detected = get_platform().kernels
    print(f"fused kernels on this GPU: {detected}")
    if detected == FusedKernels():
        pytest.skip("no fused kernel loads on this machine (no apex, TE or Triton + C compiler)")
    state, reference, reference_grads, _ = _step(monkeypatch, FusedKernels())
    _, fused, grads, config = _step(monkeypatch, detected, state)
    for option, value in detected.transformer_config_options(False).items():
        assert getattr(config, option) == value, option
    assert (fused - reference).abs().max() < 5e-2
    for name, grad in reference_grads.items():
        assert grad.abs().sum() > 0, name
        assert (grads[name] - grad).norm() / grad.norm() < 2e-2, name
