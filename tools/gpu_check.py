#!/usr/bin/env python
"""The numbers of the single-H200 check (issue: the first real run), one section each:

1. one-rank control collectives through ``platform.collectives`` (NCCL world + gloo twin);
2. a 4-layer llama3-8b slice, BF16, FP32 head, megatron's distributed optimizer: two policy
   updates on one 16k-token sample, peak memory and tokens/s, extrapolated to the 8B GPU of
   ``recipes/scalerl_8b.yaml``'s own layout (TP, DP, optimizer sharding) by
   ``megatron_rl.planning``, scaled by measured / planned on the slice;
3. bucket packing + flattening throughput (GB/s): bucket tensors (some on the host, as
   modelopt's exporter returns them) moved to the device and packed into one uint8 buffer
   (what vLLM's ``pack_tensors`` does before an NCCL broadcast);
4. the trainer's log-probs with an FP32 head weight vs the BF16-rounded one at 16k tokens.

Chunked attention at Scout shapes is ``tools/bench_chunked_attention.py`` (called by
``tools/gpu_check.sh``). ``--smoke`` runs every section at tiny sizes on any machine (CI).

    python tools/gpu_check.py [--smoke]
"""

from __future__ import annotations

import argparse
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def collectives_section() -> None:
    import torch.distributed as dist

    from megatron_rl.platform import collectives

    world = dist.get_world_size()
    start = time.perf_counter()
    flag = collectives.any_rank(False)
    obj = collectives.broadcast_object({"step": 1})
    total = collectives.all_reduce(torch.ones(4))
    collectives.barrier(timeout_minutes=1)
    print(
        f"[collectives] backend {dist.get_backend()} world {world}: any_rank {flag}, "
        f"broadcast {obj}, all_reduce {total.tolist()} ({time.perf_counter() - start:.3f} s)"
    )


def train_slice_section(smoke: bool) -> None:
    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.models import ModelConfig, preset_hf_config
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, get_platform
    from megatron_rl.trainer.batch import TrainSample
    from megatron_rl.trainer.optim import build_optimizer, wrap_model
    from megatron_rl.trainer.step import policy_update

    preset, layers, tokens = ("tiny-llama", 2, 512) if smoke else ("llama3-8b", 4, 16384)
    hf = preset_hf_config(preset, num_hidden_layers=layers)
    dtype = "float32" if smoke and not get_platform().is_gpu else "bfloat16"
    cfg = ModelConfig(preset=preset, dtype=dtype, fp32_head=True, layer_spec="local")
    model = build_model(cfg, ParallelConfig(), hf_config=hf)
    params = sum(p.numel() for p in model.parameters())
    ddp = wrap_model(model)
    optim = build_optimizer(ddp, OptimizerConfig(lr=1e-6, warmup_steps=0))
    vocab = hf.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt, n = 1024 if not smoke else 64, tokens - (1024 if not smoke else 64)
    sample = TrainSample(
        0, 0, torch.randint(3, vocab, (prompt,), generator=gen).tolist(),
        torch.randint(3, vocab, (n,), generator=gen).tolist(),
        (-torch.rand(n, generator=gen) * 5).tolist(), [True] * n, 1.0, [0] * n,
    )  # fmt: skip
    algo = AlgorithmConfig(zero_variance_filter=False)  # one sample: keep its tokens
    times = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(2):
        _sync()
        start = time.perf_counter()
        policy_update(ddp, optim.optimizer, [sample], algo, 1)
        _sync()
        times.append(time.perf_counter() - start)
    trained = tokens
    print(
        f"[train slice] {preset} x {layers} layers ({params / 1e9:.2f} B params), {dtype}, FP32 "
        f"head, distributed optimizer on GPU: updates {', '.join(f'{t:.2f}' for t in times)} s, "
        f"{trained / times[-1]:,.0f} tokens/s"
    )
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        state = base / 2**30
        print(
            f"[train slice] memory: weights+optimizer {state:.2f} GiB, peak {peak / 2**30:.2f} "
            f"GiB, activations+logits {(peak - base) / 2**30:.2f} GiB for {trained} tokens"
        )
    state, acts = (base, peak - base) if torch.cuda.is_available() else (None, None)
    if not smoke or not torch.cuda.is_available():  # the smoke run on CPU: the planner alone
        print(extrapolation_line(recipe_extrapolation(state, acts, layers)))


RECIPE_8B = "recipes/scalerl_8b.yaml"


def recipe_extrapolation(
    measured_state: int | None,
    measured_acts: int | None,
    slice_layers: int = 4,
    recipe: str = RECIPE_8B,
    overrides: tuple[str, ...] = (),
) -> dict:
    """The 8B trainer GPU of ``recipe``'s own layout (TP, PP, DP from cluster.trainer_gpus,
    the distributed optimizer sharding fp32 main params and Adam moments over DP), from
    megatron_rl/planning, scaled by what the slice measured against what the planner predicts
    for the slice (``slice_layers`` layers, one GPU, local layer specs). Bytes; no torch."""
    import copy
    from pathlib import Path

    from megatron_rl.config import load_run_config
    from megatron_rl.models.presets import PRESETS
    from megatron_rl.planning.gpus import get_gpu
    from megatron_rl.planning.plan import Layout, plan_trainer
    from megatron_rl.planning.shapes import model_shapes, shapes_from_fields

    root = Path(__file__).resolve().parents[1]
    config = load_run_config(root / recipe, list(overrides))
    capacity = get_gpu("h200").memory_bytes
    fields = {**PRESETS[config.model.preset], "num_hidden_layers": slice_layers}
    one_gpu = copy.deepcopy(config)  # the slice: one GPU (TP 1, DP 1), no recompute
    one_gpu.cluster.trainer_gpus = 1
    planned_slice = plan_trainer(
        shapes_from_fields(fields, "slice"), one_gpu, Layout(1, 1, 1, False), capacity, "cpu"
    )
    full = plan_trainer(model_shapes(config.model), config, Layout.of(config), capacity)
    state_ratio = measured_state / planned_slice.states.total if measured_state else 1.0
    act_ratio = measured_acts / planned_slice.activations.peak if measured_acts else 1.0
    scaled = (
        full.states.total * state_ratio
        + max(full.activations.peak * act_ratio, full.push_extra)
        + full.reserve
    )
    return {
        "recipe": recipe,
        "layout": f"TP {full.layout.tensor}, PP {full.layout.pipeline}, DP {full.dp}",
        "tensor": full.layout.tensor,
        "dp": full.dp,
        "state_ratio": state_ratio,
        "act_ratio": act_ratio,
        "slice_state": planned_slice.states.total,
        "slice_acts": planned_slice.activations.peak,
        "planned_state": full.states.total,
        "planned_acts": full.activations.peak,
        "planned_total": full.total,
        "scaled_total": int(scaled),
        "measured": measured_state is not None,
    }


def extrapolation_line(x: dict) -> str:
    """One printed line of ``recipe_extrapolation``'s result."""
    gib = 2**30
    source = (
        f"measured / planned on the slice: states x{x['state_ratio']:.2f}, activations "
        f"x{x['act_ratio']:.2f}"
        if x["measured"]
        else "planner only (no CUDA memory to measure)"
    )
    return (
        f"[train slice] llama3-8b at {x['recipe']}'s layout ({x['layout']}, distributed "
        f"optimizer over DP): planned states {x['planned_state'] / gib:.1f} GiB + activations "
        f"{x['planned_acts'] / gib:.1f} GiB, total {x['planned_total'] / gib:.1f} GiB per GPU; "
        f"{source} -> ~{x['scaled_total'] / gib:.1f} GiB per GPU"
    )


def packing_section(smoke: bool) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shapes = [(4096, 4096)] * 4 + [(14336, 4096)] * 3 if not smoke else [(256, 256)] * 8
    bucket = []
    for i, shape in enumerate(shapes):  # every other tensor on the host, as modelopt returns
        t = torch.randn(shape, dtype=torch.bfloat16)
        bucket.append((f"w{i}", t.to(device) if i % 2 else t))
    nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
    best = float("inf")
    for _ in range(5):
        _sync()
        start = time.perf_counter()
        flat = [
            t.to(device, non_blocking=True).contiguous().view(-1).view(torch.uint8)
            for _, t in bucket
        ]
        packed = torch.cat(flat)
        _sync()
        best = min(best, time.perf_counter() - start)
    assert packed.numel() == nbytes and packed.device.type == device.type
    print(
        f"[packing] {nbytes / 2**20:.0f} MiB bucket (half host tensors) -> one {device.type} "
        f"uint8 buffer: {nbytes / best / 1e9:.2f} GB/s"
    )


def head_section(smoke: bool) -> None:
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokens, hidden, vocab = (256, 256, 128) if smoke else (16384, 4096, 128256)
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=gen) * 2).to(device, torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(device)  # an fp32 master weight
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)

    def logprobs(weight: torch.Tensor) -> torch.Tensor:
        out = []
        for part in range(0, tokens, 2048):  # chunks: 16k x 128k fp32 logits is 8 GiB
            logits = h[part : part + 2048].float() @ weight.float().t()
            lp = torch.log_softmax(logits, -1)
            out.append(lp.gather(-1, targets[part : part + 2048, None])[:, 0])
        return torch.cat(out)

    exact = logprobs(w)
    rounded = logprobs(w.to(torch.bfloat16))
    delta = (exact - rounded).abs()
    print(
        f"[fp32 head] {tokens} tokens, vocab {vocab}: |logp(fp32 W) - logp(bf16 W)| mean "
        f"{delta.mean().item():.3e} max {delta.max().item():.3e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any machine")
    args = parser.parse_args()
    from megatron_rl.platform import ParallelConfig, get_platform, init_distributed

    init_distributed(ParallelConfig(), seed=0)
    print(f"platform: {get_platform()}")
    collectives_section()
    train_slice_section(args.smoke)
    packing_section(args.smoke)
    head_section(args.smoke)


if __name__ == "__main__":
    main()
