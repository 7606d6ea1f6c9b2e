"""FP8 rollouts (issue 39, part 3): ``rollout.quantization``.

What a CPU can check: the engines' quantization of a pushed bucket against vLLM's own
quantizers (``per_block_cast_to_fp8`` runs on CPU; the static per-tensor kernel does not exist
in vLLM's CPU build, so its torch form ``QuantFP8.forward_native`` and a float64 reference
stand in), the mapping to vLLM's online methods, the config and GPU checks, the planner's
weight / KV-cache numbers (by hand), and the FP8 log-prob gap limit. The GPU test (``-m gpu``,
in ``tools/gpu_check.sh``: CUDA torch, no vLLM there) runs the quantizer on CUDA against the
CPU result.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megatron_rl.config import load_run_config
from megatron_rl.config.checks import rollout_quantization_problem
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.sections import FP8_LOGPROB_GAP_LIMIT, LOGPROB_GAP_LIMITS, TrainingConfig
from megatron_rl.planning.engine import engine_bytes, engine_weight_bytes
from megatron_rl.planning.shapes import ModelShapes
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.quantization import (
    VLLM_QUANTIZATION,
    dequantize_fp8,
    engine_linear_weights,
    quantization_problem,
    quantize_fp8,
)

FP8 = torch.float8_e4m3fn


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A bf16 weight with a few outliers (they set the scales) and an all-small block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[3, 5], w[rows - 1, cols - 1] = 0.9, -1.7
    w[128:256, 128:256] *= 1e-3
    return w.to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# -- the quantizer against vLLM's --------------------------------------------------------


def test_block_quantization_equals_vllms_per_block_cast_on_cpu():
    """vLLM fp8_per_block quantizes a layer with ``per_block_cast_to_fp8`` (online/fp8.py
    ``Fp8PerBlockOnlineLinearMethod``): same FP8 bits, same [ceil(out/128), ceil(in/128)]
    float32 ``weight_scale_inv``, including the zero-padded edge blocks."""
    pytest.importorskip("vllm")
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = _weight(300, 260)
    q, scale = quantize_fp8(w, "fp8_block")
    ref_q, ref_scale = per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
    assert q.dtype == ref_q.dtype == FP8 and q.shape == (300, 260)
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape == (3, 3)
    assert torch.equal(_bits(q), _bits(ref_q))
    assert torch.equal(scale, ref_scale)
    # by hand: the block holding w[3, 5] = 0.9 (bf16 0.8984375) has scale amax / 448
    assert scale[0, 0].item() == pytest.approx(w[3, 5].float().item() / 448, rel=1e-7)
    assert q[3, 5].float().item() == 448.0 and q[299, 259].float().item() == -448.0


def test_per_tensor_quantization_equals_vllms_static_quant_and_a_float64_reference():
    """vLLM fp8_per_tensor: scale = amax / 448 (online/fp8.py:258-261), then the static
    per-tensor kernel (``ops.scaled_fp8_quant``, absent from vLLM's CPU build); its torch form
    ``QuantFP8.forward_native`` gives the same bits as ours, and a float64 reference agrees
    to within one e4m3 step where float32 rounding sits on a rounding midpoint."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    w = _weight(300, 260, seed=1)
    q, scale = quantize_fp8(w, "fp8")
    assert q.dtype == FP8 and q.shape == (300, 260) and scale.shape == (1,)
    amax64 = w.double().abs().max()
    assert scale.double().item() == pytest.approx((amax64 / 448).item(), rel=1e-7)
    with set_current_vllm_config(VllmConfig()):
        static = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False)
        ref_q, ref_scale = static.forward_native(w, scale)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(ref_scale.reshape(1), scale)
    ref64 = (w.double() / (amax64 / 448)).clamp(-448, 448).to(FP8)
    differ = _bits(q) != _bits(ref64)
    assert differ.float().mean().item() < 1e-3
    if differ.any():  # one step of e4m3 apart (adjacent codes of the same sign)
        steps = (_bits(q)[differ].int() - _bits(ref64)[differ].int()).abs()
        assert int(steps.max()) == 1
    # what the engine computes with is within e4m3's relative step (2^-3 for a 3-bit
    # mantissa, halved by rounding) of the weight, above the subnormal range
    deq = dequantize_fp8(q, scale, "fp8")
    normal = w.float().abs() > scale.item() * 2**-6
    rel = ((deq - w.float()).abs() / w.float().abs())[normal]
    assert rel.max().item() <= 2**-4 + 1e-6


def test_a_pushed_bucket_is_quantized_per_fused_layer_as_the_engine_holds_it():
    """A bucket of HF-named tensors: vLLM stacks q, k, v (and gate, up) into one layer and
    takes one per-tensor scale over it; embeddings, norms and the head stay unquantized; a
    fused layer whose shards are not all in the bucket waits (the engine's layerwise reload
    quantizes a layer once all of it has arrived)."""
    p = "model.layers.0"
    q, k, v = _weight(256, 128, 2), _weight(64, 128, 3), _weight(64, 128, 4)
    v[0, 0] = 3.0  # v holds the fused layer's amax
    bucket = [
        ("model.embed_tokens.weight", _weight(512, 128, 5)),
        (f"{p}.self_attn.q_proj.weight", q),
        (f"{p}.self_attn.k_proj.weight", k),
        (f"{p}.self_attn.v_proj.weight", v),
        (f"{p}.self_attn.o_proj.weight", _weight(128, 256, 6)),
        (f"{p}.input_layernorm.weight", torch.ones(128, dtype=torch.bfloat16)),
        (f"{p}.mlp.gate_proj.weight", _weight(384, 128, 7)),  # up_proj in the next bucket
        ("lm_head.weight", _weight(512, 128, 8)),
    ]
    layers = engine_linear_weights(bucket)
    assert sorted(layers) == [f"{p}.self_attn.o_proj.weight", f"{p}.self_attn.qkv_proj.weight"]
    qkv = layers[f"{p}.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([q, k, v]))
    _, scale = quantize_fp8(qkv, "fp8")
    assert scale.item() == pytest.approx(3.0 / 448, rel=1e-7)  # one scale for q, k and v
    _, q_alone = quantize_fp8(q, "fp8")
    assert q_alone.item() < scale.item()  # q's own scale would differ: the fusion matters


def test_our_names_map_to_vllms_online_fp8_methods():
    """``fp8`` / ``fp8_block`` are vLLM's online shorthands (config/quantization.py), with
    per-tensor and 128 x 128 block weight scales."""
    pytest.importorskip("vllm")
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Static128BlockSym,
        kFp8StaticTensorSym,
    )

    assert VLLM_QUANTIZATION == {"fp8": "fp8_per_tensor", "fp8_block": "fp8_per_block"}
    tensor = resolve_quantization_config(VLLM_QUANTIZATION["fp8"], None)
    block = resolve_quantization_config(VLLM_QUANTIZATION["fp8_block"], None)
    assert tensor.linear.weight == kFp8StaticTensorSym and tensor.moe.weight == kFp8StaticTensorSym
    assert block.linear.weight == kFp8Static128BlockSym
    assert tuple(kFp8Static128BlockSym.scale.group_shape) == (128, 128)


@pytest.mark.gpu
def test_cuda_quantizer_matches_the_cpu_reference():
    """On the GPU (no vLLM on the check machine): both variants give the same bits and
    scales on CUDA as on the CPU (which the tests above hold to vLLM's quantizers)."""
    w = _weight(1000, 700, seed=9)
    for quantization in ("fp8", "fp8_block"):
        q_cpu, s_cpu = quantize_fp8(w, quantization)
        q_gpu, s_gpu = quantize_fp8(w.cuda(), quantization)
        assert q_gpu.is_cuda and q_gpu.dtype == FP8
        assert torch.equal(_bits(q_gpu.cpu()), _bits(q_cpu)), quantization
        assert torch.equal(s_gpu.cpu(), s_cpu), quantization


# -- config and GPU checks -----------------------------------------------------------------


def test_rollout_quantization_is_validated_naming_the_key():
    RolloutConfig(quantization="fp8").validate()
    RolloutConfig(quantization="fp8_block", dtype="bfloat16").validate()
    cases = [
        (dict(quantization="int4"), "must be null or one of fp8, fp8_block"),
        (dict(quantization="fp8", dtype="float32"), "takes no float32 model"),
        (
            dict(quantization="fp8", weight_transport="nccl_m2n", placement="subprocess"),
            "not verified with weight_transport nccl_m2n",
        ),
    ]
    for fields, text in cases:
        with pytest.raises(ConfigError) as err:
            RolloutConfig(**fields).validate()
        assert err.value.key == "quantization" and text in err.value.message


def test_fp8_rollouts_are_refused_without_fp8_gpus_naming_the_key():
    assert quantization_problem(None, "anywhere", None) is None
    assert quantization_problem("fp8", "an H200", (9, 0)) is None
    assert quantization_problem("fp8_block", "a GB200", (10, 0)) is None
    a100 = quantization_problem("fp8", "an A100", (8, 0))
    assert "8.9" in a100 and "an A100 has 8.0" in a100 and "rollout.quantization: null" in a100
    cpu = quantization_problem("fp8_block", "this machine", None)
    assert "fp8_per_block" in cpu and "has none" in cpu


def test_recipe_with_fp8_rollouts_loads_for_an_fp8_gpu_and_is_refused_for_float32():
    base = ("rollout.quantization=fp8",)
    config = load_run_config("recipes/tiny_cpu.yaml", (*base, "model.dtype=bfloat16"))
    assert config.rollout.quantization == "fp8"
    assert rollout_quantization_problem(config, "an A100", (8, 0)) is not None
    assert rollout_quantization_problem(config, "an H100", (9, 0)) is None
    with pytest.raises(ConfigError) as err:
        load_run_config("recipes/tiny_cpu.yaml", (*base, "model.dtype=float32"))
    assert err.value.key == "rollout.quantization"
    assert "engines run float32" in err.value.message


def test_recipe_with_fp8_rollouts_is_refused_at_load_for_an_a100_naming_the_key():
    fp8 = ("rollout.quantization=fp8_block", "rollout.dtype=bfloat16")
    with pytest.raises(ConfigError) as err:
        load_run_config("recipes/tiny_cpu.yaml", (*fp8, "cluster.gpu=a100"))
    assert err.value.key == "rollout.quantization"
    assert "cluster.gpu a100 has 8.0" in err.value.message
    assert load_run_config("recipes/tiny_cpu.yaml", ("cluster.gpu=a100",)).cluster.gpu == "a100"
    assert load_run_config("recipes/tiny_cpu.yaml", (*fp8, "cluster.gpu=h100")).rollout.quantization


def test_engines_on_a_cpu_machine_refuse_fp8_and_pass_vllms_name_on_gpu():
    from megatron_rl.rollout.engine.vllm_engine import fp8_engine_quantization

    with pytest.raises(ConfigError) as err:
        fp8_engine_quantization(RolloutConfig(quantization="fp8"), gpu=False)
    assert err.value.key == "rollout.quantization" and "CPU" in err.value.message
    assert fp8_engine_quantization(RolloutConfig(quantization="fp8"), gpu=True) == "fp8_per_tensor"
    block = RolloutConfig(quantization="fp8_block")
    assert fp8_engine_quantization(block, gpu=True) == "fp8_per_block"


def test_preflight_engine_check_refuses_fp8_on_the_machines_gpu(monkeypatch):
    from megatron_rl.platform import inventory
    from megatron_rl.preflight.engines import fp8_engine_problem

    config = load_run_config("recipes/tiny_cpu.yaml", ("model.dtype=bfloat16",))
    assert fp8_engine_problem(config) is None  # no FP8 rollouts: nothing to check
    config.rollout.quantization = "fp8"
    assert "CPU only" in fp8_engine_problem(config)  # this machine
    gpu = inventory.DeviceInventory("2.13", "12.9", "570", "2.27", "NVIDIA A100", (8, 0), 1)
    monkeypatch.setattr(inventory, "device_inventory", lambda: gpu)
    assert "NVIDIA A100 (compute capability 8.0) has 8.0" in fp8_engine_problem(config)
    h200 = dataclasses.replace(gpu, device_name="NVIDIA H200", capability=(9, 0))
    monkeypatch.setattr(inventory, "device_inventory", lambda: h200)
    assert fp8_engine_problem(config) is None


# -- the log-prob gap limit ----------------------------------------------------------------


def test_fp8_engines_have_their_own_documented_gap_limit():
    training = TrainingConfig()
    assert training.logprob_gap_limit("bfloat16") == LOGPROB_GAP_LIMITS["bfloat16"]
    assert training.logprob_gap_limit("bfloat16", "fp8") == FP8_LOGPROB_GAP_LIMIT
    # above the healthy bf16 gaps, below the smallest broken push measured (0.06)
    assert LOGPROB_GAP_LIMITS["bfloat16"] < FP8_LOGPROB_GAP_LIMIT < 0.06
    training = TrainingConfig(max_logprob_gap=1e-3, max_logprob_gap_fp8=0.03)
    training.validate()
    assert training.logprob_gap_limit("bfloat16", "fp8_block") == 0.03
    assert training.logprob_gap_limit("bfloat16") == 1e-3
    assert TrainingConfig(check_logprob_gap=False).logprob_gap_limit("float32", "fp8") is None
    assert training.logprob_gap_key("fp8") == "training.max_logprob_gap_fp8"
    with pytest.raises(ConfigError) as err:
        TrainingConfig(max_logprob_gap_fp8=0).validate()
    assert err.value.key == "max_logprob_gap_fp8"


def test_gap_errors_name_the_fp8_limit():
    from megatron_rl.trainer.probe import LogprobProbe, ProbeResult
    from megatron_rl.trainer.step import LogprobGapError, UpdateSums, check_logprob_gap

    zero = UpdateSums(*[0.0] * len(dataclasses.fields(UpdateSums)))
    sums = dataclasses.replace(zero, gap=0.2 * 10, gap_tokens=10)  # mean 0.2: a broken push
    with pytest.raises(LogprobGapError, match="training.max_logprob_gap_fp8 0.05"):
        check_logprob_gap(sums, 0.05, 3, "training.max_logprob_gap_fp8")
    probe = LogprobProbe(
        [1], lambda i: [i], 1, 1, 4, 1.0, 0.05, limit_key="training.max_logprob_gap_fp8"
    )
    result = ProbeResult(
        version=2, gap=0.2, tokens=4, max_gap=0.5, samples=1, discarded=0, seconds=1.0
    )
    with pytest.raises(LogprobGapError, match="training.max_logprob_gap_fp8 0.05"):
        probe.check(result)


# -- the planner ---------------------------------------------------------------------------


def _dense(**kw) -> ModelShapes:
    fields = dict(
        name="hand", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=1000,
        ffn=512, experts=0, topk=0, expert_ffn=0, shared_ffn=0, moe=(False, False),
        rope=(True, True), qk_norm=(False, False), chunk=(None, None),
        temperature=(False, False), tied_embeddings=False,
    )  # fmt: skip
    fields.update(kw)
    return ModelShapes(**fields)


def test_engine_weights_halve_with_fp8_by_hand():
    """By hand, per layer at TP 1: qkv 512 x 256, o 256 x 256, gate_up 1024 x 256, down
    256 x 512 = 589,824 linear elements; embedding + head 2 x 1000 x 256, norms 2 x 256 per
    layer + 256: 513,280 others. bf16: 2 bytes each."""
    s = _dense()
    linear, other = 2 * 589_824, 512_000 + 2 * 512 + 256
    assert engine_weight_bytes(s, 1, 2) == (2 * (linear + other), 0)
    # fp8: 1 byte per linear element + a 4-byte scale per layer (4 layers a block)
    fp8, ws = engine_weight_bytes(s, 1, 2, quantization="fp8")
    assert fp8 == linear + 2 * 4 * 4 + 2 * other
    # the largest layer quantized during a push: its bf16 copy plus its FP8 copy
    assert ws == 2 * 589_824 + 589_824 + 4 * 4
    # fp8_block: 4 bytes per 128 x 128 block: qkv 4 x 2, o 2 x 2, gate_up 8 x 2, down 2 x 4
    block, ws_block = engine_weight_bytes(s, 1, 2, quantization="fp8_block")
    assert block == linear + 2 * 4 * (8 + 4 + 16 + 8) + 2 * other
    # + two float32 copies of the largest weight (gate_up, 1024 x 256)
    assert ws_block == 2 * 589_824 + 589_824 + 4 * 36 + 2 * 4 * 1024 * 256
    # the linear layers' bytes halve: what FP8 frees is their bf16 bytes less 1 byte each
    assert 2 * (linear + other) - fp8 == linear - 32


def test_engine_weights_of_an_moe_with_fp8_count_experts_per_expert_scales():
    """2 routed experts of width 64 and a shared expert of 64, one MoE layer, TP 2 without
    EP: experts split in width (32 each)."""
    s = _dense(layers=1, experts=2, topk=1, expert_ffn=64, shared_ffn=64, moe=(True,),
               rope=(True,), qk_norm=(False,), chunk=(None,), temperature=(False,))  # fmt: skip
    attn = (2 + 2) * 64 * 256 + 256 * 2 * 64  # qkv (2 q heads + 1 + 1 kv) and o
    experts = 2 * 3 * 256 * 32
    shared = 3 * 256 * 32
    linear = attn + experts + shared
    other = 2 * 500 * 256 + 2 * 256 + 256 + 2 * 256  # embedding + head, norms, router
    assert engine_weight_bytes(s, 2, 2) == (2 * (linear + other), 0)
    fp8, _ = engine_weight_bytes(s, 2, 2, quantization="fp8")
    # scales: qkv, o, shared gate_up, shared down + one per expert for w13 and w2
    assert fp8 == linear + 4 * (4 + 2 * 2) + 2 * other


def test_plan_shows_fp8_weights_and_the_kv_cache_they_free():
    from megatron_rl.planning.plan import plan_run
    from megatron_rl.planning.report import markdown

    recipe, overrides = "recipes/scalerl_8b.yaml", ("rollout.quantization=fp8",)
    base = plan_run(load_run_config(recipe), search=False).engine.bytes
    plan = plan_run(load_run_config(recipe, overrides), search=False)
    e = plan.engine.bytes
    assert base.fp8_freed == 0 and base.reload_workspace == 0
    # Llama-3.1-8B (engine TP 1, bf16), by hand: per layer q, o 4096 x 4096, k + v 2 x 1024 x
    # 4096, gate / up / down 3 x 4096 x 14336; 32 layers; one byte saved per element, less a
    # 4-byte scale per layer (4 a block). Embedding and head (2.1 GB) stay bf16.
    linear = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    assert e.fp8_freed == base.weights - e.weights == linear - 32 * 4 * 4
    assert e.kv_cache == base.kv_cache  # rollout.kv_cache_gb is what vLLM is given
    text = markdown(plan)
    assert "rollout.quantization fp8: linear layers in FP8" in text
    assert "FP8 reload workspace (estimate)" in text
    # The note's KV cache, re-planned: the FP8 plan's total is then the unquantized plan's
    # (the FP8 reload workspace is part of the FP8 total: not all of fp8_freed is free)
    note = re.search(r"kv_cache_gb can grow from \S+ to (\S+) \(\d+ -> (\d+) full", text)
    kv_gb, noted = float(note.group(1)), int(note.group(2))
    regrown = plan_run(
        load_run_config(recipe, (*overrides, f"rollout.kv_cache_gb={kv_gb}")), search=False
    )
    unquantized = plan_run(load_run_config(recipe), search=False)
    assert abs(regrown.engine.total - unquantized.engine.total) < 0.01 * 2**30
    sequences = regrown.engine.bytes.sequences_in_kv
    assert abs(noted - sequences) <= 1
    assert sequences > e.sequences_in_kv


def test_engine_bytes_without_quantization_is_unchanged():
    config = load_run_config("recipes/tiny_cpu.yaml")
    from megatron_rl.planning.shapes import model_shapes

    e = engine_bytes(model_shapes(config.model), config.rollout, config.model.dtype)
    assert e.fp8_freed == 0 and e.reload_workspace == 0 and e.quantization is None


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("quantization", ["fp8", "fp8_block"])
def test_fp8_engine_loads_a_push_within_the_fp8_gap(
    quantization, tiny_hf_dirs, megatron_single_rank
):
    """An FP8 engine (vLLM online FP8, bf16 model) on one GPU takes a push of perturbed
    weights: before it, its log-probs are off by more than the FP8 limit (the probe would
    catch a broken push); after it, within the limit. Needs vLLM for CUDA: skipped on the
    check machine (GPU.md: no vLLM there), so it is the line that verifies an FP8 load and
    push where a GPU has vLLM; not run anywhere yet."""
    pytest.importorskip("vllm")
    from megatron_rl.rollout.parity import logprob_deltas, megatron_from_hf, perturb_
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights.push import push_megatron_weights

    hf_dir = tiny_hf_dirs["tiny-llama"]
    config = RolloutConfig(
        samples_per_prompt=2,
        max_tokens=16,
        dtype="bfloat16",
        quantization=quantization,
        stop_token_ids=[],
        max_num_seqs=8,
        kv_cache_gb=0.5,
    )
    config.validate()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 128, (4, 8), generator=gen).tolist()
    model = megatron_from_hf(hf_dir)
    perturb_(model, seed=1, noise=0.5)
    with GeneratorPool(hf_dir, config) as pool:
        stale = logprob_deltas(model, pool.generate(prompts)).mean().item()
        push_megatron_weights(pool, model, bucket_bytes=256 * 1024)
        pushed = logprob_deltas(model, pool.generate(prompts)).mean().item()
    assert pushed < FP8_LOGPROB_GAP_LIMIT < stale, (pushed, stale)


def test_engine_args_hand_vllm_its_online_fp8_method(tmp_path, monkeypatch):
    """On a GPU machine the engines' EngineArgs carry vLLM's shorthand (and none without
    rollout.quantization)."""
    pytest.importorskip("vllm")
    import megatron_rl.platform.device as device
    from megatron_rl.models import make_hf_model, preset_hf_config
    from megatron_rl.platform.device import Platform
    from megatron_rl.rollout.engine.vllm_engine import engine_args

    hf_dir = make_hf_model(preset_hf_config("tiny-llama"), str(tmp_path / "tiny"), seed=0)
    monkeypatch.setattr(device, "get_platform", lambda: Platform("cuda", "nccl", True))
    block = RolloutConfig(quantization="fp8_block", dtype="bfloat16")
    args = engine_args(hf_dir, block, 0)
    assert args.quantization == "fp8_per_block" and args.dtype == "bfloat16"
    assert engine_args(hf_dir, RolloutConfig(), 0).quantization is None


def test_plan_for_a_gpu_without_fp8_refuses_fp8_rollouts(capsys):
    """``megatron-rl plan --gpu a100`` (another GPU than the recipe's cluster.gpu, checked at
    load) refuses FP8 rollouts naming the key."""
    import argparse

    from megatron_rl.planning.cli import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["recipes/scalerl_8b.yaml", "rollout.quantization=fp8", "--gpu", "a100"]
    )
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "recipe key 'rollout.quantization'" in err and "--gpu a100 has 8.0" in err
