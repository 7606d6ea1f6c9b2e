"""Weight push Megatron -> vLLM engines: push time vs the number of engines (the fan-out).

Builds a random Llama (default ~64 MB in fp32: bytes dominate, not per-tensor overheads) as an
HF directory, loads it into a one-rank Megatron model, exports its weights once (HF names,
``--bucket-mb`` buckets), then for every engine count starts a pool of that many engines and
times full pushes of those buckets (pack + transport + every engine's vLLM reload; the export
is timed apart, once), then checks that every engine has the trainer's weights. The push should grow well under linearly in the number of engines:
a bucket is packed once and sent to all engines at the same time. Prints t(n) / t(1).

Also prints the CPU time per push of the pool (this process: packing and sending) and of the
engine processes together (receiving and vLLM's reload: each engine loads its own copy, so
on a machine with fewer cores than engines this part grows with the engine count), the time
of a plain ``copy_`` of the same bytes, and the load average: run it on a quiet machine.

Usage: python tools/bench_weight_push.py [--engines 1,2,4] [--placement subprocess]
           [--hidden 512] [--layers 2] [--ffn 2048] [--vocab 8000]
           [--bucket-mb 16] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,2,4", help="engine counts, comma-separated")
    parser.add_argument("--placement", choices=["in_process", "subprocess"], default="subprocess")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--bucket-mb", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = [int(n) for n in args.engines.split(",")]
    if not counts or min(counts) < 1:
        parser.error(f"--engines must list engine counts >= 1, got {args.engines!r}")

    from megatron_rl.conversion.weight_stream import iter_hf_weights
    from megatron_rl.models import make_hf_model, preset_hf_config
    from megatron_rl.platform import ParallelConfig, init_distributed
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.parity import copy_seconds, megatron_from_hf, perturb_
    from megatron_rl.rollout.pool import GeneratorPool

    heads = args.hidden // 64  # vLLM's CPU attention needs head_dim 64
    config = preset_hf_config(
        "tiny-llama",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        intermediate_size=args.ffn,
        vocab_size=args.vocab,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
    )
    bucket_bytes = args.bucket_mb * 2**20
    rows = []
    with tempfile.TemporaryDirectory() as hf_dir:
        make_hf_model(config, hf_dir, seed=0)
        init_distributed(ParallelConfig())
        model = megatron_from_hf(hf_dir)
        perturb_(model, seed=1, noise=0.5)  # a push that changes what the engines generate
        start = time.perf_counter()
        buckets = [
            [(name, tensor.clone()) for name, tensor in bucket]
            for bucket in iter_hf_weights(model, bucket_bytes)
        ]
        export = time.perf_counter() - start
        for count in counts:
            rollout = RolloutConfig(
                engines=count,
                placement=args.placement,
                dtype="float32",
                max_num_seqs=4,
                weight_bucket_mb=args.bucket_mb,
            )
            with GeneratorPool(hf_dir, rollout) as pool:
                pool.push_weights(iter(buckets))  # warm-up
                load = os.getloadavg()[0]
                cpu = cpu_seconds(pool)
                pushes = [pool.push_weights(iter(buckets)) for _ in range(args.repeats)]
                pool_cpu, engines_cpu = (b - a for a, b in zip(cpu, cpu_seconds(pool)))
                check_engines_run_the_trainers_weights(pool, model, count)
            rows.append(
                {
                    "engines": count,
                    "push_seconds": statistics.median(p.seconds for p in pushes),
                    "best_push_seconds": min(p.seconds for p in pushes),
                    "engine_paused_seconds": statistics.median(p.load_seconds for p in pushes),
                    "pool_cpu_seconds": pool_cpu / args.repeats,
                    "engines_cpu_seconds": engines_cpu / args.repeats,
                    "load_average_1min": load,
                }
            )
    nbytes = pushes[0].bytes
    base = rows[0]["best_push_seconds"]  # the best of the repeats: least disturbed
    for row in rows:
        row["ratio_to_first"] = row["best_push_seconds"] / base
    result = {
        "bytes": nbytes,
        "buckets": pushes[0].buckets,
        "placement": args.placement,
        "bucket_mb": args.bucket_mb,
        "export_seconds": export,
        "copy_seconds": copy_seconds(nbytes),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"push of {nbytes / 1e6:.0f} MB in {result['buckets']} bucket(s) of {args.bucket_mb} MiB "
        f"({args.placement}, {result['cpus']} CPUs); export alone {export:.3f} s, "
        f"plain copy {result['copy_seconds']:.4f} s"
    )
    print(
        f"{'engines':>7} {'push s':>8} {'best s':>8} {'t(n)/t(1st)':>11} {'paused s':>9} "
        f"{'pool cpu s':>10} {'engines cpu s':>13} {'load avg':>8}"
    )
    for row in rows:
        print(
            f"{row['engines']:>7} {row['push_seconds']:>8.3f} {row['best_push_seconds']:>8.3f} "
            f"{row['ratio_to_first']:>11.2f} "
            f"{row['engine_paused_seconds']:>9.3f} {row['pool_cpu_seconds']:>10.3f} "
            f"{row['engines_cpu_seconds']:>13.3f} {row['load_average_1min']:>8.2f}"
        )
    print(
        "push s / best s: median / best wall time of a push (t(n) / t(1st): of the best); "
        "paused s: the longest engine pause; cpu s: per push"
    )


def cpu_seconds(pool) -> tuple[float, float]:
    """CPU time used so far by this process (the pool: packing and sending) and by all the
    pool's engine processes together (receiving and vLLM's reload); engines in this process
    count as this process."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    engines = 0.0
    for engine in pool._engines:  # a tool's look inside: the engine processes' ids
        pid = engine.handle.pid
        if pid is not None and pid != os.getpid():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            engines += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return usage.ru_utime + usage.ru_stime, engines


def check_engines_run_the_trainers_weights(pool, model, count: int) -> None:
    """After the pushes every engine serves the trainer's (perturbed) weights: one sample per
    engine has Megatron's log-probs (before any push they differ by ~1 nat)."""
    from megatron_rl.rollout.parity import logprob_deltas

    samples = pool.generate([[1, 5, 9]] * count, samples_per_prompt=1, max_tokens=8)
    assert {s.engine for s in samples} == set(range(count)), "one prompt per engine"
    for sample in samples:
        delta = logprob_deltas(model, [sample])
        if delta.max() > 1e-4:
            raise AssertionError(f"engine {sample.engine}: log-probs off by {delta.max():.2e}")


if __name__ == "__main__":
    main()
