#!/usr/bin/env python
"""Seconds and trained tokens per second of one policy update (the trainer's own path:
megatron DDP, megatron AdamW, the forward-backward schedule, CISPO), on this machine.

One rank, a preset's random weights, a synthetic batch of ``--groups`` x ``--samples``
responses of ``--response-tokens`` tokens after ``--prompt-tokens``-token prompts.

    .venv/bin/python tools/bench_train_step.py [--preset tiny-llama] [--dtype float32]

``--recompute``: the cost of ``algorithm.mismatch_reference: recompute`` (TIS): the step with
the ``update`` reference (the update's own forward), and with the recompute (the no-grad
pi_old forward over the batch that a PPO-off-policy-k round runs once per batch, plus the
update), interleaved, in wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

logger = logging.getLogger("bench_train_step")


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
    parser.add_argument(
        "--recompute", action="store_true", help="time mismatch_reference recompute vs update"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, get_platform, init_distributed
    from megatron_rl.trainer.batch import TrainSample
    from megatron_rl.trainer.optim import build_optimizer, wrap_model
    from megatron_rl.trainer.step import policy_update, recompute_old_logprobs

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

    def update(algo):
        return policy_update(ddp, optim.optimizer, samples, algo, args.micro_batch)

    def sync() -> None:  # the GPU's queued work done before a clock is read
        if gpu:
            torch.cuda.synchronize()

    if args.recompute:
        return bench_recompute(args, samples, ddp, update, sync, recompute_old_logprobs)
    times = []
    for step in range(args.steps + 1):  # the first one warms up
        sync()
        start = time.perf_counter()
        result = update(AlgorithmConfig())
        sync()
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


def bench_recompute(args, samples, ddp, update, sync, recompute_old_logprobs) -> None:
    """Step time with mismatch_reference update vs recompute (TIS, token level), the two
    interleaved step by step; wall and CPU seconds (the process's, all threads: steadier
    than wall time on a shared machine), medians over ``--steps`` after a warm-up round."""
    from megatron_rl.algorithms.config import AlgorithmConfig

    plain = AlgorithmConfig(mismatch="tis")
    recompute = AlgorithmConfig(mismatch="tis", mismatch_reference="recompute")
    parts = {
        "update": lambda: update(plain),
        "forward": lambda: recompute_old_logprobs(ddp, [samples], recompute, args.micro_batch),
        "recompute": lambda: update(recompute),  # the update after that forward
    }
    rounds: list[dict[str, tuple[float, float]]] = []
    for _ in range(args.steps + 1):
        measured = {}
        for name, run in parts.items():
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            sync()
            measured[name] = (time.perf_counter() - wall, time.process_time() - cpu)
        rounds.append(measured)
    logger.info("seconds (wall, cpu) of each round: %s", rounds)
    rounds = rounds[1:]  # the first warms up
    print(f"preset: {args.preset}  dtype: {args.dtype}  batch: {len(samples)} sequences")
    for clock, i in (("wall", 0), ("cpu", 1)):

        def median(values: list[float]) -> float:
            return sorted(values)[len(values) // 2]

        step = median([r["update"][i] for r in rounds])
        forward = median([r["forward"][i] for r in rounds])
        with_recompute = median([r["forward"][i] + r["recompute"][i] for r in rounds])
        extra = median([(r["forward"][i] + r["recompute"][i]) / r["update"][i] for r in rounds])
        print(
            f"{clock:>4} s/step (median of {len(rounds)}): update {step:.3f}, recompute "
            f"{with_recompute:.3f} (pi_old forward {forward:.3f} per batch): "
            f"+{100 * (extra - 1):.0f}% step time"
        )


if __name__ == "__main__":
    main()
