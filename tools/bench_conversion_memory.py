"""Peak host memory of HF <-> megatron conversion, on a many-layer model (CPU).

Makes a random Llama with many small layers (so that the model, not the libraries, dominates
memory) and runs each conversion in a fresh subprocess:

- ``hf-to-mcore``: ``megatron-rl convert hf-to-mcore`` as shipped (one rank; streamed per
  layer: a model on the meta device, one layer at a time filled and written);
- ``hf-to-mcore-whole``: the reference, megatron_rl's code before streaming (kept here only):
  the whole model built and filled by modelopt's ``import_mcore_gpt_from_hf``, then saved
  with megatron-core's default ``torch_dist`` strategy;
- ``mcore-to-hf``: ``megatron-rl convert mcore-to-hf`` as shipped (streamed per layer);
- ``mcore-to-hf-whole``: the reference, megatron_rl's code before streaming (kept here only):
  the whole model built and loaded, then modelopt's ``export_mcore_gpt_to_hf``.

Measurement: each subprocess first runs the same conversion on a 2-layer model of the same
width (imports, lazy initialisation), then resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``), reads its current RSS, converts the big model and reads the peak
RSS (``VmHWM`` in ``/proc/self/status``, the mark ``getrusage``'s ``ru_maxrss`` is made of).
Not ``ru_maxrss`` itself: it also keeps the peak of the memory image the process had before
``exec``, i.e. the RSS of the forking parent, which no reset clears. "extra" = peak - RSS
before; the model's bytes (its safetensors tensors) are printed alongside, and "extra/model"
is the ratio (at one rank the model is the rank's shard).

The subprocesses run with glibc's mmap threshold fixed at its 128 KiB default
(``MALLOC_MMAP_THRESHOLD_``). Left dynamic, glibc raises it (up to 32 MiB) after the first
large free, and this model's 1-3 MiB tensors then come from the heap, whose fragmentation
keeps freed layers resident (+3 MiB per layer here). A real model's tensors are far above
32 MiB and always mmapped, so the fixed threshold is what a real conversion sees.

Usage: python tools/bench_conversion_memory.py [--layers 32] [--hidden 512] [--ffn 1536]
           [--vocab 1024] [--shard-mb 16] [--modes hf-to-mcore hf-to-mcore-whole mcore-to-hf
           mcore-to-hf-whole]
           [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("hf-to-mcore", "hf-to-mcore-whole", "mcore-to-hf", "mcore-to-hf-whole")


def make_model(out_dir: str, layers: int, hidden: int, ffn: int, vocab: int) -> str:
    """A random tiny-llama-shaped HF model with ``layers`` layers (FP32)."""
    from megatron_rl.models import make_hf_model, preset_hf_config

    config = preset_hf_config(
        "tiny-llama",
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        vocab_size=vocab,
    )
    return make_hf_model(config, out_dir, seed=0)


def model_bytes(hf_dir: str | Path) -> int:
    """Bytes of the tensors of an HF model's safetensors files."""
    from safetensors import safe_open

    total = 0
    for path in Path(hf_dir).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                total += f.get_tensor(key).nbytes
    return total


def mcore_to_hf_whole(ckpt_dir: str, out_dir: str) -> None:
    """The reference: megatron_rl's mcore-to-hf before streaming (whole model in memory)."""
    import shutil

    import torch

    from megatron_rl.conversion import checkpoint
    from megatron_rl.conversion.modelopt_bridge import modelopt_export
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed

    hf_config = checkpoint.load_hf_config(ckpt_dir)
    init_distributed(ParallelConfig())
    try:
        hf_cfg_dir = Path(ckpt_dir) / checkpoint.HF_CONFIG_SUBDIR
        cfg = ModelConfig(hf_path=str(hf_cfg_dir), dtype="float32", fp32_head=False)
        model = build_model(cfg, ParallelConfig(), hf_config=hf_config)
        checkpoint.load_model(model, ckpt_dir)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        modelopt_export().export_mcore_gpt_to_hf(
            model, str(hf_cfg_dir), dtype=torch.float32, export_dir=str(out_dir)
        )
        for path in hf_cfg_dir.iterdir():
            shutil.copy(path, Path(out_dir) / path.name)
    finally:
        destroy_distributed()


def hf_to_mcore_whole(hf_dir: str, ckpt_dir: str, dtype: str = "float32") -> None:
    """The reference: megatron_rl's hf-to-mcore before streaming (one rank, whole model)."""
    from megatron_rl.conversion import checkpoint
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.provider import DTYPES, build_model, load_hf_config
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed

    init_distributed(ParallelConfig())
    try:
        cfg = ModelConfig(hf_path=hf_dir, dtype=dtype, fp32_head=False, layer_spec="local")
        model = build_model(cfg, ParallelConfig())
        load_hf_weights(model, hf_dir, DTYPES[dtype])
        hf_config = load_hf_config(cfg)
        hf_config.dtype = dtype
        checkpoint.save_model(model, ckpt_dir, hf_config, hf_source_dir=hf_dir)
    finally:
        destroy_distributed()


def _convert(mode: str, source: str, out: str, shard_bytes: int) -> None:
    from megatron_rl.conversion import hf
    from megatron_rl.platform import ParallelConfig

    if mode == "hf-to-mcore":
        hf.hf_to_mcore(source, out, ParallelConfig())
    elif mode == "hf-to-mcore-whole":
        hf_to_mcore_whole(source, out)
    elif mode == "mcore-to-hf":
        hf.mcore_to_hf(source, out, shard_bytes=shard_bytes)
    else:
        mcore_to_hf_whole(source, out)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def worker(mode: str, warmup_source: str, source: str, out: str, shard_bytes: int) -> dict:
    """Convert ``warmup_source``, reset the peak-RSS mark, convert ``source``: extra bytes."""
    _convert(mode, warmup_source, out + ".warmup", shard_bytes)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _rss_bytes()
    _convert(mode, source, out, shard_bytes)
    peak = _peak_rss_bytes()
    return {"mode": mode, "rss_before": before, "peak": peak, "extra": peak - before}


def measure(mode: str, warmup_source: str, source: str, out: str, shard_bytes: int) -> dict:
    """Run :func:`worker` in a fresh Python process."""
    path = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # see the module docstring
    args = [sys.executable, __file__, "--worker", mode, warmup_source, source, out]
    result = subprocess.run(
        args + ["--shard-mb", str(shard_bytes / 2**20)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(args, root: Path) -> dict:
    from megatron_rl.cli import main as cli

    big = make_model(str(root / "hf"), args.layers, args.hidden, args.ffn, args.vocab)
    small = make_model(str(root / "hf_small"), 2, args.hidden, args.ffn, args.vocab)
    for name, hf_dir in (("ckpt", big), ("ckpt_small", small)):
        if cli(["convert", "hf-to-mcore", hf_dir, str(root / name)]) != 0:
            raise RuntimeError("hf-to-mcore failed")
    shard_bytes = int(args.shard_mb * 2**20)
    report = {"model_bytes": model_bytes(big), "layers": args.layers, "results": []}
    for mode in args.modes:
        if mode.startswith("hf-to-mcore"):
            sources = (small, big)
        else:
            sources = (str(root / "ckpt_small"), str(root / "ckpt"))
        report["results"].append(measure(mode, *sources, str(root / f"out_{mode}"), shard_bytes))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--shard-mb", type=float, default=16)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "WARMUP", "SOURCE", "OUT"))
    args = parser.parse_args()
    if args.worker:
        mode, warmup, source, out = args.worker
        print(json.dumps(worker(mode, warmup, source, out, int(args.shard_mb * 2**20))))
        return
    with tempfile.TemporaryDirectory(prefix="bench_conversion_") as tmp:
        report = run(args, Path(tmp))
    if args.json:
        print(json.dumps(report))
        return
    mib = 2**20
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, FP32: "
        f"{report['model_bytes'] / mib:.0f} MiB of tensors"
    )
    print(f"{'conversion':>18} {'RSS before':>11} {'peak':>9} {'extra':>9} {'extra/model':>12}")
    for r in report["results"]:
        print(
            f"{r['mode']:>18} {r['rss_before'] / mib:>9.0f}Mi {r['peak'] / mib:>7.0f}Mi "
            f"{r['extra'] / mib:>7.0f}Mi {r['extra'] / report['model_bytes']:>12.2f}"
        )


if __name__ == "__main__":
    main()
