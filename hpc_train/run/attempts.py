"""``RUN_DIR/attempts.jsonl``: one line per attempt of a run (first start, each requeue, each resubmission).

Rank 0 writes a line with outcome ``running`` when an attempt starts and rewrites it when the attempt ends
(``completed``, ``preempted``, ``failed``, ``hang``; the next attempt may name a ``node_failure`` or an
``infrastructure`` fault it found, ``hpc_train.failures.recovery``); a line still ``running`` when the next attempt
starts was killed without a word (SIGKILL, node failure, a requeue without a signal) and becomes ``killed``. The
measured step and save times feed the preemption lead time of the next submission. Plain JSON, no torch: the
login node reads it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from hpc_train.run.files import MAX_TIME, atomic_write, finite, parse_json, record_lines, warn_bad_record
from hpc_train.run.paths import ATTEMPTS_FILE

__all__ = ["ATTEMPTS_FILE", "Attempt", "AttemptLog", "measured_save_s", "recommended_lead_seconds", "requeues_so_far"]

OUTCOMES = ("running", "completed", "preempted", "failed", "hang", "node_failure", "infrastructure", "killed",
            "crashed", "cancelled")  # cancelled: by the user (hpc_train cancel, Job.cancel()) on the local executor


@dataclass(frozen=True)
class Attempt:
    """One attempt: where and when it ran, the steps it covered, and how it ended."""

    attempt: int
    job_id: str
    restart: int
    host: str
    started: float
    start_step: int
    outcome: str = "running"
    ended: float | None = None
    end_step: int | None = None
    signal: str | None = None
    requeued: bool = False
    step_s_max: float | None = None
    save_s_max: float | None = None
    note: str = ""
    in_place: int = 0  # the restart inside the same Slurm attempt (hpc_train.rank.agent.agent) this attempt was

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        """The attempt a line describes; ValueError naming the first field of the wrong type."""
        known = {f.name: f for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        for key in ("attempt", "job_id", "restart", "host", "started", "start_step"):
            if key not in values:
                raise ValueError(f'has no "{key}"')
        for key, value in values.items():
            if not (value is None and key in _OPTIONAL) and not _typed(value, _FIELD_TYPES[key]):
                raise ValueError(f'"{key}" is {str(value)[:40]!r}, not {_FIELD_TYPES[key]}')
        return cls(**values)


_MAX_LINE = 65536
_FIELD_TYPES = {"attempt": "an integer", "job_id": "a string", "restart": "an integer", "host": "a string",
                "started": "a time", "start_step": "an integer", "outcome": "an outcome", "ended": "a time",
                "end_step": "an integer", "signal": "a string", "requeued": "true or false",
                "step_s_max": "a duration", "save_s_max": "a duration", "note": "a string",
                "in_place": "an integer"}
# Ranges, not only types: a start time of 1e308 failed time.localtime in status, and a step time of 1e308 made the
# next submission's lead time infinite (OverflowError in math.ceil).
_RANGES = {"a time": (0.0, MAX_TIME), "a duration": (0.0, 1e7)}
_OPTIONAL = {"ended", "end_step", "signal", "step_s_max", "save_s_max"}


def _typed(value: Any, kind: str) -> bool:
    if kind == "an integer":
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
    if kind in _RANGES:
        return finite(value, *_RANGES[kind]) is not None
    if kind == "an outcome":
        return value in OUTCOMES
    if kind == "true or false":
        return isinstance(value, bool)
    return isinstance(value, str) and len(value) <= 4096


class AttemptLog:
    """The attempts of one run folder; only rank 0 writes, so a whole-file rewrite per change is safe."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ATTEMPTS_FILE

    def read(self, warn: bool = False) -> list[Attempt]:
        """Every readable line; a torn or foreign line, or one with a number out of its range, is skipped rather
        than failing the run (with a warning naming the file and line when ``warn``, for commands a person reads)."""
        attempts = []
        for number, line in record_lines(self.path, _MAX_LINE, warn=warn):
            try:
                data = parse_json(line)
                if not isinstance(data, dict):
                    raise ValueError("is not a JSON object")
                attempts.append(Attempt.from_dict(data))
            except (ValueError, TypeError) as error:
                if warn and line.strip():
                    warn_bad_record(self.path, number, str(error) or "is not an attempt")
        return attempts

    def _write(self, attempts: list[Attempt]) -> None:
        text = "".join(json.dumps(asdict(a), sort_keys=True) + "\n" for a in attempts)
        atomic_write(self.path, text)

    def begin(self, job_id: str, restart: int, host: str, started: float, start_step: int,
              in_place: int = 0) -> Attempt:
        """Close an attempt left ``running`` as ``killed`` and open the next one."""
        attempts = [replace(a, outcome="killed") if a.outcome == "running" else a for a in self.read()]
        number = max((a.attempt for a in attempts), default=0) + 1
        current = Attempt(attempt=number, job_id=job_id, restart=restart, host=host, started=started,
                          start_step=start_step, in_place=in_place)
        self._write([*attempts, current])
        return current

    def finish(self, current: Attempt, **changes: Any) -> Attempt:
        """Rewrite ``current``'s line with how it ended."""
        if changes.get("outcome", current.outcome) not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, not {changes['outcome']!r}")
        ended = replace(current, **changes)
        self._write([ended if a.attempt == current.attempt else a for a in self.read()])
        return ended


def requeues_so_far(attempts: list[Attempt], job_id: str | None = None) -> int:
    """How many times job ``job_id`` (a requeue keeps the id; a new submission gets a new one) has requeued
    itself; every job of the run when ``job_id`` is None."""
    return sum(1 for a in attempts if a.requeued and (job_id is None or a.job_id == job_id))


def measured_save_s(attempts: list[Attempt]) -> float | None:
    """The save time the newest attempt that timed one measured (what a step waited for), or None."""
    return next((a.save_s_max for a in reversed(attempts) if a.save_s_max is not None), None)


def recommended_lead_seconds(attempts: list[Attempt], floor: int) -> int:
    """Signal lead time that fits the slowest measured step plus save, with room to spare: three steps (the ranks
    act on a signal at the second step boundary after it at the latest) plus 1.5 times the save plus 10 s, never
    below ``floor``."""
    steps = [a.step_s_max for a in attempts if a.step_s_max is not None]
    saves = [a.save_s_max for a in attempts if a.save_s_max is not None]
    if not steps and not saves:
        return floor
    needed = 3 * max(steps, default=0.0) + 1.5 * max(saves, default=0.0) + 10
    return max(floor, math.ceil(needed))
