"""Checkpoints of a run: model, optimizer and loop state, written atomically.

Layout under ``RUN_DIR/checkpoints``::

    step_00000100/
        model/                 megatron_rl.conversion.checkpoint.save_model output
                               (model/ dist checkpoint + hf_config/): loads into any
                               TP/PP/EP layout and converts to HF as is
        optimizer/             the megatron optimizer's sharded state (dist checkpoint):
                               loads into any TP/PP/EP/DP layout too
        state/loop.pt          the loop state (``extra``: sampler, scheduler, ...), rank 0's
        state/rng_00000.pt     per rank: RNG states
        config.yaml            the resolved config the run was trained with up to this step
                               (``config_text``; a resume compares its recipe with it)
        manifest.json          size of every file (and SHA-256 of those up to 16 MiB)
        meta.json              step, world size; written last inside the directory
    latest                     name of the newest checkpoint (for people and tools)

Everything is written into ``step_XXXXXXXX.tmp`` and renamed into place only when complete,
then the ``latest`` pointer is replaced, then old checkpoints are pruned; a crash at any
point leaves the previous checkpoint complete and found by ``latest()``. All ranks call
``save`` and ``load`` (collectively).

Asynchronous saves (``async_save``, the recipe's ``checkpoint.async_save``): ``save`` plans
the write, stages the tensors off the live parameters (megatron copies GPU tensors to host
memory; the forked writer's copy-on-write memory is the snapshot of host tensors), writes the
small loop and RNG state, forks megatron's writer and returns; training goes on while it
writes. ``finalize`` (every rank, once per step: it runs a collective while a save is in
flight) completes the save when its write is done everywhere: megatron's finalize functions
(``.metadata``), then the manifest, ``meta.json``, the rename of the ``.tmp``, ``latest`` and
the pruning. So ``keep_last`` complete checkpoints plus the one in flight are on disk, and the
newest complete one is never pruned before its successor is complete. At most one save is in
flight: the next ``save`` waits for the previous one first (``finalize(blocking=True)``), as
does a synchronous one (the save on a signal: its write cannot outlive the job). The writer
ignores the job's signals and dies with its trainer; a save in flight when the trainer dies
(a crash, a hang that exits 75) is lost, and the run resumes from the one before.

A run may resume with another world size or parallel layout: model and optimizer reshard;
the RNG states are then not restored (they are per rank).

A checkpoint counts only if it verifies against its manifest (a truncated shard, a lost
``.metadata`` or loop state): a damaged newest one is skipped with a warning that names it,
and the run resumes from the newest intact one. A checkpoint of format 3 on without its
manifest cannot be verified and is skipped too; one of format 2 (written before manifests
existed) is checked by its tensor shards' own dist-checkpoint metadata. Before a save, the free space is compared
with the size of the previous checkpoint; a save that runs out of space says so in words
(the disk, the bytes needed and free) and removes its partial ``.tmp``: a full disk is told
by the error, or, when the error does not say (torch's ``basic_ios::clear: iostream error``),
by the free space left after it. A save abandoned on an error (the run failed while it was
in flight) has its ``.tmp`` removed too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.conversion import checkpoint as model_checkpoint
from megatron_rl.platform import get_platform

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
CHECKSUM_MAX_BYTES = 16 * 2**20  # larger files (tensor shards) are checked by size only
# 3: every checkpoint has a manifest.json (meta.json's format says so); 2: written before
# manifests existed, or by a version that did not say so in meta.json
FORMAT_VERSION = 3
MANIFEST_SINCE_FORMAT = 3
OPTIMIZER_SUBDIR = "optimizer"
LOOP_STATE = "loop.pt"
CONFIG_FILE = "config.yaml"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python, numpy, torch (CPU, CUDA) and megatron's model-parallel tracker,
    as data ``torch.load(weights_only=True)`` accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if get_platform().is_gpu:
        state["cuda"] = torch.cuda.get_rng_state_all()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker().get_states()
    if tracker:
        state["megatron_tracker"] = {k: v.clone() for k, v in tracker.items()}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and get_platform().is_gpu:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "megatron_tracker" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(
            {k: v.clone() for k, v in state["megatron_tracker"].items()}
        )


@dataclass(frozen=True)
class _InFlight:
    """An async save that was scheduled and is not complete yet."""

    step: int
    final: Path
    tmp: Path
    started: float  # time.perf_counter() when its writer was started
    on_complete: Callable[[Path], None] | None


@dataclass
class Checkpoint:
    """What ``CheckpointManager.load`` returns (the model is loaded in place)."""

    step: int
    path: Path
    extra: dict[str, Any]


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    from megatron_rl.platform import collectives

    collectives.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_state(payload: dict[str, Any], path: Path) -> None:
    """torch.save to a temporary name, fsync, rename (no half-written file under ``path``)."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _write_text(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


class CheckpointManager:
    """Saves, finds, loads and prunes the checkpoints of one run directory.

    Args:
        run_dir: the run directory; checkpoints go to ``run_dir/checkpoints``.
        keep_last: complete checkpoints kept after each successful save.
        hf_config: HF config written next to the model (default: the model's
            ``architecture.text_config``, set by ``megatron_rl.models.provider.build_model``).
        hf_source_dir: directory whose tokenizer files are copied next to the model.
        async_save: write model and optimizer in the background (see the module docstring);
            ``save`` may override it per call.
        config_text: the run's resolved config (YAML), written into every checkpoint as
            ``config.yaml`` by rank 0 (None: none written).
    """

    def __init__(
        self,
        run_dir: str | Path,
        keep_last: int = 2,
        hf_config: Any = None,
        hf_source_dir: str | Path | None = None,
        async_save: bool = False,
        config_text: str | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.keep_last = keep_last
        self.hf_config = hf_config
        self.hf_source_dir = hf_source_dir
        self.async_save = async_save
        self.config_text = config_text
        self._warned: set[Path] = set()  # damaged checkpoints already reported
        self._calls = None  # megatron's AsyncCallsQueue, made at the first async save
        self._in_flight: _InFlight | None = None
        self.blocked_seconds: float | None = None  # how long the last ``save`` blocked

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def save(
        self,
        step: int,
        model: Any,
        extra: dict[str, Any] | None = None,
        optimizer: Any = None,
        async_save: bool | None = None,
        on_complete: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` (all ranks call this) and return its directory.

        ``extra`` is the loop state (sampler, pass-rate tracker, scheduler, compute clock,
        metrics position ...) as plain data and tensors; rank 0's is kept. ``optimizer`` is
        the megatron optimizer of ``model`` (saved sharded); RNG states are added here.
        ``async_save`` (default: the manager's): return once the write has started; the
        directory exists once ``finalize`` has completed it. A save in flight is completed
        first. ``on_complete(path)`` runs on this rank once the checkpoint is complete
        (before ``save`` returns, or in the ``finalize`` that completes it; never for a save
        that fails or is abandoned): what needs the checkpoint on disk, e.g. an HF export.
        """
        started = time.perf_counter()
        self.finalize(blocking=True)
        rank, world = _rank_world()
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        background = self.async_save if async_save is None else async_save
        from megatron_rl.platform import collectives

        refused = self._check_space(step) if rank == 0 else None
        refused = collectives.broadcast_object(refused)
        if refused:  # every rank raises: the save is collective
            raise OSError(errno.ENOSPC, refused)
        try:
            if background:
                self._write_async(step, model, extra, optimizer, tmp, final, rank, world)
                self._in_flight = _InFlight(step, final, tmp, time.perf_counter(), on_complete)
            else:
                self._write(step, model, extra, optimizer, tmp, final, rank, world)
        except BaseException as err:
            failure = self._failed(err, final, tmp, rank)
            if failure is err:
                raise
            raise failure from err
        self.blocked_seconds = time.perf_counter() - started
        if background:
            logger.info(
                "checkpoint %s: writing in the background (the loop waited %.2f s)",
                final,
                self.blocked_seconds,
            )
        else:
            logger.info("saved checkpoint %s in %.2f s", final, self.blocked_seconds)
            if on_complete is not None:
                on_complete(final)
        return final

    def _failed(self, err: BaseException, final: Path, tmp: Path, rank: int) -> BaseException:
        """What a save that raised ``err`` raises: ``err`` itself, or for a full disk an
        OSError that says so in words, naming the disk and the bytes needed (its partial
        ``.tmp`` removed). A full disk is recognised by the error (ENOSPC, EDQUOT, wrapped
        or not) or, when the error does not say (torch's writer of ``common.pt`` and of the
        loop state raises ``RuntimeError: basic_ios::clear: iostream error``), by the free
        space left: less than the rest of the checkpoint needs."""
        from megatron_rl.trainer.disk import describe

        code = _disk_full(err)
        written = _tree_bytes(tmp) if tmp.is_dir() else 0
        complete = self.checkpoints()
        need = _tree_bytes(complete[-1]) if complete else None
        try:
            free = _free_bytes(self.root)
        except OSError:
            free = None
        if code is None and free is not None and _out_of_space(free, need, written):
            code = errno.ENOSPC
        if code is None:
            return err
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        needed = (
            f"it needs about {need} bytes (the size of {complete[-1].name})"
            if need is not None
            else f"it needs more than the {written} bytes written before it failed"
        )
        free_now = "free space unknown" if free is None else f"{free} bytes were free"
        return OSError(
            code,
            f"{os.strerror(code)} while writing checkpoint {final.name} under {self.root} "
            f"on {describe(self.root)}: {needed}, {free_now} ({_gb(free or 0)} GB; the write "
            f"failed with {type(err).__name__}: {err}). Its partial {tmp.name} "
            f"({written} bytes) was removed; the newest complete checkpoint is "
            f"{complete[-1].name if complete else 'none'}. Free space there, then resume",
        )

    def _write(self, step, model, extra, optimizer, tmp: Path, final: Path, rank, world) -> None:
        self._begin(tmp, rank)
        hf_config = self.hf_config or model.architecture.text_config
        model_checkpoint.save_model(model, tmp / "model", hf_config, self.hf_source_dir)
        if optimizer is not None:
            from megatron_rl.trainer.optim import save_optimizer

            save_optimizer(optimizer, model, tmp / OPTIMIZER_SUBDIR)
        self._write_states(step, extra, tmp, rank)
        self._complete(tmp, final, step, world, optimizer is not None)

    def _write_async(self, step, model, extra, optimizer, tmp, final, rank, world) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._begin(tmp, rank)
        hf_config = self.hf_config or model.architecture.text_config
        requests = [
            model_checkpoint.save_model(
                model, tmp / "model", hf_config, self.hf_source_dir, async_save=True
            )
        ]
        if optimizer is not None:
            from megatron_rl.trainer.optim import save_optimizer

            requests.append(
                save_optimizer(optimizer, model, tmp / OPTIMIZER_SUBDIR, async_save=True)
            )
        self._write_states(step, extra, tmp, rank)
        request = model_checkpoint.shielded(model_checkpoint.combined(requests))
        # megatron's finalize functions (.metadata of each part) first, then ours
        request.add_finalize_fn(
            lambda: self._complete(tmp, final, step, world, optimizer is not None)
        )
        if self._calls is None:
            self._calls = AsyncCallsQueue(persistent=False)  # a forked writer per save
        self._calls.schedule_async_request(request)

    def _begin(self, tmp: Path, rank: int) -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "state").mkdir(parents=True)
        _barrier()

    def _write_states(self, step: int, extra, tmp: Path, rank: int) -> None:
        if rank == 0:
            _write_state({"step": step, "extra": dict(extra or {})}, tmp / "state" / LOOP_STATE)
            if self.config_text is not None:
                _write_text(tmp / CONFIG_FILE, self.config_text)
        _write_state(capture_rng_state(), tmp / "state" / f"rng_{rank:05d}.pt")

    def _complete(self, tmp: Path, final: Path, step: int, world: int, optimizer: bool) -> None:
        """Every part is written on every rank: publish (rank 0)."""
        _barrier()
        if _rank_world()[0] == 0:
            self._publish(tmp, final, step, world, optimizer)
        _barrier()

    @property
    def in_flight(self) -> int | None:
        """The step of the async save being written, or None."""
        return self._in_flight.step if self._in_flight is not None else None

    def finalize(self, blocking: bool = False) -> Path | None:
        """Complete the async save in flight if its write is done on every rank (or, with
        ``blocking``, once it is) and return its directory; None if nothing completed.
        Collective while a save is in flight: every rank calls it at the same point."""
        pending = self._in_flight
        if pending is None:
            return None
        try:
            self._calls.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as err:
            failure = self._failed(err, pending.final, pending.tmp, _rank_world()[0])
            self.abandon(keep_complete=False)
            if failure is err:
                raise
            raise failure from err
        if self._calls.get_num_unfinalized_calls():
            return None
        self._in_flight = None
        logger.info(
            "saved checkpoint %s (written in the background in %.1f s)",
            pending.final,
            time.perf_counter() - pending.started,
        )
        if pending.on_complete is not None:
            pending.on_complete(pending.final)
        return pending.final

    def abandon(self, keep_complete: bool = True) -> None:
        """Stop the writers of the save in flight without completing it (no collective: for
        error paths) and remove its ``.tmp`` (rank 0); the newest complete checkpoint is
        untouched. ``keep_complete``: on a single rank (no other rank to agree with), a save
        whose write is done is completed instead (a second Ctrl-C or an error in the step
        after it must not discard a checkpoint that is whole on disk)."""
        if self._in_flight is None:
            return
        if keep_complete and _rank_world()[1] == 1:
            try:
                self.finalize()  # completes it if its write is done; else leaves it in flight
            except Exception as err:  # its write failed: abandoned by finalize
                logger.warning("the checkpoint in flight could not be completed: %s", err)
            if self._in_flight is None:
                return
        tmp = self._in_flight.tmp
        while self._calls.async_calls:
            self._calls.async_calls.popleft().async_caller.close(abort=True)
        self._in_flight = None
        # Its writer is stopped: the partial directory is of no use, and on a full disk (a
        # writer that ran out of space, seen first by another write) it holds the space.
        if _rank_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.warning("abandoned the checkpoint in flight: its partial %s was removed", tmp)

    def _check_space(self, step: int) -> str | None:
        """Why checkpoint ``step`` cannot fit on the disk (None: it should). The estimate is
        the newest checkpoint's size; a disk that holds the new one but not ``keep_last + 1``
        of them gets a warning (the save after next will not fit once pruning stops)."""
        complete = self.checkpoints()
        if not complete:
            return None
        need = _tree_bytes(complete[-1])
        self.root.mkdir(parents=True, exist_ok=True)
        free = _free_bytes(self.root)
        if free < need * 1.05:
            return (
                f"No space left for checkpoint step_{step:08d}: it needs about {_gb(need)} GB "
                f"(the size of {complete[-1].name}), {_gb(free)} GB are free under {self.root}. "
                f"Free space there (checkpoint.keep_last={self.keep_last} keeps "
                f"{self.keep_last} complete checkpoints), then resume"
            )
        kept = sum(_tree_bytes(p) for p in complete[-self.keep_last :])
        if free + kept < need * (self.keep_last + 1):
            logger.warning(
                "disk nearly full under %s: %s GB free, checkpoints of ~%s GB each, "
                "checkpoint.keep_last=%d needs room for %d of them (one being written)",
                self.root,
                _gb(free),
                _gb(need),
                self.keep_last,
                self.keep_last + 1,
            )
        return None

    def _publish(self, tmp: Path, final: Path, step: int, world: int, optimizer: bool) -> None:
        meta = {"step": step, "world_size": world, "format": FORMAT_VERSION, "optimizer": optimizer}
        _write_text(tmp / MANIFEST_FILE, json.dumps(_manifest(tmp)) + "\n")
        _write_text(tmp / META_FILE, json.dumps(meta) + "\n")
        _fsync_dir(tmp / "state")
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. on a signal right after resume)
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
        _fsync_dir(self.root)
        _write_text(self.root / LATEST_FILE, final.name + "\n")
        self._prune()

    def _prune(self) -> None:
        complete = self.checkpoints()
        for path in complete[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        oldest_kept = step_of(complete[-self.keep_last :][0])
        for path in self.root.glob("step_*"):
            if path.is_dir() and not _STEP_DIR.match(path.name):
                shutil.rmtree(path, ignore_errors=True)  # leftovers of interrupted saves
            elif path.is_dir() and path not in complete and step_of(path) < oldest_kept:
                shutil.rmtree(path, ignore_errors=True)  # damaged, and older than every kept one

    def is_complete(self, path: Path) -> bool:
        """A checkpoint directory that was fully written and verifies (see ``damage``)."""
        return self.damage(path) is None

    def damage(self, path: Path) -> str | None:
        """What is wrong with checkpoint directory ``path`` (None: it is intact): a missing
        ``meta.json`` or part, or a file whose size or checksum differs from the manifest
        written at save (a truncated shard, a lost ``.metadata``)."""
        if not _STEP_DIR.match(path.name):
            return "not a checkpoint directory name"
        if not (path / META_FILE).is_file():
            return f"no {META_FILE} (the save did not finish, or the file was lost)"
        try:
            meta = json.loads((path / META_FILE).read_text())
            world, optimizer = meta["world_size"], meta["optimizer"]
        except (OSError, ValueError, KeyError) as err:
            return f"unreadable {META_FILE} ({type(err).__name__}: {err})"
        parts = [path / "model" / model_checkpoint.MODEL_SUBDIR, path / "state" / LOOP_STATE]
        parts += [path / "state" / f"rng_{r:05d}.pt" for r in range(world)]
        if optimizer:
            parts.append(path / OPTIMIZER_SUBDIR)
        missing = [str(p.relative_to(path)) for p in parts if not p.exists()]
        if missing:
            return f"missing {', '.join(missing[:3])}"
        if not (path / MANIFEST_FILE).is_file():
            if meta.get("format", 0) >= MANIFEST_SINCE_FORMAT:
                return f"no {MANIFEST_FILE} (lost): its files cannot be verified"
            # Format 2: written before manifests existed (or its manifest was lost, which
            # format 2 cannot tell): the tensor shards are checked against the byte ranges
            # their own dist-checkpoint metadata records.
            dcp_dirs = [path / "model" / model_checkpoint.MODEL_SUBDIR]
            dcp_dirs += [path / OPTIMIZER_SUBDIR] if optimizer else []
            for dcp_dir in dcp_dirs:
                why = _shards_damage(dcp_dir)
                if why is not None:
                    return f"no {MANIFEST_FILE} (format 2), and {why}"
            return None
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())["files"]
        except (OSError, ValueError, KeyError) as err:
            return f"unreadable {MANIFEST_FILE} ({type(err).__name__}: {err})"
        return _verify(path, manifest)

    def checkpoints(self) -> list[Path]:
        """Intact checkpoints, oldest first (damaged ones are skipped with a warning)."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            if not (p.is_dir() and _STEP_DIR.match(p.name)):
                continue  # .tmp / .old: leftovers of interrupted saves
            why = self.damage(p)
            if why is None:
                found.append(p)
            elif p not in self._warned:
                self._warned.add(p)
                logger.warning("checkpoint %s is damaged and skipped: %s", p, why)
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        """The newest intact checkpoint, or None."""
        complete = self.checkpoints()
        return complete[-1] if complete else None

    def load(
        self,
        model: Any = None,
        path: str | Path | None = None,
        optimizer: Any = None,
        restore_rng: bool = True,
    ) -> Checkpoint | None:
        """Load checkpoint ``path`` (default: ``latest()``) into ``model`` and its megatron
        ``optimizer`` (all ranks call this, in any parallel layout); returns the loop state, or
        None if there is no checkpoint. RNG states are restored unless ``restore_rng`` is
        False or the checkpoint was written by another number of ranks."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            return None
        why = self.damage(path)
        if why is not None:
            raise ValueError(f"{path}: not a complete checkpoint (damaged: {why})")
        rank, world = _rank_world()
        meta = json.loads((path / META_FILE).read_text())
        if model is not None:
            model_checkpoint.load_model(model, path / "model")
        if optimizer is not None:
            if not meta["optimizer"]:
                raise ValueError(f"{path}: saved without optimizer state")
            from megatron_rl.trainer.optim import load_optimizer

            load_optimizer(optimizer, model, path / OPTIMIZER_SUBDIR)
        loop = torch.load(path / "state" / LOOP_STATE, map_location="cpu", weights_only=True)
        if restore_rng and meta["world_size"] == world:
            rng = path / "state" / f"rng_{rank:05d}.pt"
            restore_rng_state(torch.load(rng, map_location="cpu", weights_only=True))
        elif restore_rng:
            logger.warning(
                "%s: written by %d ranks, this run has %d: RNG states not restored",
                path,
                meta["world_size"],
                world,
            )
        logger.info("loaded checkpoint %s (step %d)", path, loop["step"])
        return Checkpoint(loop["step"], path, loop["extra"])


def is_step_dir(path: Path) -> bool:
    """A published checkpoint's directory name (``step_N``; not a ``.tmp`` or ``.old``)."""
    return path.is_dir() and _STEP_DIR.match(path.name) is not None


def step_of(path: Path) -> int:
    """The step of checkpoint directory ``path`` (``step_N``)."""
    return int(_STEP_DIR.match(path.name).group(1))


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(root: Path) -> dict[str, Any]:
    """Size of every file under ``root`` (SHA-256 too, up to ``CHECKSUM_MAX_BYTES``)."""
    files = {}
    for path in _files(root):
        size = path.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= CHECKSUM_MAX_BYTES:
            entry["sha256"] = _sha256(path)
        files[str(path.relative_to(root))] = entry
    return {"files": files}


def _verify(root: Path, manifest: dict[str, dict[str, Any]]) -> str | None:
    for name, entry in manifest.items():
        path = root / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} were written (truncated?)"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{name} differs from what was written (checksum mismatch)"
    return None


def _shards_damage(dcp_dir: Path) -> str | None:
    """What is wrong with the shard files of the dist checkpoint ``dcp_dir`` by its own
    ``.metadata`` (the byte range of every tensor piece): unreadable metadata, a missing or
    short shard. None: every recorded range is there."""
    from torch.distributed.checkpoint import FileSystemReader

    where = dcp_dir.name
    try:
        metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    except Exception as err:  # a truncated or lost .metadata: any unpickling error
        return f"{where}/.metadata is unreadable ({type(err).__name__}: {err})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = (dcp_dir / name).stat().st_size
        except FileNotFoundError:
            return f"{where}/{name} is missing"
        if size < end:
            return f"{where}/{name} has {size} bytes, its metadata records {end} (truncated?)"
    return None


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in _files(root))


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (a function of its own: tests replace it)."""
    return shutil.disk_usage(path).free


_MIN_FREE_BYTES = 1 << 20  # below this, a disk counts as full whatever the checkpoint's size


def _out_of_space(free: int, need: int | None, written: int) -> bool:
    """Whether ``free`` bytes cannot hold the rest of a checkpoint of about ``need`` bytes
    (None: unknown, the first one) of which ``written`` were written."""
    rest = need - written if need is not None else 0
    return free < max(rest, _MIN_FREE_BYTES)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}"


_DISK_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


def _disk_full(err: BaseException) -> int | None:
    """ENOSPC / EDQUOT if that is what ``err`` is, or wraps (megatron's writer re-raises its
    workers' errors as RuntimeError, torch's as CheckpointException), else None."""
    seen: set[int] = set()
    todo: list[Any] = [err]
    while todo:
        exc = todo.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return exc.errno
        todo += [exc.__cause__, exc.__context__]
        failures = getattr(exc, "failures", None)  # CheckpointException: rank -> exception
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    text = str(err)
    for code, words in _DISK_FULL.items():
        if words in text or f"[Errno {code}]" in text:
            return code
    return None
