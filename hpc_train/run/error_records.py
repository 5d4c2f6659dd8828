"""The error records of a requeued attempt's predecessor: found in one listing, cleared once rank 0 has read them.

Each rank that fails writes ``logs/rank-N.error.json``, stamped with its Slurm job and restart. A requeued
attempt's rank 0 reads the previous attempt's records to decide what follows (:mod:`hpc_train.ops.recovery`):
only the ranks that left one, found in one listing of ``logs/``, so the look-back costs O(failed ranks) rather
than a read of every rank's log. For that read to be whole, the new attempt's other ranks leave their old records
in place as they start (they would race rank 0 for them), and rank 0 clears the stale ones once it has read them:
each is moved aside first, then removed only if it is not this attempt's (a rank of this attempt may already have
failed and written its own under the same name).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from hpc_train.run.files import read_record_text
from hpc_train.run.paths import LOGS_DIR, rank_error_path

__all__ = ["clear_stale_records", "ranks_with_records", "record_is_of"]

_SUFFIX = ".error.json"


def ranks_with_records(run_dir: Path) -> list[int]:
    """The ranks whose ``rank-N.error.json`` is in ``logs/`` now, from one listing (no file is opened)."""
    try:
        names = os.listdir(Path(run_dir) / LOGS_DIR)
    except OSError:
        return []
    ranks = []
    for name in names:
        if name.startswith("rank-") and name.endswith(_SUFFIX):
            number = name[len("rank-"):-len(_SUFFIX)]
            if number.isdigit() and len(number) <= 9:
                ranks.append(int(number))
    return sorted(ranks)


def record_is_of(text: str, job_id: str, restart: int) -> bool:
    """Whether a record's text says it was written by an attempt of ``job_id`` with ``restart`` (records written
    before they were stamped say nothing, and are older than any attempt that reads them)."""
    try:
        record = json.loads(text or "{}")
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and str(record.get("job_id", "")) == job_id and record.get("restart") == restart


def clear_stale_records(run_dir: Path, ranks: list[int], job_id: str, restart: int) -> int:
    """Remove the records of ``ranks`` that are not this attempt's (``job_id``, ``restart``); the number removed.

    Each record is renamed to a name no reader lists before it is read, so a record a rank of this attempt writes
    meanwhile is never the one removed: a fresh one found aside is put back."""
    removed = 0
    for rank in ranks:
        path = rank_error_path(run_dir, rank)
        aside = path.with_name(f".stale-{rank}-{os.getpid()}{_SUFFIX}")
        try:
            os.rename(path, aside)
        except OSError:
            continue  # gone already, or never there
        if record_is_of(read_record_text(aside), job_id, restart):
            with contextlib.suppress(OSError):
                os.rename(aside, path)
            continue
        with contextlib.suppress(OSError):
            aside.unlink()
            removed += 1
    return removed
