"""Checks of the trainer: it builds (``trainer.setup.build_run``), makes one policy update at
the recipe's longest sequence within the memory plan, and saves and loads a dist checkpoint."""

from __future__ import annotations

import math
import random
import shutil
import time
from pathlib import Path

import torch

from megatron_rl.preflight.context import Outcome, PreflightContext

GB = 1e9


def check_trainer(ctx: PreflightContext) -> Outcome:
    """The production set-up (``build_run``): model with the HF weights on the recipe's
    layout, data, rewards; then the optimizer (``build_optimizer``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.trainer.optim import build_optimizer
    from megatron_rl.trainer.setup import build_run

    ctx.run = build_run(ctx.config, ctx.work_dir)
    ctx.optim = build_optimizer(ctx.run.ddp, ctx.config.optimizer)
    params = sum(p.numel() for p in ctx.run.model.parameters())
    layout = (
        f"TP {ps.get_tensor_model_parallel_world_size()} PP "
        f"{ps.get_pipeline_model_parallel_world_size()} EP "
        f"{ps.get_expert_model_parallel_world_size()} DP {ps.get_data_parallel_world_size()}"
    )
    return Outcome(
        True,
        f"{layout} on {dist.get_world_size()} ranks; {params / 1e6:.3g}M parameters on rank 0",
        "builds",
        details={"rank_parameters": params, "hf_dir": str(ctx.run.hf_dir)},
    )


def synthetic_samples(config, vocab: int, dp: int, seed: int = 0) -> list:
    """A batch of the recipe's longest sequences (prompt ``data.max_prompt_tokens`` + the
    longest response): as many as one micro-batch holds per data-parallel rank, in groups of
    two with different rewards (so the loss has a gradient)."""
    from megatron_rl.planning.plan import micro_batch_shape
    from megatron_rl.trainer.batch import TrainSample

    _, longest = micro_batch_shape(config)
    response = config.max_response_tokens()
    prompt = max(longest - response, 1)
    per_rank = max(1, micro_batch_shape(config)[0] // longest)
    count = max(2, per_rank * dp + (per_rank * dp) % 2)
    rng = random.Random(seed)
    out = []
    for i in range(count):
        out.append(
            TrainSample(
                prompt_id=i // 2,
                group=i // 2,
                prompt_tokens=[rng.randrange(3, vocab) for _ in range(prompt)],
                response_tokens=[rng.randrange(3, vocab) for _ in range(response)],
                gen_logprobs=[-math.log(vocab)] * response,
                policy_mask=[True] * response,
                reward=float(i % 2),
                versions=[0] * response,
            )
        )
    return out


def planned_bytes(config) -> int:
    """``megatron-rl plan``'s figure for one trainer GPU of this recipe's layout."""
    from megatron_rl.planning.plan import Layout, plan_trainer
    from megatron_rl.planning.shapes import model_shapes

    plan = plan_trainer(model_shapes(config.model), config, Layout.of(config), capacity=1)
    return plan.total


def check_update(ctx: PreflightContext) -> Outcome:
    """One ``policy_update`` on the recipe's longest sequences; its loss and gradient norm
    finite; the GPU's peak memory (allocator reserved) within the plan's figure."""
    from megatron.core import parallel_state as ps

    from megatron_rl.platform.inventory import peak_memory_bytes, reset_peak_memory, synchronize
    from megatron_rl.trainer.batch import token_multiple
    from megatron_rl.trainer.step import policy_update

    config, run = ctx.config, ctx.run
    samples = synthetic_samples(
        config, len(run.tokenizer), ps.get_data_parallel_world_size(), config.seed
    )
    multiple = token_multiple(
        config.model.fp8_scaling, config.parallel.tensor, config.parallel.sequence_parallel
    )
    reset_peak_memory()
    t0 = time.perf_counter()
    result = policy_update(
        run.ddp,
        ctx.optim.optimizer,
        samples,
        config.algorithm,
        config.batch.micro_batch_size,
        micro_batch_tokens=config.batch.micro_batch_tokens,
        temperature=config.rollout.temperature,
        token_multiple=multiple,
        pack=config.batch.pack,
    )
    synchronize()
    seconds = time.perf_counter() - t0
    peak = peak_memory_bytes()
    plan = planned_bytes(config)
    seq = len(samples[0].prompt_tokens) + len(samples[0].response_tokens)
    problems = []
    if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
        problems.append(f"loss {result.loss} / grad norm {result.grad_norm} not finite")
    if peak is not None:
        from megatron_rl.platform import collectives

        peak = int(collectives.all_reduce(torch.tensor([peak]), op=_max())[0])
        if peak > plan:
            problems.append(
                f"peak memory {peak / GB:.3g} GB exceeds the plan's {plan / GB:.3g} GB: the plan "
                "underestimates this layout; run `megatron-rl plan` with a larger --headroom "
                "or take its suggested layout"
            )
    mem = "n/a (cpu)" if peak is None else f"peak {peak / GB:.3g} GB/GPU"
    return Outcome(
        not problems,
        f"{len(samples)} x {seq} tokens in {seconds:.2f} s, loss {result.loss:.3g}; {mem}",
        f"plan {plan / GB:.3g} GB/GPU" + (" (GPU only)" if peak is None else ""),
        "; ".join(problems),
        {"samples": len(samples), "sequence_tokens": seq, "seconds": seconds,
         "loss": result.loss, "grad_norm": result.grad_norm, "peak_bytes": peak,
         "plan_bytes": plan},
    )  # fmt: skip


def _max():
    import torch.distributed as dist

    return dist.ReduceOp.MAX


def _directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _checksum(model) -> float:
    """Sum of this rank's weights (fp32 per tensor: deterministic for the same values, and
    no fp64 copy of an 8B model's largest tensor)."""
    return float(sum(float(p.detach().float().sum()) for p in model.parameters()))


def check_checkpoint(ctx: PreflightContext) -> Outcome:
    """A save of the updated state (model + optimizer, ``CheckpointManager``) and a load
    into weights changed meanwhile; the loaded weights must be the saved ones. GB/s of both
    (informational)."""
    from megatron_rl.platform import collectives
    from megatron_rl.platform.inventory import synchronize
    from megatron_rl.trainer.state import CheckpointManager

    run = ctx.run
    manager = CheckpointManager(ctx.work_dir, keep_last=1, hf_source_dir=run.hf_dir)
    saved = _checksum(run.model)
    t0 = time.perf_counter()
    path = manager.save(1, run.model, {"preflight": True}, optimizer=ctx.optim.optimizer)
    synchronize()
    save_seconds = time.perf_counter() - t0
    size = collectives.broadcast_object(_directory_bytes(path) if ctx.main else None)
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    t0 = time.perf_counter()
    manager.load(run.model, path, optimizer=ctx.optim.optimizer, restore_rng=False)
    synchronize()
    load_seconds = time.perf_counter() - t0
    loaded = _checksum(run.model)
    same = not collectives.any_rank(not math.isclose(loaded, saved, rel_tol=1e-9, abs_tol=1e-6))
    collectives.barrier()
    if ctx.main:
        shutil.rmtree(manager.root, ignore_errors=True)
    save_gbps, load_gbps = size / save_seconds / GB, size / load_seconds / GB
    return Outcome(
        same,
        f"{size / GB:.3g} GB: save {save_gbps:.3g} GB/s, load {load_gbps:.3g} GB/s",
        "loads back the saved weights",
        "" if same else "the loaded weights differ from the saved ones: the dist checkpoint "
        "of this layout is broken (see the log of megatron_rl.trainer.state)",
        {"bytes": size, "save_seconds": save_seconds, "load_seconds": load_seconds,
         "save_gb_per_s": save_gbps, "load_gb_per_s": load_gbps},
    )  # fmt: skip
