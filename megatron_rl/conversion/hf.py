"""HF <-> Megatron conversion (nvidia-modelopt importer/exporter underneath).

``hf_to_mcore``: HF directory -> megatron dist checkpoint, loading each rank's TP/PP/EP shard.
``mcore_to_hf``: dist checkpoint -> HF safetensors + config + tokenizer files. The checkpoint
is loaded into a single-process (TP=PP=EP=1) model, since dist checkpoints reshard on load and
modelopt's exporter does not gather tensor-parallel shards.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from megatron_rl.conversion import checkpoint
from megatron_rl.conversion.modelopt_bridge import modelopt_export
from megatron_rl.models.config import ModelConfig
from megatron_rl.models.provider import DTYPES
from megatron_rl.platform import (
    ParallelConfig,
    destroy_distributed,
    init_distributed,
    run_local_ranks,
)

logger = logging.getLogger(__name__)


def check_hf_dir(hf_dir: str | Path) -> Path:
    """Clear errors for an HF directory that cannot be converted."""
    import transformers

    from megatron_rl.models.arch import architecture_from_hf

    path = Path(hf_dir)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json")
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"{path}: no *.safetensors weights")
    architecture_from_hf(transformers.AutoConfig.from_pretrained(path))
    return path


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def source_dtype(hf_dir: str | Path) -> str:
    """The dtype an HF model is stored in, from its safetensors headers: "bfloat16" when every
    floating-point tensor is BF16, else "float32" (which holds F16/BF16/F32 values exactly).

    The headers, not ``config.json``'s ``torch_dtype``, which may disagree with the weights.
    """
    from safetensors import safe_open

    stored = set()
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            stored.update(f.get_slice(key).get_dtype() for key in f.keys())  # noqa: SIM118
    floating = {_SAFETENSORS_DTYPES[d] for d in stored if d in _SAFETENSORS_DTYPES}
    return "bfloat16" if floating == {"bfloat16"} else "float32"


def load_hf_weights(model, hf_dir: str | Path, dtype: torch.dtype) -> None:
    """Load HF weights into this rank's part of a megatron model (TP/PP/EP aware)."""
    mte = modelopt_export()
    mte.import_mcore_gpt_from_hf(model, str(hf_dir), dtype=dtype)


def hf_to_mcore(
    hf_dir: str, out_dir: str, parallel: ParallelConfig, dtype: str | None = None
) -> None:
    """Convert an HF model directory into a megatron dist checkpoint (spawns the ranks needed).

    ``dtype``: the checkpoint's dtype; default the source's (:func:`source_dtype`), so that a
    round trip with default flags is exact.
    """
    check_hf_dir(hf_dir)
    if dtype is None:
        dtype = source_dtype(hf_dir)
        logger.info("hf-to-mcore: %s: converting to the source dtype %s", hf_dir, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    # The smallest world that holds the layout: expert parallelism spans data-parallel ranks.
    world = parallel.model_parallel_size
    while (
        world % parallel.expert
        or (world // (parallel.pipeline * parallel.context)) % parallel.expert
    ):
        world += parallel.model_parallel_size
    run_local_ranks(_hf_to_mcore_rank, world, hf_dir, out_dir, parallel, dtype)


def _hf_to_mcore_rank(hf_dir: str, out_dir: str, parallel: ParallelConfig, dtype: str) -> None:
    from megatron_rl.models.provider import build_model, load_hf_config

    init_distributed(parallel)
    try:
        cfg = ModelConfig(hf_path=hf_dir, dtype=dtype, fp32_head=False, layer_spec="auto")
        model = build_model(cfg, parallel)
        load_hf_weights(model, hf_dir, DTYPES[dtype])
        hf_config = load_hf_config(cfg)
        hf_config.dtype = dtype  # what the checkpoint holds: mcore-to-hf's default dtype
        checkpoint.save_model(model, out_dir, hf_config, hf_source_dir=hf_dir)
    finally:
        destroy_distributed()


def mcore_to_hf(ckpt_dir: str, out_dir: str, dtype: str | None = None) -> None:
    """Convert a megatron dist checkpoint into an HF directory (one process)."""
    from megatron_rl.models.provider import build_model

    hf_config = checkpoint.load_hf_config(ckpt_dir)
    dtype = dtype or str(getattr(hf_config, "dtype", None) or "float32").replace("torch.", "")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    parallel = ParallelConfig()
    init_distributed(parallel)
    try:
        hf_cfg_dir = Path(ckpt_dir) / checkpoint.HF_CONFIG_SUBDIR
        cfg = ModelConfig(hf_path=str(hf_cfg_dir), dtype=dtype, fp32_head=False)
        model = build_model(cfg, parallel, hf_config=hf_config)
        checkpoint.load_model(model, ckpt_dir)
        mte = modelopt_export()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        mte.export_mcore_gpt_to_hf(model, str(hf_cfg_dir), dtype=DTYPES[dtype], export_dir=str(out))
        # modelopt rewrites some config fields from megatron's (e.g. Llama-4's intermediate_size
        # from the dense ffn size); the config we converted from is the truth.
        for path in hf_cfg_dir.iterdir():
            shutil.copy(path, out / path.name)
        for stray in ("hf_quant_config.json",):
            (out / stray).unlink(missing_ok=True)
    finally:
        destroy_distributed()
    logger.info("wrote HF model to %s", out_dir)
