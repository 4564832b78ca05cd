"""Read back the history of an offline W&B run from its `.wandb` transaction log.

W&B ships no reader for offline runs (the Python `DataStore` left with the move to the Go core), so
this is ours. The file is a LevelDB-style record log (as W&B's Go core writes it):

- a 7-byte file header: ident `:W&B`, magic 0xBEE1 (uint16 LE), version 0 (uint8);
- then 32 KiB blocks of chunks, each with a 7-byte header: CRC-32 (uint32 LE), length (uint16 LE),
  type (uint8: 1 full, 2 first, 3 middle, 4 last); a block tail shorter than a chunk header is zero
  padding. The CRC is zlib's CRC-32 of the data, seeded with the CRC-32 of the type byte;
- the chunks of one record join into a serialized `wandb_internal_pb2.Record`.

History records (`Record.history`) hold items with a JSON value under a key path (`nested_key`; a
histogram arrives as `h/_type`, `h/values`, `h/bins`). A row is rebuilt as a nested dict, with W&B's
own `_step`, `_runtime`, `_timestamp`. A run reopened for resume has one segment per opening;
`read_offline_run` merges them (see `rlfw.logging.wandb_sink`).
"""

from __future__ import annotations

import importlib
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FILE_HEADER = struct.Struct("<4sHB")
CHUNK_HEADER = struct.Struct("<IHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
TYPE_CRC = [zlib.crc32(bytes([t])) for t in range(LAST + 1)]


class WandbLogError(ValueError):
    """A `.wandb` file that is not a W&B transaction log or is damaged; the message names the file."""


def _check_file_header(path: Path, data: bytes) -> None:
    if len(data) < FILE_HEADER.size:
        raise WandbLogError(f"{path}: too short for a W&B transaction log header")
    ident, magic, version = FILE_HEADER.unpack_from(data)
    if (ident, magic, version) != (IDENT, MAGIC, VERSION):
        raise WandbLogError(f"{path}: not a W&B transaction log (header {ident!r}, {magic:#x}, {version})")


def scan_chunks(path: Path, data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of every chunk after the file header. A chunk cut short at the end of the file
    (a writer killed mid-record) ends the scan; a CRC mismatch is an error naming the byte offset."""
    pos = FILE_HEADER.size
    while pos + CHUNK_HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER.size:
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0:  # zero fill (a preallocated or padded block): nothing more in this block
            pos += BLOCK - pos % BLOCK
            continue
        payload = data[pos + CHUNK_HEADER.size : pos + CHUNK_HEADER.size + length]
        if len(payload) < length:
            return
        if kind > LAST or zlib.crc32(payload, TYPE_CRC[kind]) != crc:
            raise WandbLogError(f"{path}: corrupt chunk at byte {pos} (type {kind}, CRC mismatch)")
        pos += CHUNK_HEADER.size + length
        yield kind, payload


def scan_records(path: Path) -> Iterator[Any]:
    """Every `wandb_internal_pb2.Record` in one `.wandb` file, in write order."""
    pb: Any = importlib.import_module("wandb.proto.wandb_internal_pb2")  # generated; no type stubs
    data = path.read_bytes()
    _check_file_header(path, data)
    pending = b""
    for kind, payload in scan_chunks(path, data):
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def has_exit_record(path: Path) -> bool:
    """Whether the run's writer has finished `path`: W&B writes the `exit` record last."""
    try:
        return any(record.WhichOneof("record_type") == "exit" for record in scan_records(path))
    except (FileNotFoundError, WandbLogError):
        return False


def history_row(history: Any) -> dict[str, Any]:
    """One `HistoryRecord` as a dict: each item's JSON value placed at its key path."""
    row: dict[str, Any] = {}
    for item in history.item:
        path = list(item.nested_key) or [item.key]
        node = row
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = json.loads(item.value_json)
    return row


def read_segment(path: Path) -> tuple[float, list[dict[str, Any]]]:
    """(start time, history rows) of one `.wandb` file."""
    start, rows = 0.0, []
    for record in scan_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            start = record.run.start_time.seconds + record.run.start_time.nanos * 1e-9
        elif kind == "history":
            rows.append(history_row(record.history))
    return start, rows


def read_offline_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """The history rows of the offline W&B run in `run_dir`, ordered by `_step`.

    Segments (one per opening of the run folder) are merged in start order; a later segment's rows
    replace every earlier row at or after its first step, as a resumed run rewrites those steps.
    """
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if not files:
        raise FileNotFoundError(
            f"no offline W&B run under {run_dir}/wandb (expected offline-run-*/run-*.wandb)"
        )
    merged: list[dict[str, Any]] = []
    for _, rows in sorted((read_segment(f) for f in files), key=lambda seg: seg[0]):
        if rows:
            first = rows[0]["_step"]
            merged = [r for r in merged if r["_step"] < first] + rows
    return sorted(merged, key=lambda r: r["_step"])
