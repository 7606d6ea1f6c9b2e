#!/usr/bin/env python
"""Seconds and trained tokens per second of one policy update (the trainer's own path:
megatron DDP, megatron AdamW, the forward-backward schedule, CISPO), on this machine.

One rank, a preset's random weights, a synthetic batch of ``--groups`` x ``--samples``
responses of ``--response-tokens`` tokens after ``--prompt-tokens``-token prompts.

    .venv/bin/python tools/bench_train_step.py [--preset tiny-llama] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--response-tokens", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, get_platform, init_distributed
    from megatron_rl.trainer.batch import TrainSample
    from megatron_rl.trainer.optim import build_optimizer, wrap_model
    from megatron_rl.trainer.step import policy_update

    init_distributed(ParallelConfig(), seed=0)
    model = build_model(ModelConfig(preset=args.preset, dtype=args.dtype), ParallelConfig())
    ddp = wrap_model(model)
    optim = build_optimizer(ddp, OptimizerConfig(lr=1e-6, warmup_steps=0))
    vocab = model.architecture.vocab_size
    gen = torch.Generator().manual_seed(0)
    samples = []
    for g in range(args.groups):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist()
        for i in range(args.samples):
            n = args.response_tokens
            samples.append(
                TrainSample(
                    g, g, prompt, torch.randint(3, vocab, (n,), generator=gen).tolist(),
                    (-torch.rand(n, generator=gen)).tolist(), [True] * n, float(i % 2), [0] * n,
                )
            )  # fmt: skip
    gpu = get_platform().is_gpu
    times = []
    for step in range(args.steps + 1):  # the first one warms up
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = policy_update(ddp, optim.optimizer, samples, AlgorithmConfig(), args.micro_batch)
        if gpu:
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
    print(f"platform: {get_platform().device}  preset: {args.preset}  dtype: {args.dtype}")
    print(f"batch: {len(samples)} sequences, {tokens} tokens ({result.num_tokens} with loss)")
    print(
        f"policy update: {seconds:.3f} s (median of {len(times)})  {tokens / seconds:,.0f} tokens/s"
    )
    if gpu:
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
