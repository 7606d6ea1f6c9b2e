"""Megatron model providers: logits parity with transformers, parallel layouts, FP32 head."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_rl.conversion.hf import load_hf_weights
from megatron_rl.models import ModelConfig, make_hf_model, preset_hf_config
from megatron_rl.models.attention import SDPACoreAttention
from megatron_rl.models.logprobs import forward_logits, token_logprobs
from megatron_rl.models.provider import build_model
from megatron_rl.platform import ParallelConfig, get_platform, run_local_ranks

TOKENS = torch.randint(3, 128, (2, 80), generator=torch.Generator().manual_seed(7))


def hf_logits(hf_dir: str, dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def megatron_model(hf_dir: str, dtype: str = "float32", fp32_head: bool = True):
    model = build_model(
        ModelConfig(hf_path=hf_dir, dtype=dtype, fp32_head=fp32_head), ParallelConfig()
    )
    load_hf_weights(model, hf_dir, getattr(torch, dtype))
    return model.eval()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama4"])
def test_logits_match_transformers(tiny_hf_dirs, megatron_single_rank, name):
    hf_dir = tiny_hf_dirs[name]
    ref = hf_logits(hf_dir)
    with torch.no_grad():
        out = forward_logits(megatron_model(hf_dir), TOKENS)
    assert out.shape == ref.shape == (2, 80, 128)
    assert (out - ref).abs().max().item() < 1e-4


def test_tiny_configs_exercise_what_they_claim(tiny_hf_dirs):
    dense = transformers.AutoConfig.from_pretrained(tiny_hf_dirs["tiny-llama"])
    assert dense.num_attention_heads == 4 and dense.num_key_value_heads == 2
    assert dense.rope_parameters["rope_theta"] != 10000.0
    l4 = transformers.AutoConfig.from_pretrained(tiny_hf_dirs["tiny-llama4"])
    assert l4.num_local_experts == 4 and 0 in l4.no_rope_layers
    assert l4.attention_chunk_size < TOKENS.shape[1]  # chunked attention is active
    assert l4.moe_layers != list(range(l4.num_hidden_layers))  # dense and MoE interleaved


def test_llama4_chunking_and_temperature_matter(tiny_hf_dirs, megatron_single_rank):
    """Negative controls: without chunked attention or temperature tuning, parity breaks."""
    hf_dir = tiny_hf_dirs["tiny-llama4"]
    ref = hf_logits(hf_dir)
    model = megatron_model(hf_dir)
    cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
    assert any(c.chunk_size for c in cores) and any(c.temperature for c in cores)
    for attr in ("chunk_size", "temperature"):
        saved = [getattr(c, attr) for c in cores]
        for c in cores:
            setattr(c, attr, None)
        with torch.no_grad():
            diff = (forward_logits(model, TOKENS) - ref).abs().max().item()
        assert diff > 1e-3, attr
        for c, v in zip(cores, saved):
            setattr(c, attr, v)


@pytest.mark.parametrize(
    "name,tensor,expert",
    [("tiny-llama", 2, 1), ("tiny-llama4", 2, 1), ("tiny-llama4", 1, 2)],
    ids=["dense-tp2", "moe-tp2", "moe-ep2"],
)
def test_parallel_layouts_match_single_rank(tiny_hf_dirs, tmp_path, name, tensor, expert):
    from support.mp_workers import logits_worker

    hf_dir = tiny_hf_dirs[name]
    out = tmp_path / "logits.pt"
    run_local_ranks(logits_worker, max(tensor, expert), hf_dir, tensor, expert, TOKENS, str(out))
    ref = hf_logits(hf_dir)  # equal to TP=1 megatron logits to < 1e-4 (test above)
    assert (torch.load(out) - ref).abs().max().item() < 1e-4


def test_fp32_head_gives_fp32_logits_closer_to_fp64(tmp_path, megatron_single_rank):
    # Confident logits, as a trained model has, so that BF16 rounding of the head shows.
    hf_dir = make_hf_model(preset_hf_config("tiny-llama"), str(tmp_path / "m"), seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    hf.save_pretrained(hf_dir)
    ref_model = hf.to(torch.bfloat16).to(torch.float64).eval()  # the BF16 weights, in fp64
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(TOKENS).logits[:, :-1], -1)
        ref = ref.gather(-1, TOKENS[:, 1:, None])[..., 0]
    errors = {}
    for fp32_head in (True, False):
        model = megatron_model(hf_dir, dtype="bfloat16", fp32_head=fp32_head)
        with torch.no_grad():
            logits = forward_logits(model, TOKENS)
            logprobs = token_logprobs(model, TOKENS)
        assert logits.dtype == (torch.float32 if fp32_head else torch.bfloat16)
        assert model.decoder.layers[0].mlp.linear_fc1.weight.dtype == torch.bfloat16
        errors[fp32_head] = (logprobs.double() - ref).abs().mean().item()
    assert errors[True] < 0.95 * errors[False], errors


def test_fp32_head_multiplies_the_weight_the_generator_holds(tiny_hf_dirs, megatron_single_rank):
    """BF16 model, FP32 head: the trainer's logits are the FP32 product of the BF16 head
    weight it pushes, i.e. of the values a vLLM engine holds after loading it (its
    ``head_dtype: float32`` keeps the weight in the model dtype and accumulates in FP32)."""
    from megatron_rl.conversion.weight_stream import iter_hf_weights
    from megatron_rl.rollout.parity import perturb_

    model = megatron_model(tiny_hf_dirs["tiny-llama"], dtype="bfloat16", fp32_head=True)
    perturb_(model, seed=5, noise=0.5)  # as after updates
    pushed = dict(p for bucket in iter_hf_weights(model) for p in bucket)["lm_head.weight"]
    engine_weight = pushed.to(torch.bfloat16)  # what the engine's bf16 parameter holds
    assert torch.equal(engine_weight, pushed)  # the push loses nothing
    seen = {}
    model.output_layer.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    with torch.no_grad():
        logits = forward_logits(model, TOKENS)
    assert logits.dtype == torch.float32
    ref = seen["x"].double() @ engine_weight.double().t()  # [s, b, V]
    assert (logits.double() - ref.transpose(0, 1)).abs().max().item() < 1e-5


def test_token_logprobs_match_log_softmax(tiny_hf_dirs, megatron_single_rank):
    hf_dir = tiny_hf_dirs["tiny-llama"]
    ref = torch.log_softmax(hf_logits(hf_dir).double()[:, :-1], -1).gather(-1, TOKENS[:, 1:, None])[
        ..., 0
    ]
    model = megatron_model(hf_dir)
    lp = token_logprobs(model, TOKENS)
    assert lp.shape == (2, 79) and lp.dtype == torch.float32
    assert (lp.double() - ref).abs().max().item() < 1e-5
    lp.sum().backward()  # differentiable through the vocab-parallel cross entropy
    assert model.output_layer.weight.grad is not None


def test_cpu_path_chooses_local_specs(tiny_hf_dirs, megatron_single_rank):
    platform = get_platform()
    assert (platform.device, platform.backend) == ("cpu", "gloo")
    model = megatron_model(tiny_hf_dirs["tiny-llama"])
    core = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(core, SDPACoreAttention)
    with pytest.raises(ValueError, match="Transformer Engine"):
        build_model(ModelConfig(preset="tiny-llama", layer_spec="te"), ParallelConfig())
    with pytest.raises(ValueError, match="fp8"):
        build_model(ModelConfig(preset="tiny-llama", fp8="e4m3"), ParallelConfig())


@pytest.mark.parametrize(
    "preset,parallel,match",
    [
        ("tiny-llama", ParallelConfig(tensor=3), "num_attention_heads"),
        ("tiny-llama4", ParallelConfig(expert=3), "num_local_experts"),
        ("tiny-llama", ParallelConfig(expert=2), "no experts"),
        ("tiny-llama4", ParallelConfig(expert=2, expert_tensor=2), "expert_tensor"),
    ],
)
def test_bad_parallel_layouts_fail_clearly(preset, parallel, match):
    from megatron_rl.models.arch import architecture_from_hf, check_divisibility

    with pytest.raises(ValueError, match=match):
        check_divisibility(architecture_from_hf(preset_hf_config(preset)), parallel)


def test_vocab_not_divisible_by_tp_fails_clearly():
    from megatron_rl.models.arch import architecture_from_hf, check_divisibility

    arch = architecture_from_hf(
        preset_hf_config("tiny-llama", vocab_size=127, num_attention_heads=4)
    )
    with pytest.raises(ValueError, match="vocab_size=127"):
        check_divisibility(arch, ParallelConfig(tensor=2))


def test_unknown_architecture_and_preset_fail_clearly():
    from megatron_rl.models.arch import architecture_from_hf

    cfg = transformers.AutoConfig.for_model("gpt2")
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        architecture_from_hf(cfg)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_hf_config("llama-9000")


def test_production_presets_have_published_shapes():
    l3 = preset_hf_config("llama3-8b")
    assert (l3.hidden_size, l3.num_hidden_layers, l3.num_key_value_heads, l3.vocab_size) == (
        4096,
        32,
        8,
        128256,
    )
    assert l3.rope_parameters["rope_type"] == "llama3"
    scout = preset_hf_config("llama4-scout")
    assert (scout.num_local_experts, scout.num_experts_per_tok, scout.hidden_size) == (16, 1, 5120)
    assert scout.no_rope_layers[3] == 0 and scout.no_rope_layers[0] == 1


def test_local_specs_use_an_rmsnorm_that_works_where_apex_is_installed(
    tiny_hf_dirs, megatron_single_rank, monkeypatch
):
    """On NGC images megatron's ``LNImpl`` is apex's FusedLayerNorm, which asserts
    LayerNorm: the local specs' final norm must be an RMSNorm that works."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    monkeypatch.setattr(gpt_layer_specs, "LNImpl", FusedLayerNorm)  # as with apex
    model = megatron_model(tiny_hf_dirs["tiny-llama"])
    norms = [type(m) for m in model.modules() if "Norm" in type(m).__name__]
    assert FusedLayerNorm not in norms and norms
    assert type(model.decoder.final_layernorm).__name__ in ("RMSNorm", WrappedTorchNorm.__name__)
    with torch.no_grad():
        logits = forward_logits(model, TOKENS)
    assert torch.allclose(logits, hf_logits(tiny_hf_dirs["tiny-llama"]), atol=1e-4)


def test_auto_layer_spec_on_a_gpu_without_transformer_engine_fails_with_its_import_error(
    tiny_hf_dirs, megatron_single_rank, monkeypatch
):
    """A GPU machine whose TE does not import: 'auto' stops with the import error instead of
    silently building local specs; 'local' is the explicit way to run without TE."""
    from megatron_rl.models import provider
    from megatron_rl.platform.device import Platform

    broken = Platform("cuda", "nccl", False, "ImportError: libcudart.so.13: cannot open")
    monkeypatch.setattr(provider, "get_platform", lambda: broken)
    with pytest.raises(ValueError, match="layer_spec: 'auto' needs Transformer Engine.*libcudart"):
        provider.build_model(
            ModelConfig(hf_path=tiny_hf_dirs["tiny-llama"], dtype="float32"), ParallelConfig()
        )


def _attention_bench():
    """tools/bench_chunked_attention.py as a module (it holds the old masked path, the
    reference, and the memory tracker)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "bench_chunked_attention"
    if name not in sys.modules:
        path = Path(__file__).parents[3] / "tools" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass needs the module registered
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.timeout(60)
def test_chunked_attention_memory_is_block_diagonal(megatron_single_rank):
    """At 8 chunks, forward + backward on SDPA's math kernel (what a GPU falls to with a mask
    and GQA) peaks at <= 1/4 of the masked path's memory: scores are O(s x chunk)."""
    bench = _attention_bench()
    shape = dict(tokens=1024, chunk=128, q_heads=4, kv_heads=2, head_dim=32, repeats=1)
    masked = bench.measure("masked", **shape)
    block = bench.measure("block", **shape)
    # the masked path keeps 4 heads x 1024^2 fp32 scores (16 MiB) and more for backward
    assert masked.peak_mib > 4 * 1024**2 * 4 / 2**20
    assert block.peak_mib <= masked.peak_mib / 4, (block, masked)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tokens", [96, 120, 20])
def test_chunked_attention_matches_masked_reference(megatron_single_rank, tokens):
    """Outputs and gradients equal the masked reference (float64), with whole chunks, a last
    partial chunk, and a sequence shorter than one chunk; and a megatron-style attention mask
    (True = masked out) is honoured on top of chunking."""
    bench = _attention_bench()
    q, k, v = bench._inputs(tokens, 2, 4, 2, 16, torch.float64, "cpu")
    core = bench.block_diagonal_core(32, 4, 2, 16)
    out, ref = core(q, k, v, None), bench.masked_chunked_attention(q, k, v, 32)
    grads, ref_grads = (torch.autograd.grad(o.square().sum(), (q, k, v)) for o in (out, ref))
    assert (out - ref).abs().max() < 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() < 1e-12

    # padding mask [b, 1, s, s]: sample 1 ignores its first 5 keys
    mask = torch.zeros(2, 1, tokens, tokens, dtype=torch.bool)
    mask[1, :, :, :5] = True
    mask[1].diagonal(dim1=-2, dim2=-1).fill_(False)  # no query without keys
    out = core(q, k, v, mask)
    pos = torch.arange(tokens)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] // 32 == pos[None, :] // 32)
    expect = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)),
        attn_mask=allowed & ~mask,
        scale=16**-0.5,
        enable_gqa=True,
    )
    assert (out - expect.permute(2, 0, 1, 3).reshape(tokens, 2, -1)).abs().max() < 1e-12
    assert not torch.allclose(out[:, 1], ref[:, 1])  # the mask changed something


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk", [None, 32])
def test_attention_passes_no_mask_to_sdpa(megatron_single_rank, monkeypatch, chunk):
    """Plain and chunked attention without a megatron mask call SDPA with ``is_causal`` and no
    mask (what keeps CUDA on its flash kernel: flash rejects masks, memory-efficient GQA)."""
    import megatron_rl.models.attention as attention

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, kwargs["attn_mask"], kwargs["is_causal"]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    bench = _attention_bench()
    core = bench.block_diagonal_core(chunk, 4, 2, 16)
    core(*bench._inputs(80, 2, 4, 2, 16, torch.float32, "cpu"), None)
    assert calls and all(mask is None and causal for _, mask, causal in calls)
    # 80 tokens: one call, or two full chunks as a batch plus the last 16 tokens
    expect = [(2, 4, 80, 16)] if chunk is None else [(4, 4, 32, 16), (2, 4, 16, 16)]
    assert [tuple(shape) for shape, _, _ in calls] == expect
