"""What ``status`` reads of a run folder's own records beside the attempts: the tail of ``metrics.jsonl`` and
``checkpoints/latest``, each through :mod:`hpc_train.run.files` (never a link at any depth, bounded, numbers in
range: a 400-digit step or a time of 1e308 is damage, never an OverflowError in the view)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_train.checkpoint.names import LATEST_NAME, step_of
from hpc_train.run.files import open_record, parse_json, time_value
from hpc_train.run.paths import CHECKPOINTS_DIR

__all__ = ["RATE_RECORDS", "CheckpointState", "checkpoint_state", "metrics_tail"]

_METRICS_BYTES = 256 << 10
RATE_RECORDS = 20  # the ETA uses the step rate over this many recent metrics records


@dataclass
class CheckpointState:
    """What ``checkpoints/latest`` names, its step, and when it was written."""

    name: str
    step: int | None
    time: float | None


def metrics_tail(path: Path) -> list[dict[str, Any]]:
    """The last step records (a user program's may carry no loss; evaluation-only lines are left out)."""
    try:
        with open_record(path) as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - _METRICS_BYTES))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = parse_json(line)  # numbers in range: NaN and 1e400 as None, a 400-digit integer is damage
        except ValueError:
            continue
        # A user program's ctx.log records may have no loss; an evaluation's record has only eval_loss.
        if isinstance(record, dict) and _step(record) is not None and set(record) - {"step", "eval_loss"}:
            record["time"] = time_value(record.get("time"))
            records.append(record)
    return records[-RATE_RECORDS * 2:]


def _step(record: dict[str, Any]) -> int | None:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 1 << 62 else None


def checkpoint_state(path: Path) -> CheckpointState | None:
    """``checkpoints/latest``: never through a link (``checkpoints/`` itself a link is another place's)."""
    latest = path / CHECKPOINTS_DIR / LATEST_NAME
    try:
        with open_record(latest) as handle:
            name = handle.read(256).decode("utf-8", errors="replace").strip()
            moment = time_value(os.fstat(handle.fileno()).st_mtime)
    except OSError:
        return None
    return CheckpointState(name, step_of(name), moment)
