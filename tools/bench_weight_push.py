"""Weight push Megatron -> vLLM engines: push time against a memcpy of the same bytes.

For each model size (``--sizes``, MB of fp32 weights: a random Llama made as an HF directory
and loaded into a one-rank Megatron model) and each placement, starts a pool and times full
pushes with ``push_megatron_weights``, as the trainer pushes: the export (HF names from the
Megatron shards), packing, transport and every engine's vLLM reload, from the first bucket
to the last engine's ack. Prints per row: bytes, buckets, the best and median push, GB/s,
a plain ``copy_`` of the same bytes (``parity.copy_seconds``), push / memcpy, the longest
engine pause (vLLM's reload, the engine's part), the push beyond that pause (ours: export,
packing, transport, commands, acks) and the export alone (the stream iterated without a
pool), then checks that every engine serves the trainer's weights.

On CPU it also prints the floor of vLLM's own reload at each size (``--floor``, on by
default on CPU): vLLM 0.32's layerwise reload loads every weight into freshly allocated
parameters, then its CPU linear method packs each Linear for oneDNN (``create_onednn_mm``)
and drops the loaded weight, so a push pays, per byte, a first touch of fresh memory twice
and oneDNN's reorder. The floor times those two steps alone on the model's Linear weights
(a fresh ``empty_like`` + ``copy_`` each, and ``create_onednn_mm`` each), against the memcpy.

Measured on the project's 2-core machine (session 14, 500 MB, 256 MiB buckets): the floor is
fresh memory + copy 40 ms and oneDNN packing 74 ms for 430 MB of Linear weights, 3.9x the
29 ms memcpy of the whole model, so no push through vLLM 0.32's CPU reload reaches 3.3x; the
pushes themselves took 293-506 ms (10-18x; the engine's pause 286-445 ms, the push beyond it
6-34 ms). Two ways under the floor were measured and left out: keeping the weights unpacked
(``torch.nn.functional.linear``, loaded in place: the push 1.9x memcpy) generates 2.5x slower
(oneDNN's packed GEMM is 2-4x faster at decode sizes); transparent huge pages for the
engine's allocations (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, ``THP_MEM_ALLOC_ENABLE=1``)
cut page faults (the push 5.6x in process, 8.1x subprocess) but generated 3-10% slower.

The fixed cost per push (pause, commands, acks, exporter set-up: what a push costs beyond
its bytes) is the intercept at 0 bytes of the line through the best push times of the
smallest and the largest size (per placement and engine count); needs two sizes.

Usage: python tools/bench_weight_push.py [--sizes 14,500] [--placements in_process,subprocess]
           [--engines 1] [--bucket-mb N] [--repeats 5] [--json] [--no-floor]
Defaults run in about 3 minutes on a 2-core CPU; run it on a quiet machine (the load
average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def model_dims(megabytes: float) -> dict[str, int]:
    """Llama dimensions of about ``megabytes`` MB of fp32 weights (head_dim 64, as vLLM's
    CPU attention needs; GQA 4:1): hidden 256 below 100 MB (the vocabulary grows), hidden
    1024 above (the layers grow)."""
    hidden, ffn = (256, 1024) if megabytes < 100 else (1024, 4096)
    heads = hidden // 64
    kv = max(1, heads // 4)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv * 64 + 3 * hidden * ffn + 2 * hidden
    params = megabytes * 1e6 / 4
    if megabytes < 100:
        layers = 2
        vocab = max(256, int((params - layers * per_layer) / (2 * hidden)))
    else:
        vocab = 16000
        layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    return {
        "hidden": hidden,
        "ffn": ffn,
        "heads": heads,
        "kv": kv,
        "layers": layers,
        "vocab": vocab,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="14,500", help="model sizes in MB, comma-separated")
    parser.add_argument("--placements", default="in_process,subprocess")
    parser.add_argument("--engines", default="1", help="engine counts, comma-separated")
    parser.add_argument(
        "--bucket-mb", type=int, default=None, help="default: rollout.weight_bucket_mb's"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time vLLM's CPU reload steps alone (default: on CPU)",
    )
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    counts = [int(n) for n in args.engines.split(",")]
    placements = args.placements.split(",")
    if not counts or min(counts) < 1:
        parser.error(f"--engines must list engine counts >= 1, got {args.engines!r}")
    if min(sizes) <= 0:
        parser.error(f"--sizes must be positive, got {args.sizes!r}")
    if not set(placements) <= {"in_process", "subprocess"}:
        parser.error(f"--placements: in_process and/or subprocess, got {args.placements!r}")

    from megatron_rl.platform import ParallelConfig, init_distributed

    init_distributed(ParallelConfig())
    if args.floor is None:
        from megatron_rl.platform import get_platform

        args.floor = not get_platform().is_gpu
    rows = [row for size in sizes for row in bench_size(size, placements, counts, args)]
    fixed = fixed_costs(rows)
    result = {"cpus": os.cpu_count(), "rows": rows, "fixed_ms": fixed}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{'MB':>6} {'placement':>10} {'eng':>3} {'bytes':>11} {'bkts':>4} {'push ms':>8} "
        f"{'median':>8} {'GB/s':>6} {'memcpy ms':>9} {'push/cp':>7} {'paused ms':>9} "
        f"{'beyond ms':>9} {'export ms':>9} {'load':>5}"
    )
    for r in rows:
        print(
            f"{r['megabytes']:>6.0f} {r['placement']:>10} {r['engines']:>3} {r['bytes']:>11} "
            f"{r['buckets']:>4} {r['push_ms']:>8.1f} {r['median_push_ms']:>8.1f} "
            f"{r['gb_per_second']:>6.2f} {r['copy_ms']:>9.2f} {r['push_to_copy_ratio']:>7.1f} "
            f"{r['engine_paused_ms']:>9.1f} {r['beyond_pause_ms']:>9.1f} {r['export_ms']:>9.1f} "
            f"{r['load_average']:>5.2f}"
        )
    # The floor is measured once per size: printed once per size (the JSON has it per row).
    for r in {r["megabytes"]: r for r in rows if "floor" in r}.values():
        f = r["floor"]
        print(
            f"vLLM CPU reload floor at {r['megabytes']:.0f} MB ({f['linear_bytes']} bytes of "
            f"Linear weights): fresh memory + copy {f['fresh_copy_ms']:.1f} ms, oneDNN packing "
            f"{f['onednn_pack_ms']:.1f} ms, together {f['floor_to_copy_ratio']:.1f}x the memcpy "
            f"of all {r['bytes']} bytes"
        )
    for key, ms in fixed.items():
        print(f"fixed cost per push ({key}): {ms:.1f} ms (intercept at 0 bytes)")
    print(
        "push ms: best of the repeats (median beside it), export to the last engine's ack; "
        "paused ms: the longest engine pause (vLLM's reload); beyond ms: the push beyond that "
        "pause (ours: export, packing, transport, commands, acks); export ms: the stream alone"
    )


def bench_size(megabytes: float, placements, counts, args) -> list[dict]:
    """Rows for one model size: every placement x engine count."""
    import torch

    from megatron_rl.conversion.weight_stream import iter_hf_weights
    from megatron_rl.models import make_hf_model, preset_hf_config
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.parity import copy_seconds, megatron_from_hf, perturb_
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights.push import push_megatron_weights

    dims = model_dims(megabytes)
    config = preset_hf_config(
        "tiny-llama",
        hidden_size=dims["hidden"],
        num_hidden_layers=dims["layers"],
        intermediate_size=dims["ffn"],
        vocab_size=dims["vocab"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv"],
    )
    rows = []
    floor = None
    with tempfile.TemporaryDirectory() as hf_dir:
        make_hf_model(config, hf_dir, seed=0)
        model = megatron_from_hf(hf_dir)
        perturb_(model, seed=1, noise=0.5)  # a push that changes what the engines generate
        probe = RolloutConfig(weight_bucket_mb=args.bucket_mb)
        bucket_bytes = probe.weight_bucket_bytes
        exports = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                for _bucket in iter_hf_weights(model, bucket_bytes):
                    pass
            exports.append(time.perf_counter() - start)
        if args.floor:
            floor = reload_floor(model, bucket_bytes, args.repeats)
        for placement in placements:
            for count in counts:
                rollout = RolloutConfig(
                    engines=count,
                    placement=placement,
                    dtype="float32",
                    max_num_seqs=4,
                    weight_bucket_mb=bucket_bytes // 2**20,
                )
                with GeneratorPool(hf_dir, rollout) as pool, torch.no_grad():
                    push_megatron_weights(pool, model)  # warm-up
                    load = os.getloadavg()[0]
                    pushes = [push_megatron_weights(pool, model) for _ in range(args.repeats)]
                    check_engines_run_the_trainers_weights(pool, model, count)
                nbytes = pushes[0].bytes
                best = min(p.seconds for p in pushes)
                copy = copy_seconds(nbytes)
                rows.append(
                    {
                        "megabytes": megabytes,
                        "placement": placement,
                        "engines": count,
                        "bytes": nbytes,
                        "buckets": pushes[0].buckets,
                        "bucket_mb": bucket_bytes / 2**20,
                        "push_ms": best * 1e3,
                        "median_push_ms": statistics.median(p.seconds for p in pushes) * 1e3,
                        "gb_per_second": nbytes / best / 1e9,
                        "copy_ms": copy * 1e3,
                        "push_to_copy_ratio": best / copy,
                        "engine_paused_ms": min(p.load_seconds for p in pushes) * 1e3,
                        # the push beyond the engine's pause: export, packing, transport,
                        # commands and acks (the engine's reload is vLLM's)
                        "beyond_pause_ms": min(p.seconds - p.load_seconds for p in pushes) * 1e3,
                        "export_ms": min(exports) * 1e3,
                        "load_average": load,
                    }
                )
                if floor is not None:
                    rows[-1]["floor"] = {
                        **floor,
                        "floor_to_copy_ratio": (floor["fresh_copy_ms"] + floor["onednn_pack_ms"])
                        / (copy * 1e3),
                    }
    return rows


def reload_floor(model, bucket_bytes: int, repeats: int) -> dict:
    """The two steps of vLLM 0.32's CPU reload that scale with the bytes, timed alone on the
    model's exported Linear weights (2-D ``*.weight`` but the embedding), best of
    ``repeats``: loading into fresh parameters (``empty_like`` + ``copy_``, memory touched for
    the first time) and oneDNN's packing (``vllm._custom_ops.create_onednn_mm``, as
    ``dispatch_cpu_unquantized_gemm`` calls it). Times in ms."""
    import torch
    from vllm import _custom_ops as ops

    from megatron_rl.conversion.weight_stream import iter_hf_weights

    with torch.no_grad():
        weights = [
            t.clone()
            for bucket in iter_hf_weights(model, bucket_bytes)
            for name, t in bucket
            if t.ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name
        ]
    fresh, pack = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        loaded = [torch.empty_like(t).copy_(t) for t in weights]
        fresh.append(time.perf_counter() - start)
        del loaded
        start = time.perf_counter()
        handles = [ops.create_onednn_mm(t.t(), 32) for t in weights]
        pack.append(time.perf_counter() - start)
        del handles
    return {
        "linear_bytes": sum(t.numel() * t.element_size() for t in weights),
        "fresh_copy_ms": min(fresh) * 1e3,
        "onednn_pack_ms": min(pack) * 1e3,
    }


def fixed_costs(rows: list[dict]) -> dict[str, float]:
    """Per placement and engine count: the intercept at 0 bytes (ms) of the line through the
    best push of the smallest and of the largest size."""
    out = {}
    for key in sorted({(r["placement"], r["engines"]) for r in rows}):
        mine = sorted((r for r in rows if (r["placement"], r["engines"]) == key), key=_bytes)
        small, large = mine[0], mine[-1]
        if large["bytes"] > small["bytes"]:
            slope = (large["push_ms"] - small["push_ms"]) / (large["bytes"] - small["bytes"])
            out[f"{key[0]}, {key[1]} engine(s)"] = small["push_ms"] - slope * small["bytes"]
    return out


def _bytes(row: dict) -> int:
    return row["bytes"]


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
