"""Megatron distributed checkpoints of a model (megatron.core.dist_checkpointing).

A model checkpoint directory holds:
  ``model/``      the dist checkpoint (sharded; loads into any TP/PP/EP layout)
  ``hf_config/``  the HF config (and tokenizer files) the model was built from
Writes are atomic: everything goes to a temporary sibling directory that is renamed into place
only when complete, so a crash never leaves a directory that loads wrong.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pickle
import queue
import shutil
import signal
import tempfile
from pathlib import Path

import torch.distributed as dist
import transformers
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from torch.distributed.checkpoint.api import CheckpointException

logger = logging.getLogger(__name__)

MODEL_SUBDIR = "model"
HF_CONFIG_SUBDIR = "hf_config"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def save_hf_config(
    config: transformers.PretrainedConfig, source_dir: str | Path | None, out_dir: Path
) -> None:
    """Write the HF config and copy tokenizer files from ``source_dir`` (if any)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy(Path(source_dir) / name, out_dir / name)


def save_model(
    model,
    ckpt_dir: str | Path,
    hf_config,
    hf_source_dir: str | Path | None = None,
    sharded_strategy=None,
    async_save: bool = False,
) -> AsyncRequest | None:
    """Save ``model`` (all ranks call this) as a dist checkpoint into ``ckpt_dir``, atomically.

    ``sharded_strategy``: megatron's default (``torch_dist``) unless given, e.g. a
    :class:`~megatron_rl.conversion.streamed_save.StreamedSaveStrategy` for a model on the
    meta device.

    ``async_save``: plan the save and return megatron's ``AsyncRequest`` instead of writing:
    the caller schedules it (``AsyncCallsQueue.schedule_async_request``, which stages the
    tensors off the live parameters and forks the writer) and finalizes it on every rank;
    ``ckpt_dir`` appears when its finalize functions have run."""
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / MODEL_SUBDIR).mkdir(parents=True)
        save_hf_config(hf_config, hf_source_dir, tmp / HF_CONFIG_SUBDIR)
    _barrier()
    use_local_results_queue(tmp)
    request = dist_checkpointing.save(
        model.sharded_state_dict(),
        str(tmp / MODEL_SUBDIR),
        sharded_strategy=sharded_strategy,
        async_sharded_save=async_save,
    )

    def publish() -> None:
        _barrier()
        if rank0:
            _replace_dir(tmp, ckpt_dir)
        _barrier()
        logger.info("saved model checkpoint %s", ckpt_dir)

    if request is None:
        publish()
        return None
    request.add_finalize_fn(publish)
    return request


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


class _FileResultsQueue:
    """The one result of one writer, passed through a file instead of a queue.

    megatron-core 0.16.1's filesystem writer passes its write results through a queue held
    by a spawned multiprocessing Manager (``filesystem_async._get_write_results_queue``,
    created at the first save). That helper sits in the trainer's process group: a SIGTERM to
    the group (scancel, preemption, Slurm's time limit) killed it with the trainer, and the
    save that the signal asked for then failed with BrokenPipeError, leaving a ``.tmp``; a
    SIGKILLed trainer left it behind (~330 MB). The queue is written once (by the writer: in
    this process for a synchronous save, in the forked writer process of an async one) and
    read once by ``retrieve_write_results`` in this process (``get_nowait``). A file does that
    with no other process and, unlike a pipe, never blocks the writer on a full buffer while
    the trainer waits for it to exit (megatron checks that the writer process has ended before
    it reads). One queue per save: two async saves in flight must not swap results."""

    def __init__(self, directory: Path) -> None:
        # In the save's own .tmp directory, not the temporary directory: a killed trainer's
        # results file goes with the .tmp it belongs to (removed by the next save or start).
        fd, name = tempfile.mkstemp(prefix=".write_results_", suffix=".pkl", dir=directory)
        os.close(fd)
        os.unlink(name)
        self.path = Path(name)
        self.owner = os.getpid()  # forked writers hold a copy: only the creator cleans up

    def put(self, item) -> None:
        part = self.path.with_name(self.path.name + ".part")
        with open(part, "wb") as f:
            pickle.dump(item, f)
        os.replace(part, self.path)

    def get_nowait(self):
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise queue.Empty from None
        self.path.unlink(missing_ok=True)
        return pickle.loads(data)

    def get(self, block: bool = True, timeout: float | None = None):
        return self.get_nowait()

    def __del__(self) -> None:  # the result of an abandoned save
        if os.getpid() == self.owner:
            self.path.unlink(missing_ok=True)


def use_local_results_queue(directory: Path) -> None:
    """A fresh results queue for the next megatron writer (see :class:`_FileResultsQueue`),
    its file in ``directory`` (the save's partial directory, beside the dist checkpoint it
    writes, not in it); called before every ``dist_checkpointing.save``."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    directory.mkdir(parents=True, exist_ok=True)
    filesystem_async._results_queue = _FileResultsQueue(directory)


# Signals a job sends to all of its processes: the forked writer of an async save ignores
# them (it finishes its write; the trainer decides what happens to the save).
_JOB_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
_PR_SET_PDEATHSIG = 1


def combined(requests: list[AsyncRequest]) -> AsyncRequest:
    """One request that stages every part of ``requests`` (in this process, when scheduled)
    and writes them one after the other in a single forked writer; their finalize functions
    run in order. Forking the trainer is not free (0.7 s per fork for a 1.5 GB process on the
    2-core test machine): one fork per checkpoint, not one per part."""
    parts = [r for r in requests if r.async_fn is not None]

    def stage() -> list:
        staged = []
        for part in parts:
            args = list(part.async_fn_args)
            if part.preload_fn is not None:
                args[1] = part.preload_fn()  # megatron's convention: the write buckets
            staged.append((part.async_fn, tuple(args), dict(part.async_fn_kwargs)))
        return staged

    finalize_fns = [fn for request in requests for fn in request.finalize_fns]
    if not parts:  # nothing to write on this rank (e.g. a data-parallel replica): no fork
        return AsyncRequest(None, (), finalize_fns)
    return AsyncRequest(_write_parts, (None, [], None), finalize_fns, preload_fn=stage)


def _write_parts(_unused, staged: list, _unused_too) -> None:
    for write, args, kwargs in staged:
        write(*args, **kwargs)


def shielded(request: AsyncRequest) -> AsyncRequest:
    """``request`` whose writer, in the process megatron forks for it, ignores the job's
    signals and dies with the trainer (Linux ``PR_SET_PDEATHSIG``): a SIGTERM to the process
    group must not kill the write of the save in flight (the trainer finalizes it, then saves
    on the signal), and a SIGKILLed trainer must not leave a writer filling its ``.tmp``."""
    if request.async_fn is None:
        return request
    writer = functools.partial(_shielded_write, os.getpid(), request.async_fn)
    return request._replace(async_fn=writer)


def _shielded_write(trainer: int, write, *args, **kwargs) -> None:
    try:
        for name in _JOB_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    except ValueError:  # not forked from the main thread: the trainer's handlers stay
        pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the writer may outlive a killed trainer
        pass
    if os.getppid() != trainer:  # the trainer died before prctl
        os._exit(1)
    write(*args, **kwargs)


def load_hf_config(ckpt_dir: str | Path) -> transformers.PretrainedConfig:
    path = Path(ckpt_dir) / HF_CONFIG_SUBDIR
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{ckpt_dir}: not a megatron_rl model checkpoint (no {HF_CONFIG_SUBDIR}/config.json)"
        )
    from megatron_rl.models.hf_config import load_hf_config as read

    return read(path)


def load_model(model, ckpt_dir: str | Path) -> None:
    """Load a dist checkpoint into ``model`` (any parallel layout; all ranks call this)."""
    state = _load(model.sharded_state_dict(), ckpt_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"{ckpt_dir}: checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def load_materialized(model, ckpt_dir: str | Path) -> None:
    """Load only the parameters of ``model`` that have storage, skipping those on the meta
    device: one layer at a time of a model built with ``build_model(..., meta=True)`` (dist
    checkpoints read just the tensors asked for)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace,
        extract_matching_values,
    )
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
    )

    def wanted(value) -> bool:
        return isinstance(value, (ShardedTensor, ShardedTensorFactory)) and not value.data.is_meta

    sharded, _ = extract_matching_values(model.sharded_state_dict(), wanted)
    factories, _ = extract_matching_values(sharded, lambda v: isinstance(v, ShardedTensorFactory))
    apply_factories(sharded)
    sharded = dict_list_map_inplace(_explicit_layer_axes, sharded)
    # a subset of a tensor's shards: megatron's access check wants them all
    state = _load(sharded, ckpt_dir, validate_access_integrity=False)
    state = apply_factory_merges(state, factories)
    params = model.state_dict(keep_vars=True)
    state = {key: value.reshape(params[key].shape) for key, value in state.items()}
    _, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(
            f"{ckpt_dir}: checkpoint does not fit the model: unexpected {unexpected[:5]}"
        )


def _explicit_layer_axes(sh_ten):
    """The same shard with megatron's prepended (stacked-layer) axes as real size-1 axes.

    torch.distributed.checkpoint then reads it as one chunk of the stored tensor; with the
    prepended-axis form it expects this rank to hold all of the tensor's fragments (one rank,
    but a subset of the layers)."""
    import dataclasses

    n = sh_ten.prepend_axis_num
    if not n or sh_ten.flattened_range is not None:
        return sh_ten
    return dataclasses.replace(
        sh_ten,
        data=sh_ten.data.view((1,) * n + tuple(sh_ten.data.shape)),
        local_shape=(1,) * n + tuple(sh_ten.local_shape),
        prepend_axis_num=0,
    )


# Keys a checkpoint may hold under an older name: (current, legacy) parts of a key. Before
# models.specs kept TE's name for it, the local layer spec (every CPU run, every hf-to-mcore
# conversion) saved the norm before a MoE layer as mlp.linear_fc1.layer_norm_weight; TE's
# spec (GPU runs) saves and asks for pre_mlp_layernorm.weight.
LEGACY_KEYS = (("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),)


def with_legacy_keys(sharded_state_dict: dict, checkpoint_dir: str | Path) -> dict:
    """``sharded_state_dict`` (in place, and returned) with each tensor the dist checkpoint in
    ``checkpoint_dir`` lacks asked for under its legacy name (:data:`LEGACY_KEYS`) where the
    checkpoint has that one. The one place where old checkpoint names are read."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    stored = set(dist_checkpointing.load_tensors_metadata(str(checkpoint_dir)))

    def rename(value):
        if isinstance(value, ShardedTensor) and value.key not in stored:
            for current, legacy in LEGACY_KEYS:
                old = value.key.replace(current, legacy)
                if old != value.key and old in stored:
                    value.key = old
                    break
        return value

    dict_list_map_inplace(rename, sharded_state_dict)
    return sharded_state_dict


def _load(sharded_state_dict: dict, ckpt_dir: str | Path, **kwargs) -> dict:
    path = Path(ckpt_dir) / MODEL_SUBDIR
    if not path.is_dir():
        raise ValueError(f"{ckpt_dir}: no '{MODEL_SUBDIR}/' dist checkpoint inside")
    try:
        with_legacy_keys(sharded_state_dict, path)
        return dist_checkpointing.load(sharded_state_dict, str(path), **kwargs)
    # torch.distributed.checkpoint wraps the cause in a rank-keyed CheckpointException, which
    # derives from BaseException (not Exception).
    except (Exception, CheckpointException) as err:
        fit = ("mismatch", "missing key", "unexpected key")
        lines = [ln.strip() for ln in str(err).splitlines() if any(w in ln.lower() for w in fit)]
        if lines:
            raise ValueError(f"{ckpt_dir}: checkpoint does not fit the model: {lines[-1]}") from err
        # Not a layout question: a file that is missing, truncated or unreadable.
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{ckpt_dir}: cannot read the checkpoint (damaged or incomplete files): "
            f"{type(err).__name__}: {first}"
        ) from err


def _barrier() -> None:
    from megatron_rl.platform import collectives

    collectives.barrier()
