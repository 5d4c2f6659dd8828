"""A node's error records in one file: the ranks a node's agent starts append their failure to
``logs/errors-FIRST-LAST.jsonl`` instead of each writing ``rank-N.error.json``.

Why: after one NCCL fault every rank fails, and at 16,384 ranks one file per rank is 16,384 files created at once
on the shared file system's metadata server, then listed and read by the follower, ``status``, ``logs`` and the
next attempt's look-back. One file per node is 2,048 on 8-GPU nodes, created only on a node where a rank failed.

Who writes, who clears: each rank appends its record as one JSON line in one ``write()`` on an ``O_APPEND``
descriptor (as the node's log: :mod:`hpc_train.run.node_log`), so records of one node's ranks never mix. The
node's agent (:mod:`hpc_train.agent`) empties the file before each life of its ranks starts, so it holds the
current life's records only; at the first life of a requeued attempt it moves it aside to
``prev-errors-FIRST-LAST.jsonl`` for rank 0's look-back (:mod:`hpc_train.run.error_records`). The agent is the
only one that clears, and does so before its ranks run: no rank's record is lost to another's clearing. Ranks
without an agent (the local executor, torchrun, mpirun, ``retry.in_place = 0``) write ``rank-N.error.json`` as
before, and every reader takes both.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpc_train.run.files import MAX_LINE, open_run_path, parse_json, record_lines, small_int
from hpc_train.run.paths import LOGS_DIR

__all__ = ["CONSEQUENCES", "ERRORS", "ERROR_LOG_ENV", "append_error", "error_log_name", "error_log_ranks",
           "error_logs", "kept_error_log_name", "node_error_records", "rank_of_name", "read_error_log", "records_of"]

ERROR_LOG_ENV = "HPC_TRAIN_ERROR_LOG"  # set by a node's agent for its ranks: the file name they append to
ERRORS, CONSEQUENCES = "errors", "consequences"  # a failure; what a rank raised after its attempt had stopped
_NAME = re.compile(r"(prev-)?errors-([0-9]{1,9})-([0-9]{1,9})\.jsonl")
_WRITE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_TRACEBACK_BYTES = 256 << 10  # a record stays well under a line's bound (MAX_LINE): the traceback's end is kept
_MAX_RANKS = 1 << 10  # a name that claims more ranks than a node runs is not a node's error log


def error_log_name(rank: int, per_node: int, kind: str = ERRORS) -> str:
    """``errors-4-7.jsonl``: the error records of the node that holds ``rank`` with ``per_node`` ranks a node
    (``consequences-4-7.jsonl`` with ``kind`` CONSEQUENCES: what its ranks raised after a stop, not failures)."""
    per_node = max(per_node, 1)
    first = rank - rank % per_node
    return f"{kind}-{first}-{first + per_node - 1}.jsonl"


def kept_error_log_name(name: str) -> str:
    return f"prev-{name}"


def error_log_ranks(name: str) -> range | None:
    """The ranks a node's error log holds by its name (kept aside or not); None for any other name."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    first, last = int(m[2]), int(m[3])
    return range(first, last + 1) if first <= last and last - first < _MAX_RANKS else None


def error_logs(names: Iterable[str], kept: bool = False) -> list[str]:
    """The node error logs among ``names`` (a listing of ``logs/``): this life's, or with ``kept`` those moved
    aside for the look-back."""
    return sorted(name for name in names
                  if error_log_ranks(name) is not None and name.startswith("prev-") == kept)


def append_error(run_dir: Path, name: str, record: dict[str, Any]) -> None:
    """Append ``record`` (a rank's failure, with its ``rank``) to the node's error log ``name``, as one line in one
    write; a traceback too long for a line keeps its end, where the error is."""
    text = record.get("traceback")
    if isinstance(text, str) and len(text) > _TRACEBACK_BYTES:
        record = {**record, "traceback": "...\n" + text[-_TRACEBACK_BYTES:]}
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8", errors="replace")
    descriptor = open_run_path(Path(run_dir) / LOGS_DIR / name, _WRITE_FLAGS, 0o600)
    try:
        written = os.write(descriptor, data)
        while written < len(data):
            written += os.write(descriptor, data[written:])
    finally:
        os.close(descriptor)


def records_of(lines: Iterable[str], holds: range | None = None) -> dict[int, dict[str, Any]]:
    """Each rank's newest record among a node error log's lines (a later line of a rank wins); lines that are not
    a record of a rank the file holds are damage and skipped."""
    found: dict[int, dict[str, Any]] = {}
    for line in lines:
        with contextlib.suppress(ValueError, RecursionError):
            record = parse_json(line)
            rank = record.get("rank") if isinstance(record, dict) else None
            if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 and (holds is None or rank in holds):
                found[rank] = record
    return found


def read_error_log(path: str | Path) -> dict[int, dict[str, Any]]:
    """The records of one node error log (never through a link, each line bounded), by rank."""
    holds = error_log_ranks(Path(path).name)
    if holds is None:
        return {}
    return records_of((line for _, line in record_lines(path, MAX_LINE, len(holds) * (MAX_LINE + 1), warn=False)),
                      holds)


def rank_of_name(name: str) -> int | None:
    """The rank of an older one-rank record's name (``rank-N.error.json``), else None."""
    if name.startswith("rank-") and name.endswith(".error.json"):
        return small_int(name[len("rank-"):-len(".error.json")])
    return None


def node_error_records(logs: Path, names: Iterable[str], rank: int | None = None) -> list[dict[str, Any]]:
    """Every record in the node error logs among ``names`` (a listing of ``logs/``, this life's, not those kept
    aside), or only ``rank``'s."""
    found: list[dict[str, Any]] = []
    for name in error_logs(names):
        held = error_log_ranks(name)
        if rank is not None and (held is None or rank not in held):
            continue
        records = read_error_log(Path(logs) / name)
        found += records.values() if rank is None else [records[rank]] if rank in records else []
    return found
