"""Megatron -> HF weight stream: tensor-for-tensor equal to the HF checkpoint it was loaded
from, for TP=1 and for TP=2, EP=2 and PP=2 (two gloo ranks), with bounded buckets."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.conversion.weight_stream import bucket_nbytes, iter_hf_weights, unshard
from megatron_rl.platform import run_local_ranks

BUCKET = 256 * 1024  # small, so that every model streams in several buckets


def test_unshard_reassembles_megatron_strided_shards():
    full = torch.arange(8 * 3).view(8, 3)  # [gate rows 0-3; up rows 4-7]
    # megatron's strided split (stride 2, 2 ranks): chunk k*W + r of 2 rows goes to rank r
    chunks = full.split(2)
    shards = [torch.cat([chunks[0], chunks[2]]), torch.cat([chunks[1], chunks[3]])]
    assert torch.equal(shards[0], torch.tensor([[0, 1, 2], [3, 4, 5], [12, 13, 14], [15, 16, 17]]))
    assert torch.equal(unshard(shards, 0, stride=2), full)
    assert torch.equal(unshard([full[:, :1], full[:, 1:]], 1), full)


def _stream(model, bucket_bytes=BUCKET):
    buckets = list(iter_hf_weights(model, bucket_bytes=bucket_bytes))
    names = [name for bucket in buckets for name, _ in bucket]
    return buckets, names, {name: t for bucket in buckets for name, t in bucket}


def _compare(streamed: dict, hf_dir: str) -> list[str]:
    ref = load_file(f"{hf_dir}/model.safetensors")
    bad = sorted(set(ref) ^ set(streamed))
    bad += [
        k
        for k in ref
        if k in streamed
        and not (streamed[k].shape == ref[k].shape and torch.equal(streamed[k], ref[k]))
    ]
    return bad


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama4"])
def test_tp1_stream_equals_hf_state_dict(tiny_hf_dirs, megatron_single_rank, name):
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    hf_dir = tiny_hf_dirs[name]
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), ParallelConfig())
    load_hf_weights(model, hf_dir, torch.float32)
    params = {n: (p, p.data_ptr(), p.shape) for n, p in model.named_parameters()}
    buckets, names, streamed = _stream(model)
    assert _compare(streamed, hf_dir) == []
    assert len(names) == len(set(names))  # every tensor exactly once
    largest = max(t.numel() * t.element_size() for t in streamed.values())
    assert len(buckets) > 2
    assert all(bucket_nbytes(b) < BUCKET + largest for b in buckets)
    assert streamed["lm_head.weight"].dtype == torch.float32  # the FP32 head stays FP32
    # the model is left as it was (nothing swapped, nothing copied into it)
    assert all(
        p is params[n][0] and p.data_ptr() == params[n][1] and p.shape == params[n][2]
        for n, p in model.named_parameters()
    )


def test_stream_in_bf16_casts_the_body_but_not_the_fp32_head(tiny_hf_dirs, megatron_single_rank):
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    hf_dir = tiny_hf_dirs["tiny-llama"]
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), ParallelConfig())
    load_hf_weights(model, hf_dir, torch.float32)
    streamed = {n: t for b in iter_hf_weights(model, dtype=torch.bfloat16) for n, t in b}
    ref = load_file(f"{hf_dir}/model.safetensors")
    assert streamed["lm_head.weight"].dtype == torch.float32
    assert torch.equal(streamed["lm_head.weight"], ref["lm_head.weight"])
    q = "model.layers.1.self_attn.q_proj.weight"
    assert streamed[q].dtype == torch.bfloat16 and torch.equal(streamed[q], ref[q].bfloat16())


LAYOUTS = {  # (model, tensor, expert, pipeline)
    "dense-tp2": ("tiny-llama", 2, 1, 1),
    "dense-dp2": ("tiny-llama", 1, 1, 1),
    "dense-pp2": ("tiny-llama", 1, 1, 2),
    "llama4-ep2": ("tiny-llama4", 1, 2, 1),
    "llama4-tp2": ("tiny-llama4", 2, 1, 1),
    "llama4-pp2": ("tiny-llama4", 1, 1, 2),
}


def stream_layouts_rank(hf_dirs: dict) -> dict:
    """Each layout on two gloo ranks: rank 0's stream vs the HF file, rank 1 yields nothing."""
    import torch.distributed as dist

    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, init_distributed

    results = {}
    for key, (name, tensor, expert, pipeline) in LAYOUTS.items():
        parallel = ParallelConfig(tensor=tensor, expert=expert, pipeline=pipeline)
        init_distributed(parallel)
        model = build_model(ModelConfig(hf_path=hf_dirs[name], dtype="float32"), parallel)
        load_hf_weights(model, hf_dirs[name], torch.float32)
        before = {n: (p.data_ptr(), tuple(p.shape)) for n, p in model.named_parameters()}
        _, names, streamed = _stream(model)
        after = {n: (p.data_ptr(), tuple(p.shape)) for n, p in model.named_parameters()}
        results[key] = {
            "bad": _compare(streamed, hf_dirs[name]) if dist.get_rank() == 0 else None,
            "count": len(names),
            "unique": len(set(names)) == len(names),
            "restored": before == after,
        }
    return results


@pytest.fixture(scope="module")
def layouts(tiny_hf_dirs):
    return run_local_ranks(stream_layouts_rank, 2, dict(tiny_hf_dirs))


@pytest.mark.slow
@pytest.mark.parametrize("key", list(LAYOUTS))
def test_parallel_stream_equals_hf_state_dict(layouts, key):
    sender, other = layouts
    assert sender[key]["bad"] == [] and sender[key]["unique"]
    assert other[key]["count"] == 0  # only the sender yields
    assert sender[key]["restored"] and other[key]["restored"]  # shards put back
