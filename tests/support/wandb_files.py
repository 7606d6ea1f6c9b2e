"""Reads W&B offline run files (``run-<id>.wandb``) back, for the tracking tests.

A ``.wandb`` file is a LevelDB log (32 KiB blocks of chunks, each with a CRC-32, a length and
a type: FULL, or FIRST / MIDDLE / LAST pieces of one record) after a 7-byte header
(``:W&B``, magic 0xBEE1, version 0), and each record is a ``wandb.proto`` ``Record``. wandb
0.31 reads these files only in its Go service (``core/internal/transactionlog``); its Python
reader (``wandb/sdk/internal/datastore.py``, which this follows, CRC included) is gone. The
records are decoded with wandb's own protobuf classes, and every chunk's CRC is checked, so
a misread file fails here instead of passing by accident.
"""

from __future__ import annotations

import glob
import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
# wandb seeds each chunk's CRC-32 with the CRC of its type byte (datastore.py: self._crc)
_TYPE_CRC = {t: zlib.crc32(bytes([t])) & 0xFFFFFFFF for t in (FULL, FIRST, MIDDLE, LAST)}


def read_records(path: str | Path) -> list[Any]:
    """Every ``wandb_internal_pb2.Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (path, ident, magic, version)
    out, pos, parts = [], HEADER.size, None
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding (a writer's last, partial block)
            pos += BLOCK - pos % BLOCK
            continue
        chunk = data[pos + CHUNK.size : pos + CHUNK.size + length]
        pos += CHUNK.size + length
        assert len(chunk) == length, f"{path}: truncated chunk at {pos}"
        assert zlib.crc32(chunk, _TYPE_CRC[kind]) & 0xFFFFFFFF == crc, f"{path}: bad CRC"
        if kind == FULL:
            parts = [chunk]
        elif kind == FIRST:
            parts = [chunk]
            continue
        else:
            assert parts is not None, f"{path}: chunk of type {kind} without a FIRST"
            parts.append(chunk)
            if kind == MIDDLE:
                continue
        record = pb.Record()
        record.ParseFromString(b"".join(parts))
        out.append(record)
        parts = None
    return out


@dataclass
class OfflineRun:
    """One offline run directory of W&B (one job's part of a run)."""

    path: Path
    run_id: str
    start: float  # the RunRecord's start time (s)
    branch_point: tuple[str, str, float] | None  # (run, metric, value): a rewind point
    rows: list[dict[str, Any]]  # history rows: {key: value}, "_step" included
    config: dict[str, Any] = field(default_factory=dict)
    metrics: list[Any] = field(default_factory=list)  # MetricRecords (define_metric)
    finished: bool = False  # an exit record was written


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_offline_run(run_dir: str | Path) -> OfflineRun:
    """The records of one ``offline-run-*`` directory's ``.wandb`` file."""
    (path,) = glob.glob(str(Path(run_dir) / "*.wandb"))
    run_id, start, branch, rows, config, metrics, finished = "", 0.0, None, [], {}, [], False
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            start = record.run.start_time.ToMicroseconds() / 1e6
            bp = record.run.branch_point
            branch = (bp.run, bp.metric, bp.value) if bp.run else None
            config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            rows.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "metric":
            metrics.append(record.metric)
        elif kind == "exit":
            finished = True
    return OfflineRun(Path(run_dir), run_id, start, branch, rows, config, metrics, finished)


def offline_runs(run_dir: str | Path) -> list[OfflineRun]:
    """Every offline run of a run directory (``RUN_DIR/wandb/offline-run-*``), oldest first:
    the order in which ``wandb sync`` uploads the parts of one run."""
    dirs = sorted(glob.glob(str(Path(run_dir) / "wandb" / "offline-run-*")))
    return sorted((read_offline_run(d) for d in dirs), key=lambda r: r.start)


def merged_history(parts: list[OfflineRun]) -> list[dict[str, Any]]:
    """The history of the W&B run the parts make once synced in order: a part with a rewind
    point (``resume_from``: branch point on ``_step``) first drops every row after it."""
    rows: list[dict[str, Any]] = []
    for part in parts:
        if part.branch_point is not None:
            run, metric, value = part.branch_point
            assert run == part.run_id and metric == "_step", part.branch_point
            rows = [r for r in rows if r["_step"] <= value]
        rows += part.rows
    return rows
