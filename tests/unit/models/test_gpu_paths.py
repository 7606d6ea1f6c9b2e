"""GPU-only paths: Transformer Engine specs (BF16/FP8), Megatron optimizer, pipeline schedules.

Marked ``gpu``: skipped on machines without CUDA (conftest), run where CUDA exists. The CPU
suite covers the code that chooses between the paths (test_models.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_rl.models import ModelConfig
from megatron_rl.platform import ParallelConfig

pytestmark = pytest.mark.gpu

TOKENS = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(0))
# Transformer Engine layer specs where TE is installed; else megatron's local specs on GPU
# (e.g. the lent H200 machine: torch only, see tools/gpu_check.sh).
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
SPEC = "te" if HAS_TE else "local"
needs_te = pytest.mark.skipif(not HAS_TE, reason="needs Transformer Engine")


@pytest.fixture(scope="module")
def gpu_rank():
    from megatron_rl.platform import init_distributed

    init_distributed(ParallelConfig())
    yield


def _model(hf_dir, **kwargs):
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models.provider import build_model

    cfg = ModelConfig(hf_path=hf_dir, **kwargs)
    model = build_model(cfg, ParallelConfig())
    load_hf_weights(model, hf_dir, getattr(torch, cfg.dtype))
    return model.eval()


def test_platform_picks_nccl_and_te(gpu_rank):
    from megatron_rl.platform import get_platform

    platform = get_platform()
    assert (platform.device, platform.backend) == ("cuda", "nccl")
    assert platform.transformer_engine == HAS_TE


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama4"])
def test_bf16_logits_close_to_transformers(tiny_hf_dirs, gpu_rank, name):
    import transformers

    from megatron_rl.models.logprobs import forward_logits

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dirs[name], dtype=torch.float32)
    with torch.no_grad():
        ref = hf.cuda().eval()(TOKENS.cuda()).logits
        model = _model(tiny_hf_dirs[name], dtype="bfloat16", layer_spec=SPEC)
        out = forward_logits(model, TOKENS.cuda())
    assert out.dtype == torch.float32  # FP32 head
    assert (out - ref).abs().max().item() < 5e-2


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama4"])
def test_packed_logprobs_equal_padded_on_gpu(tiny_hf_dirs, gpu_rank, name):
    """batch.pack on CUDA: three sequences packed back to back (THD, ``cu_seqlens``) have the
    log-probs of the padded batch: Transformer Engine's ``thd`` attention where TE is
    installed (BF16: its fused kernels take no FP32), else the SDPA core attention (FP32)
    attending each sequence alone; tiny-llama4: chunked attention and NoPE temperature from
    each sequence's start."""
    from megatron_rl.models.logprobs import token_logprobs
    from megatron_rl.trainer.packing import cu_seqlens_of

    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 128, (n,), generator=gen) for n in (48, 9, 33)]
    padded = torch.zeros((3, 48), dtype=torch.long)
    for i, q in enumerate(seqs):
        padded[i, : len(q)] = q
    cu = cu_seqlens_of([len(q) for q in seqs])
    dtype, tol = ("bfloat16", 5e-2) if HAS_TE else ("float32", 1e-4)
    with torch.no_grad():
        model = _model(tiny_hf_dirs[name], dtype=dtype, layer_spec=SPEC)
        ref = token_logprobs(model, padded.cuda())
        packed = token_logprobs(model, torch.cat(seqs)[None].cuda(), cu_seqlens=cu.cuda())[0]
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        n = end - start - 1  # the log-probs within the sequence (not across its end)
        assert (packed[start : start + n] - ref[i, :n]).abs().max().item() < tol, (name, i)


@needs_te
def test_te_fp8_forward_runs(tiny_hf_dirs, gpu_rank):
    from transformer_engine.pytorch import fp8_autocast

    from megatron_rl.models.logprobs import token_logprobs

    model = _model(tiny_hf_dirs["tiny-llama"], dtype="bfloat16", layer_spec="te", fp8="hybrid")
    with torch.no_grad(), fp8_autocast(enabled=True):
        lp = token_logprobs(model, TOKENS.cuda())
    assert torch.isfinite(lp).all()


def test_megatron_distributed_optimizer_step_changes_weights(tiny_hf_dirs, gpu_rank):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.models.logprobs import token_logprobs

    model = _model(tiny_hf_dirs["tiny-llama"], dtype="bfloat16", layer_spec=SPEC)
    model.train()
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True), [ddp]
    )
    before = model.output_layer.weight.detach().clone()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    (-token_logprobs(ddp, TOKENS.cuda()).mean()).backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0
    assert not torch.equal(before, model.output_layer.weight.detach())


def test_pipeline_schedule_forward_backward(tiny_hf_dirs, gpu_rank):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.models.logprobs import forward_logits

    model = _model(tiny_hf_dirs["tiny-llama"], dtype="bfloat16", layer_spec=SPEC)
    model.train()
    # Inside megatron's DDP, as the trainer runs it: with gradient-accumulation fusion (where
    # apex's extension imports, Platform.kernels) weight gradients go to DDP's main_grad.
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    ddp.zero_grad_buffer()
    tokens = TOKENS.cuda()

    def step(data_iterator, m):
        out = forward_logits(m, next(data_iterator))
        return out, lambda o: (o.float().pow(2).mean(), {"loss": o.float().pow(2).mean().detach()})

    losses = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([tokens, tokens]),
        model=[ddp],
        num_microbatches=2,
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=False,
    )
    assert len(losses) == 2
    assert model.output_layer.weight.main_grad.abs().sum().item() > 0
    assert model.decoder.layers[0].mlp.linear_fc1.weight.main_grad.abs().sum().item() > 0


def test_policy_update_with_distributed_optimizer_and_its_checkpoint(
    tiny_hf_dirs, gpu_rank, tmp_path
):
    """The trainer's own path on GPU: DDP + distributed optimizer (bf16, fp32 main params),
    one policy update, then the optimizer state through dist_checkpointing and back."""
    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.trainer.batch import TrainSample
    from megatron_rl.trainer.optim import build_optimizer, wrap_model
    from megatron_rl.trainer.state import CheckpointManager
    from megatron_rl.trainer.step import policy_update

    model = _model(tiny_hf_dirs["tiny-llama"], dtype="bfloat16", layer_spec=SPEC)
    ddp = wrap_model(model)
    assert ddp.ddp_config.use_distributed_optimizer  # the GPU default
    optim = build_optimizer(ddp, OptimizerConfig(lr=1e-3, warmup_steps=0))
    gen = torch.Generator().manual_seed(0)
    samples = [
        TrainSample(g, g, [5, 6, 7], torch.randint(3, 128, (6,), generator=gen).tolist(),
                    [-2.0] * 6, [True] * 6, float(r), [0] * 6)
        for g, rewards in enumerate([[1, 0], [0, 1]]) for r in rewards
    ]  # fmt: skip
    before = model.output_layer.weight.detach().clone()
    result = policy_update(ddp, optim.optimizer, samples, AlgorithmConfig(), 2)
    assert result.grad_norm > 0 and result.num_tokens == 24
    assert not torch.equal(before, model.output_layer.weight.detach())
    manager = CheckpointManager(tmp_path)
    manager.save(1, model, {"x": 1}, optimizer=optim.optimizer)
    after = model.output_layer.weight.detach().clone()
    policy_update(ddp, optim.optimizer, samples, AlgorithmConfig(), 2)
    assert manager.load(model, optimizer=optim.optimizer).extra == {"x": 1}
    assert torch.equal(after, model.output_layer.weight.detach())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL weight transfer needs 2 GPUs")
def test_nccl_weight_transport_parity(tiny_hf_dirs):
    """Trainer on GPU 0, engine process on GPU 1, weights by NCCL broadcast (vLLM's nccl
    backend): after the push vLLM's log-probs match Megatron's."""
    from megatron_rl.rollout.parity import ParityOptions, check_parity

    result = check_parity(ParityOptions(tiny_hf_dirs["tiny-llama"], transport="nccl"))
    assert result.placement == "subprocess" and result.bytes_pushed > 0
    assert result.max_abs_delta < 1e-3 < result.before_max_abs_delta
