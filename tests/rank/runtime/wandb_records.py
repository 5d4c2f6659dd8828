"""Reading W&B's offline record (``run-ID.wandb``) for the tests: what W&B would upload, record by record.

wandb 0.31 reads and writes it in its Go core only, so this follows the documented LevelDB log layout that the
file uses: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a CRC32C
(4 bytes), a length (2) and a type (1: full, 2: first, 3: middle, 4: last); a chunk never crosses a block and a
block's tail shorter than a chunk header is padding. The payloads are W&B's ``Record`` protobuf messages.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


@dataclass
class OfflineRun:
    run_id: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)


def payloads(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B offline record")
    records: list[bytes] = []
    pending = b""
    offset = _HEADER
    while offset + _HEADER <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _HEADER:
            offset += left_in_block
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        chunk = data[offset + _HEADER: offset + _HEADER + length]
        offset += _HEADER + length
        if kind == 0 and length == 0:
            continue  # zero padding
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def read_offline_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2

    run = OfflineRun()
    for payload in payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id = record.run.run_id
        elif kind == "history":
            run.history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
    return run
