"""HF <-> Megatron conversion (nvidia-modelopt importer/exporter underneath).

``hf_to_mcore``: HF directory -> megatron dist checkpoint, loading each rank's TP/PP/EP shard.
``mcore_to_hf``: dist checkpoint -> HF safetensors + config + tokenizer files, in one process
(TP=PP=EP=1: dist checkpoints reshard on load), streamed one layer at a time through a model on
the meta device, so that a model larger than any one device (or the host's memory) converts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from megatron_rl.conversion import checkpoint
from megatron_rl.conversion.modelopt_bridge import importer_config, modelopt_export
from megatron_rl.models.config import ModelConfig
from megatron_rl.models.provider import DTYPES
from megatron_rl.platform import (
    ParallelConfig,
    destroy_distributed,
    init_distributed,
    local_device_count,
    run_local_ranks,
)

logger = logging.getLogger(__name__)


def check_hf_dir(hf_dir: str | Path) -> Path:
    """Clear errors for an HF directory that cannot be converted."""
    from megatron_rl.models.arch import architecture_from_hf
    from megatron_rl.models.hf_config import load_hf_config

    path = Path(hf_dir)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json")
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"{path}: no *.safetensors weights")
    architecture_from_hf(load_hf_config(path))
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
    with importer_config(hf_dir):
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
    devices = local_device_count()
    if "WORLD_SIZE" not in os.environ and devices is not None and world > devices:
        raise ValueError(
            f"--tp {parallel.tensor} --pp {parallel.pipeline} --ep {parallel.expert} needs "
            f"{world} ranks, one GPU each, but this node has {devices} GPU(s). Convert with a "
            "layout that fits (the checkpoint reshards on load: any training layout can read "
            f"it), or run this command on {world} ranks across nodes under torchrun or srun."
        )
    run_local_ranks(_hf_to_mcore_rank, world, hf_dir, out_dir, parallel, dtype)


def _hf_to_mcore_rank(hf_dir: str, out_dir: str, parallel: ParallelConfig, dtype: str) -> None:
    from megatron_rl.conversion.streamed_save import StreamedSaveStrategy
    from megatron_rl.models.provider import build_model, load_hf_config

    init_distributed(parallel)
    try:
        # Local layer specs, on the meta device: TE modules allocate on the GPU whatever the
        # device context. Their checkpoint keys are TE's (megatron's local specs map them, and
        # models.specs keeps a MoE layer's pre_mlp_layernorm as TE does), so TE-spec models
        # load the checkpoint (it holds no TE FP8 ``_extra_state``).
        cfg = ModelConfig(hf_path=hf_dir, dtype=dtype, fp32_head=False, layer_spec="local")
        model = build_model(cfg, parallel, meta=True)
        groups, materialize = _streamed_import(model, hf_dir, DTYPES[dtype])
        hf_config = load_hf_config(cfg)
        hf_config.dtype = dtype  # what the checkpoint holds: mcore-to-hf's default dtype
        strategy = StreamedSaveStrategy(groups, materialize)
        checkpoint.save_model(model, out_dir, hf_config, hf_dir, sharded_strategy=strategy)
    finally:
        destroy_distributed()


def _streamed_import(model, hf_dir: str | Path, dtype: torch.dtype):
    """This rank's module groups (embedding, each decoder layer, final norm, untied head) and a
    context manager that materialises one of them on the host with its HF weights, and frees it
    on exit (for :class:`~megatron_rl.conversion.streamed_save.StreamedSaveStrategy`).

    modelopt's ``import_mcore_gpt_from_hf`` fills the whole model in one call. Its importer
    reads each tensor lazily (``safe_open``, this rank's slice only), so we keep it and its
    mapping tables and call its per-module rules (and its per-layer
    ``_import_transformer_layer``) one group at a time, in the order its
    ``_import_state_dict`` would. The tied head of a last pipeline stage is not filled: it is a
    replica of the first stage's embedding, which the checkpoint stores once.
    """
    import torch.distributed as dist
    from tqdm import tqdm

    modelopt_export()  # first: it fills modelopt's gaps before modelopt is imported
    from modelopt.torch.export.plugins.megatron_importer import GPTModelImporter

    with importer_config(hf_dir):
        importer = GPTModelImporter(model, str(hf_dir), dtype=dtype)
    rules = importer.rules
    layers = list(model.decoder.layers)
    progress = tqdm(total=len(layers), desc="hf-to-mcore", disable=dist.get_rank() > 0)
    fills: list[tuple[torch.nn.Module, Callable[[], None]]] = []
    if getattr(model, "embedding", None) is not None:
        words = model.embedding.word_embeddings
        fills.append((words, lambda: rules["word_embeddings"](words)))
    for layer in layers:

        def fill(layer=layer) -> None:
            importer._import_transformer_layer(layer, layer.layer_number - 1, progress)
            progress.update()

        fills.append((layer, fill))
    final_norm = getattr(model.decoder, "final_layernorm", None)
    if final_norm is not None:
        fills.append((final_norm, lambda: rules["final_layernorm"](final_norm)))
    head = getattr(model, "output_layer", None)
    if head is not None and not model.share_embeddings_and_output_weights:
        fills.append((head, lambda: rules["output_layer"](head)))
    fill_of = {id(group): fill for group, fill in fills}

    @contextlib.contextmanager
    def materialize(group: torch.nn.Module):
        group.to_empty(device="cpu")
        try:
            with torch.no_grad():
                for param in group.parameters():
                    param.fill_(float("nan"))
                fill_of[id(group)]()
            unset = [n for n, p in group.named_parameters() if p.isnan().any()]
            if unset:
                raise ValueError(
                    f"{hf_dir}: modelopt's importer set no value (or NaN) for {unset[:5]}"
                )
            yield
        finally:
            group.to_empty(device="meta")

    return [group for group, _ in fills], materialize


DEFAULT_SHARD_BYTES = 2 * 2**30


def mcore_to_hf(
    ckpt_dir: str,
    out_dir: str,
    dtype: str | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> None:
    """Convert a megatron dist checkpoint into an HF directory (one process, on the host).

    Streamed: the model is built on the meta device, and one module group at a time (the
    embedding, each decoder layer, the final norm, the head) is read from the checkpoint,
    exported with modelopt's per-layer rules (``weight_stream``) and freed, while the HF
    tensors go to safetensors shards of about ``shard_bytes``. Peak memory: the largest layer
    plus one shard, not the model.
    """
    from megatron_rl.conversion.weight_stream import iter_hf_weights
    from megatron_rl.models.provider import build_model

    hf_config = checkpoint.load_hf_config(ckpt_dir)
    dtype = dtype or str(getattr(hf_config, "dtype", None) or "float32").replace("torch.", "")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(DTYPES)}")
    parallel = ParallelConfig()
    init_distributed(parallel)
    try:
        hf_cfg_dir = Path(ckpt_dir) / checkpoint.HF_CONFIG_SUBDIR
        # local layer specs: they build on the meta device, and load TE-saved checkpoints
        cfg = ModelConfig(hf_path=str(hf_cfg_dir), dtype=dtype, fp32_head=False, layer_spec="local")
        model = build_model(cfg, parallel, hf_config=hf_config, meta=True)

        @contextlib.contextmanager
        def from_checkpoint(module: torch.nn.Module):
            module.to_empty(device="cpu")
            try:
                checkpoint.load_materialized(model, ckpt_dir)
                yield
            finally:
                module.to_empty(device="meta")

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        buckets = iter_hf_weights(
            model, bucket_bytes=shard_bytes, dtype=DTYPES[dtype], materialize=from_checkpoint
        )
        write_safetensors_shards(buckets, out)
        # the config we converted from is the truth (modelopt rewrites some fields, e.g.
        # Llama-4's intermediate_size from the dense ffn size)
        for path in hf_cfg_dir.iterdir():
            shutil.copy(path, out / path.name)
        _set_config_dtype(out / "config.json", dtype)
    finally:
        destroy_distributed()
    logger.info("wrote HF model to %s", out_dir)


def write_safetensors_shards(buckets: Iterable[list[tuple[str, torch.Tensor]]], out: Path) -> None:
    """Write each bucket of ``(name, tensor)`` as one safetensors shard as it comes, then name
    them as transformers does (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    and ``model.safetensors.index.json``)."""
    from safetensors.torch import save_file

    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    total = 0
    for bucket in buckets:
        tensors = {}
        for name, tensor in bucket:
            tensor = tensor.detach()
            if tensor.untyped_storage().nbytes() != tensor.nbytes:  # a view: own its bytes
                tensor = tensor.clone()
            tensors[name] = tensor
            total += tensor.nbytes
        part = out / f".part-{len(parts):05d}.safetensors"
        save_file(tensors, str(part), metadata={"format": "pt"})
        parts.append((part, list(tensors)))
        del tensors, bucket
    if len(parts) == 1:
        parts[0][0].rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, (part, names) in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        part.rename(out / name)
        weight_map.update(dict.fromkeys(names, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _set_config_dtype(config_path: Path, dtype: str) -> None:
    config = json.loads(config_path.read_text())
    key = "dtype" if "dtype" in config else "torch_dtype"
    if config.get(key) != dtype:
        config[key] = dtype
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
