"""A node's error records in one file: the ranks a node's agent starts append their failure to
``logs/errors-FIRST-LAST.jsonl`` instead of each writing ``rank-N.error.json``.

Why: after one NCCL fault every rank fails, and at 16,384 ranks one file per rank is 16,384 files created at once
on the shared file system's metadata server, then listed and read by the follower, ``status``, ``logs`` and the
next attempt's look-back. One file per node is 2,048 on 8-GPU nodes, created only on a node where a rank failed.

Who writes, who clears: each rank appends its record as one JSON line in one ``write()`` on an ``O_APPEND``
descriptor (as the node's log: :mod:`hpc_train.run.node_log`), so records of one node's ranks never mix. The
node's agent (:mod:`hpc_train.rank.agent.agent`) empties the file before each life of its ranks starts, so it holds the
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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpc_train.run.files import MAX_LINE, open_folder, open_run_path, parse_json, record_lines, write_all
from hpc_train.run.node_span import span_name, span_of
from hpc_train.run.paths import LOGS_DIR

__all__ = ["CONSEQUENCES", "ERRORS", "ERROR_LOG_ENV", "append_error", "clear_node_records", "error_log_name",
           "error_log_ranks", "error_logs", "kept_error_log_name", "node_error_records",
           "read_error_log", "records_of"]

ERROR_LOG_ENV = "HPC_TRAIN_ERROR_LOG"  # set by a node's agent for its ranks: the file name they append to
ERRORS, CONSEQUENCES = "errors", "consequences"  # a failure; what a rank raised after its attempt had stopped
_WRITE_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_TRACEBACK_BYTES = 256 << 10  # a record's traceback keeps its last 256 Ki characters (where the error is)
_LINE_BYTES = MAX_LINE - 4096  # and its line stays under what a reader takes


def error_log_name(rank: int, per_node: int, kind: str = ERRORS) -> str:
    """``errors-4-7.jsonl``: the error records of the node that holds ``rank`` with ``per_node`` ranks a node
    (``consequences-4-7.jsonl`` with ``kind`` CONSEQUENCES: what its ranks raised after a stop, not failures)."""
    return span_name(kind, rank, per_node, ".jsonl")


def kept_error_log_name(name: str) -> str:
    return f"prev-{name}"


def error_log_ranks(name: str) -> range | None:
    """The ranks a node's error log holds by its name (kept aside or not); None for any other name."""
    return span_of(name.removeprefix("prev-"), ERRORS, ".jsonl")


def error_logs(names: Iterable[str], kept: bool = False) -> list[str]:
    """The node error logs among ``names`` (a listing of ``logs/``): this life's, or with ``kept`` those moved
    aside for the look-back."""
    return sorted(name for name in names
                  if error_log_ranks(name) is not None and name.startswith("prev-") == kept)


def append_error(run_dir: Path, name: str, record: dict[str, Any]) -> None:
    """Append ``record`` (a rank's failure, with its ``rank``) to the node's error log ``name``, as one line in one
    write; a traceback too long for a line keeps its end, where the error is."""
    keep = _TRACEBACK_BYTES
    data = _line(record, keep)
    while len(data) > _LINE_BYTES and keep > 0:  # escaped or wide characters: the texts shrink until it fits
        keep = keep * _LINE_BYTES // len(data) // 2
        data = _line(record, keep)
    descriptor = open_run_path(Path(run_dir) / LOGS_DIR / name, _WRITE_FLAGS, 0o600)
    try:
        write_all(descriptor, data)
    finally:
        os.close(descriptor)


def _line(record: dict[str, Any], keep: int) -> bytes:
    """``record`` as one line, its ``traceback`` and ``error`` cut to their last ``keep`` characters (where the
    error is), never longer than a reader takes (:data:`~hpc_train.run.files.MAX_LINE`)."""
    cut = dict(record)
    for key, limit in (("traceback", keep), ("error", max(keep // 16, 256))):
        text = cut.get(key)
        if isinstance(text, str) and len(text) > limit:
            cut[key] = "..." + text[len(text) - limit:]
    return (json.dumps(cut, separators=(",", ":")) + "\n").encode("utf-8", errors="replace")


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


def clear_node_records(run_dir: Path, rank: int, per_node: int, keep_aside: bool) -> None:
    """The node's agent, before a life of its ranks starts (``rank``: one of them): the last life's error and
    consequence records go; with ``keep_aside`` (a requeued attempt's first life) the error records are moved
    aside whole for rank 0's look-back, as each rank without an agent does with its own. Never through a link."""
    errors = error_log_name(rank, per_node)
    try:
        logs = open_folder(Path(run_dir) / LOGS_DIR)
    except OSError:
        return  # no logs/ yet: nothing to clear
    try:
        if keep_aside:
            with contextlib.suppress(OSError):
                os.replace(errors, kept_error_log_name(errors), src_dir_fd=logs, dst_dir_fd=logs)
        for kind in (ERRORS, CONSEQUENCES):
            with contextlib.suppress(OSError):
                os.unlink(error_log_name(rank, per_node, kind), dir_fd=logs)
    finally:
        os.close(logs)
