"""The error records of a requeued attempt's predecessor: kept aside as its ranks start, read and cleared by rank 0.

Each rank that fails writes ``logs/rank-N.error.json``, stamped with its Slurm job and restart. A requeued
attempt's rank 0 reads the previous attempt's records to decide what follows (:mod:`hpc_train.failures.recovery`):
only the ranks that left one, found in one listing of ``logs/``, so the look-back costs O(failed ranks) rather
than a read of every rank's log. The attempt's other ranks must not remove their records before rank 0 has read
them, nor leave them where the follower and ``status`` take them for this attempt's failures: each moves its own
aside as it starts (:func:`keep_aside`, one rename to ``prev-rank-N.error.json``, a name no reader of this
attempt's records lists), and rank 0 removes those once its look-back is done (:func:`clear_kept`). Ranks below
a node's agent append to their node's ``errors-FIRST-LAST.jsonl`` instead (:mod:`hpc_train.run.error_log`),
which the agent moves aside whole (``prev-errors-FIRST-LAST.jsonl``): both are listed and cleared here.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from hpc_train.run.error_log import error_log_ranks
from hpc_train.run.paths import LOGS_DIR, rank_error_path

__all__ = ["clear_kept", "keep_aside", "kept_path", "ranks_with_records", "record_is_of"]

_SUFFIX = ".error.json"
_KEPT = "prev-"


def kept_path(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s record of the previous attempt waits for rank 0's look-back."""
    return Path(run_dir) / LOGS_DIR / f"{_KEPT}rank-{rank}{_SUFFIX}"


def keep_aside(run_dir: Path, rank: int) -> None:
    """This rank's record of an earlier attempt, moved aside (one rename; nothing when it has none)."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(rank_error_path(run_dir, rank), kept_path(run_dir, rank))


def ranks_with_records(run_dir: Path) -> list[int]:
    """The ranks with a record in ``logs/`` now, kept aside or not yet (a rank that has not started moves its
    own later), from one listing (no file is opened)."""
    try:
        names = os.listdir(Path(run_dir) / LOGS_DIR)
    except OSError:
        return []
    ranks = set()
    for name in names:
        rank = _rank_of(name.removeprefix(_KEPT))
        if rank is not None:
            ranks.add(rank)
        elif name.endswith(".jsonl") and (held := error_log_ranks(name)) is not None:
            ranks.update(held)  # a node's file: its ranks are read, those that wrote nothing leave nothing
    return sorted(ranks)


def _rank_of(name: str) -> int | None:
    if name.startswith("rank-") and name.endswith(_SUFFIX):
        number = name[len("rank-"):-len(_SUFFIX)]
        if number.isdigit() and len(number) <= 9:
            return int(number)
    return None


def record_is_of(record: object, job_id: str | None, restart: int | None) -> bool:
    """Whether a record (a parsed ``rank-N.error.json``) says it was written by an attempt of ``job_id`` with
    ``restart`` (records written before they were stamped say nothing)."""
    if isinstance(record, str):
        try:
            record = json.loads(record or "{}")
        except (ValueError, RecursionError):
            return False
    return isinstance(record, dict) and job_id is not None and str(record.get("job_id", "")) == job_id and \
        (restart is None or record.get("restart") == restart)


def clear_kept(run_dir: Path) -> int:
    """Remove every record kept aside (rank 0, once its look-back has read them); the number removed."""
    removed = 0
    try:
        names = os.listdir(Path(run_dir) / LOGS_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(_KEPT) and (_rank_of(name.removeprefix(_KEPT)) is not None
                                       or error_log_ranks(name) is not None):
            with contextlib.suppress(OSError):
                os.unlink(Path(run_dir) / LOGS_DIR / name)
                removed += 1
    return removed
