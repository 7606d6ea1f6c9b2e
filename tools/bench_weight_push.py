"""Weight push Megatron -> vLLM: throughput, as a ratio to a plain copy of the same bytes.

Builds a random Llama (default ~0.5 GB in fp32) as an HF directory, loads it into a one-rank
Megatron model and a vLLM engine pool, then times full pushes (export + gather + transport +
vLLM's reload). Also times the export stream alone and a plain ``copy_`` of the same bytes.

Usage: python tools/bench_weight_push.py [--hidden 1024] [--layers 4] [--ffn 4096]
           [--vocab 32000] [--placement in_process|subprocess] [--engines 1]
           [--bucket-mb 256] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--placement", choices=["in_process", "subprocess"], default="in_process")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from megatron_rl.conversion.weight_stream import iter_hf_weights
    from megatron_rl.models import make_hf_model, preset_hf_config
    from megatron_rl.platform import ParallelConfig, init_distributed
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.parity import copy_seconds, megatron_from_hf
    from megatron_rl.rollout.pool import GeneratorPool

    heads = args.hidden // 64
    config = preset_hf_config(
        "tiny-llama",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        intermediate_size=args.ffn,
        vocab_size=args.vocab,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
    )
    bucket = args.bucket_mb * 2**20
    with tempfile.TemporaryDirectory() as hf_dir:
        make_hf_model(config, hf_dir, seed=0)
        init_distributed(ParallelConfig())
        model = megatron_from_hf(hf_dir)
        rollout = RolloutConfig(
            engines=args.engines,
            placement=args.placement,
            dtype="float32",
            max_num_seqs=4,
            weight_bucket_mb=args.bucket_mb,
        )
        with GeneratorPool(hf_dir, rollout) as pool:
            pool.push_weights(iter_hf_weights(model, bucket))  # warm-up
            pushes = [
                pool.push_weights(iter_hf_weights(model, bucket)) for _ in range(args.repeats)
            ]
            assert pool.generate([[1, 5, 9]], samples_per_prompt=1, max_tokens=4)  # still serves
    streams = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for b in iter_hf_weights(model, bucket):
            for _, tensor in b:
                tensor.sum()  # touch the data like a consumer would
        streams.append(time.perf_counter() - start)
    nbytes = pushes[0].bytes
    push = statistics.median(p.seconds for p in pushes)
    paused = statistics.median(p.load_seconds for p in pushes)
    copy = copy_seconds(nbytes)
    result = {
        "bytes": nbytes,
        "params": nbytes // 4,
        "engines": args.engines,
        "placement": args.placement,
        "bucket_mb": args.bucket_mb,
        "push_seconds": push,
        "engine_paused_seconds": paused,
        "export_stream_seconds": statistics.median(streams),
        "copy_seconds": copy,
        "push_gb_per_s": nbytes / push / 1e9,
        "copy_gb_per_s": nbytes / copy / 1e9,
        "push_to_copy_ratio": push / copy,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"pushed {nbytes / 1e6:.0f} MB ({args.placement}, {args.engines} engine(s), "
        f"{args.bucket_mb} MiB buckets): median {push:.3f} s = {result['push_gb_per_s']:.2f} GB/s"
        f" (engine paused {paused:.3f} s; export stream alone "
        f"{result['export_stream_seconds']:.3f} s)\n"
        f"plain copy of the same bytes: {copy:.4f} s = {result['copy_gb_per_s']:.2f} GB/s\n"
        f"push / copy = {result['push_to_copy_ratio']:.1f}x"
    )


if __name__ == "__main__":
    main()
