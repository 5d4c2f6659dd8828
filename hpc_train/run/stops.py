"""The stop of an attempt that hpc_train decides for a program that did not ask ``should_stop()``, as a file.

Such a program is in the middle of its own loop when the grace period after a signal ends, so the ranks cannot
agree through a collective: if rank 0 requeued and left alone, the others' next collective would break and
their tracebacks would read as the run's failure. Rank 0 therefore publishes a notice in two phases:

1. ``stopping``: the decision is made (requeue or not); every rank stops trusting its peers from here on, and
   anything a rank raises now is a *consequence* of the stop, never a failure;
2. ``done``: the requeue was carried out and the attempt recorded; every rank leaves with the notice's exit
   status at the same moment.

A rank other than 0 that has the signal when rank 0 has not asks for the stop with a request file. Plain JSON,
no torch: the login side reads notices too (a follower never cancels a job whose attempt has stopped).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_train.control.events import rank_events, stop_key, stop_request_key
from hpc_train.control.publish import publish
from hpc_train.run.files import atomic_write, parse_json, read_record_text
from hpc_train.run.paths import HEARTBEAT_DIR, stop_notice_path, stop_request_path

__all__ = ["PHASES", "StopConsequence", "StopNotice", "attempt_key", "publish_notice", "read_notice",
           "read_request", "request_stop", "wait_for_done"]

PHASES = ("stopping", "done")


def attempt_key(job_id: str | None, restart: int, in_place: int = 0) -> str:
    """How the ranks of one attempt name it in their coordination files (the watchdog's too); a restart in
    place (:mod:`hpc_train.rank.agent.agent`) is an attempt of its own."""
    return f"{job_id or 'local'}.{restart}" + (f".{in_place}" if in_place else "")


@dataclass(frozen=True)
class StopNotice:
    """Rank 0's stop of one attempt: what it does (``scontrol``, ``local``, ``none``), the status every rank
    exits with, why, the signal and the program's last known step (None: the program never said)."""

    attempt: str
    phase: str
    time: float
    signal: str
    action: str
    exit_code: int
    reason: str
    step: int | None = None

    @classmethod
    def from_json(cls, text: str) -> StopNotice:
        data = parse_json(text)  # a number no float holds (a 400-digit time) is a ValueError, never an OverflowError
        if not isinstance(data, dict) or data.get("phase") not in PHASES:
            raise ValueError("not a stop notice")
        step = data.get("step")
        return cls(attempt=str(data["attempt"]), phase=str(data["phase"]), time=float(data["time"]),
                   signal=str(data["signal"]), action=str(data["action"]), exit_code=int(data["exit_code"]),
                   reason=str(data["reason"]), step=step if isinstance(step, int) else None)


class StopConsequence(Exception):  # noqa: N818 - it is not an error of the program's: that is the point
    """What a rank raised after its attempt was stopped (its peers left, a collective broke): recorded as a
    consequence of the stop, never as the attempt's failure; the rank leaves with the stop's exit status."""

    def __init__(self, error: BaseException, notice: StopNotice) -> None:
        super().__init__(f"{error!r} after the attempt stopped on {notice.signal} ({notice.action})")
        self.error, self.notice = error, notice


_DONE_FILE_EVERY_S = 10.0  # a rank waiting for rank 0's done notice reads the record this often besides the push
# (per-rank shared-filesystem work at most every 10 s: 16,384 ranks wait here at once)


def publish_notice(run_dir: Path, notice: StopNotice) -> None:
    """The run folder's record, then the coordinator's push to every rank (where an agent named one)."""
    (Path(run_dir) / HEARTBEAT_DIR).mkdir(mode=0o700, exist_ok=True)
    atomic_write(stop_notice_path(run_dir, notice.attempt), json.dumps(asdict(notice)) + "\n")
    publish(stop_key(notice.attempt), asdict(notice), first=False)


def read_notice(run_dir: Path, attempt: str, since: float = 0.0, heard_only: bool = True) -> StopNotice | None:
    """This attempt's notice, if rank 0 has published one at or after ``since`` (a restart of the local
    executor reuses the attempt's name: an older notice belongs to an earlier run of it). On a rank whose agent
    named a coordinator, as it pushed the notice (no file read: ranks ask every second); elsewhere, or with
    ``heard_only`` false, the run folder's record too, read as every record is: never through a link, never from
    a FIFO."""
    events = rank_events()
    if events is not None:
        notice = _notice_of(json.dumps(events.seen(stop_key(attempt))), attempt, since)
        if notice is not None or heard_only:
            return notice
    try:
        return _notice_of(read_record_text(stop_notice_path(run_dir, attempt)), attempt, since)
    except OSError:
        return None


def _notice_of(text: str, attempt: str, since: float) -> StopNotice | None:
    try:
        notice = StopNotice.from_json(text)
    except (ValueError, KeyError, TypeError):
        return None
    return notice if notice.attempt == attempt and notice.time >= since - 1 else None


def wait_for_done(run_dir: Path, attempt: str, since: float, timeout_s: float,
                  poll_s: float = 0.1) -> StopNotice | None:
    """The ``done`` notice once rank 0 has published it, or None after ``timeout_s``. Where the coordinator
    pushes it, each look reads memory and only every :data:`_DONE_FILE_EVERY_S` the run folder's record too (a
    notice rank 0 could only write there); every rank of the job waits here at once."""
    deadline = time.monotonic() + timeout_s
    file_due = 0.0
    while True:
        now = time.monotonic()
        with_file = now >= file_due
        if with_file:
            file_due = now + _DONE_FILE_EVERY_S
        notice = read_notice(run_dir, attempt, since, heard_only=not with_file)
        if notice is not None and notice.phase == "done":
            return notice
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def request_stop(run_dir: Path, attempt: str, rank: int, signal: str) -> None:
    """A rank other than 0 with the signal: ask rank 0 to stop the attempt (rank 0 may not have the signal)."""
    (Path(run_dir) / HEARTBEAT_DIR).mkdir(mode=0o700, exist_ok=True)
    request = {"attempt": attempt, "rank": rank, "signal": signal, "time": time.time()}
    atomic_write(stop_request_path(run_dir, attempt), json.dumps(request) + "\n")
    publish(stop_request_key(attempt), request, first=False)


def read_request(run_dir: Path, attempt: str, since: float = 0.0) -> str | None:
    """The signal another rank asked rank 0 to stop for, if it asked at or after ``since``: as the coordinator
    pushed it where there is one (rank 0 asks every second), else from the run folder."""
    events = rank_events()
    try:
        if events is not None:
            data = events.seen(stop_request_key(attempt))
        else:
            data = json.loads(read_record_text(stop_request_path(run_dir, attempt)))
        if data["attempt"] == attempt and float(data["time"]) >= since - 1:
            return str(data["signal"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None
