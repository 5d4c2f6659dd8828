"""``python -m hpc_train logs RUN_DIR``: every rank's log as one timeline, errors first.

Why: a job of 64 ranks leaves 64 logs, and the line that matters (the first rank's traceback) is in one of them,
seconds before 63 others report that their peer went away. The view puts each rank's error on top (the earliest
first, identical ones folded together) and then merges all records by time with a rank prefix, so the order of
events across ranks reads top to bottom.

A rank log record is ``%(asctime)s rankN LEVEL message``; lines without a timestamp (a traceback) belong to the
record above. The batch output joins the timeline too: Slurm's ``logs/slurm-*.out/err`` (rendered scripts) and
submitit's ``submitit/JOB_TASK_log.err`` (where srun and slurmstepd say which task ended how). Its lines mostly
carry no time of their own, so each takes the time of the last timestamped line before it in the same file (the
first one, before any). Copies of a rank's lines in the batch output (rank 0's stdout, torch's ``[rankN]:``
traceback lines) are dropped: the rank's own log and error file hold them.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hpc_train.errors import ConfigError
from hpc_train.run.files import open_record, read_record_text
from hpc_train.run.loglines import RANK_RECORD
from hpc_train.run.paths import LOGS_DIR, RANK_ERROR_GLOB, RANK_LOG_GLOB, SUBMITIT_DIR, rank_error_path

__all__ = ["LogRecord", "MergedLogs", "RankError", "format_text", "merged_view", "read_records"]

_RANK_RECORD = RANK_RECORD  # what launch.rank_log_format writes
_ANY_STAMP = re.compile(r"([0-9]{4}-[0-9][0-9]-[0-9][0-9])[ T]([0-9][0-9]:[0-9][0-9]:[0-9][0-9])(?:[,.]([0-9]{1,6}))?")
_ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|\berror\b|\bKilled\b|CANCELLED|oom[-_ ]kill|"
                         r"Out Of Memory|Segmentation fault|\bTimed? ?out\b", re.IGNORECASE)
_RANK_PREFIX = re.compile(r"\[rank[0-9]+\]:")  # torch's prefix on a rank's stderr lines
# Logged at INFO but what an operator looks for: the watchdog, the straggler check, a preemption signal and its save
_NOTICE = re.compile(r"(hang|straggler)\b|SIG[A-Z0-9]+ received|saved step [0-9]+ .* after SIG")
# Slurm's own word that it ended a step to requeue or preempt the job (slurmstepd writes it as "error:"): the
# requeue that hpc_train or the scheduler asked for, worth seeing, never a failure
_SCHEDULER_NOTICE = re.compile(r"CANCELLED AT \S+ DUE TO (JOB REQUEUE|PREEMPTION)")
_MAX_BYTES = 64 << 20  # per file: a longer log is read from its last 64 MiB (and the view says so)


@dataclass(frozen=True)
class LogRecord:
    """One record: its first line and the lines that belong to it."""

    time: float | None
    source: str
    rank: int | None
    level: str
    text: str
    more: tuple[str, ...] = ()
    stamp: str = ""
    order: int = 0

    @property
    def severity(self) -> str:
        """``error`` (an ERROR record, a traceback, an error line of Slurm's), ``warning`` (a WARNING record, the
        watchdog's "hang:" lines, the straggler check's, a preemption signal and its save), or ``""``."""
        if self.level in ("ERROR", "CRITICAL"):
            return "error"
        if any("Traceback (most recent call last)" in line for line in (self.text, *self.more)):
            return "error"
        if self.rank is None:
            if _SCHEDULER_NOTICE.search(self.text):
                return "warning"
            return "error" if _ERROR_TEXT.search(self.text) else ""
        if self.level == "WARNING" or _NOTICE.match(self.text):
            return "warning"
        return ""

    def lines(self) -> list[str]:
        head = " ".join(part for part in (self.stamp, self.level, self.text) if part)
        return [head, *self.more]

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "stamp": self.stamp, "source": self.source, "rank": self.rank,
                "level": self.level, "severity": self.severity, "text": "\n".join([self.text, *self.more])}


@dataclass(frozen=True)
class RankError:
    """A rank's ``error.json``: the exception it died of, where, and which other ranks died of the same."""

    rank: int
    host: str
    time: float | None
    error: str
    where: str
    traceback: str
    same_ranks: tuple[int, ...] = ()


@dataclass
class MergedLogs:
    run_dir: Path
    errors: list[RankError] = field(default_factory=list)
    error_records: list[tuple[LogRecord, list[str]]] = field(default_factory=list)  # a record, where else seen
    timeline: list[LogRecord] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "sources": self.sources, "notes": self.notes,
                "errors": [asdict(e) for e in self.errors],
                "error_records": [{**r.to_dict(), "same_in": same} for r, same in self.error_records],
                "timeline": [r.to_dict() for r in self.timeline]}


def _epoch(date: str, clock: str, fraction: str | None) -> float | None:
    try:
        moment = datetime.strptime(f"{date} {clock}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return moment.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def _read(path: Path, notes: list[str]) -> str:
    try:
        with open_record(path) as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - _MAX_BYTES))
            data = handle.read()
    except OSError as error:
        notes.append(f"{path.name}: not read ({error.strerror or error})")
        return ""
    text = data.decode("utf-8", errors="replace")
    if size > _MAX_BYTES:
        notes.append(f"{path.name} is {size >> 20} MiB: only its last {_MAX_BYTES >> 20} MiB are shown")
        text = text.partition("\n")[2]
    return text


def read_records(path: Path, source: str, rank: int | None, notes: list[str] | None = None) -> list[LogRecord]:
    """The records of one file. A rank log's records start at timestamped lines; in other files every line that
    does not start with white space is a record, timed by the last timestamp seen in the file."""
    text = _read(path, notes if notes is not None else [])
    records: list[LogRecord] = []
    last_time: float | None = None
    head: dict[str, Any] | None = None
    more: list[str] = []

    def close() -> None:
        if head is not None:
            records.append(LogRecord(**head, more=tuple(more), order=len(records)))

    for line in text.splitlines():
        m = _RANK_RECORD.match(line)
        if rank is not None:
            if m:
                close()
                last_time = _stamp_time(m[1])
                head, more = {"time": last_time, "source": source, "rank": int(m[2]), "level": m[3],
                              "text": m[4], "stamp": m[1]}, []
            elif head is None:
                head, more = {"time": None, "source": source, "rank": rank, "level": "", "text": line}, []
            else:
                more.append(line)
            continue
        if m or _RANK_PREFIX.match(line):  # copies of a rank's log or traceback: its own files have them
            last_time = _stamp_time(m[1]) if m else last_time  # ... but their time still tells when lines came
            if head is not None and head["time"] is None:
                head["time"] = last_time
            continue
        if head is not None and (not line.strip() or line[:1].isspace()):
            more.append(line)
            continue
        close()
        found = _ANY_STAMP.search(line)
        if found:
            last_time = _epoch(found[1], found[2], found[3])
        head, more = {"time": last_time, "source": source, "rank": None, "level": "", "text": line}, []
    close()
    if rank is None:  # lines before the file's first timestamp take that one
        first = next((r.time for r in records if r.time is not None), None)
        records = [r if r.time is not None else LogRecord(**{**asdict(r), "time": first, "more": r.more})
                   for r in records]
    return records


def _stamp_time(stamp: str) -> float | None:
    date, _, rest = stamp.partition(" ")
    clock, _, fraction = rest.partition(",")
    return _epoch(date, clock, fraction or None)


def _rank_errors(logs: Path, rank: int | None) -> list[RankError]:
    """Every ``rank-N.error.json``, earliest first, identical errors (digits aside) folded into the first."""
    found = []
    for path in logs.glob(RANK_ERROR_GLOB):
        try:
            data = json.loads(read_record_text(path))
        except (ValueError, RecursionError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rank"), int):
            continue
        if rank is not None and data["rank"] != rank:
            continue
        when = data.get("time")
        tb = str(data.get("traceback", ""))
        frames = re.findall(r'File "([^"]+)", line ([0-9]+), in (\S+)', tb)
        where = f"{'/'.join(Path(frames[-1][0]).parts[-2:])}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""
        found.append(RankError(data["rank"], str(data.get("host", "")), float(when) if isinstance(
            when, int | float) else None, str(data.get("error", "")), where, tb))
    found.sort(key=lambda e: (e.time if e.time is not None else float("inf"), e.rank))
    folded: dict[str, RankError] = {}
    for error in found:
        key = re.sub(r"[0-9]+", "#", error.error)
        if key in folded:
            first = folded[key]
            folded[key] = RankError(**{**asdict(first), "same_ranks": (*first.same_ranks, error.rank)})
        else:
            folded[key] = error
    return list(folded.values())


def _fold(records: list[LogRecord]) -> list[tuple[LogRecord, list[str]]]:
    """Rank records that differ only in numbers (ports, ranks, times) shown once, naming the other ranks; other
    records only when their text is the same (srun's "n1: task 0" and "n2: task 1" are two facts)."""
    folded: dict[str, tuple[LogRecord, list[str]]] = {}
    for record in records:
        text = "\n".join([record.level, record.text, *record.more])
        key = re.sub(r"[0-9]+", "#", text) if record.rank is not None else "batch\0" + _ANY_STAMP.sub("", text)
        if key in folded:
            folded[key][1].append(record.source)
        else:
            folded[key] = (record, [])
    return list(folded.values())


def _rank_of(path: Path) -> int | None:
    m = re.fullmatch(r"rank-([0-9]+)\.log", path.name)
    return int(m[1]) if m else None


def merged_view(run_dir: Path, rank: int | None = None, errors_only: bool = False,
                tail: int | None = None) -> MergedLogs:
    """Read ``RUN_DIR/logs``: the rank errors, the error records, and the merged timeline (its last ``tail``
    records when given). ``rank`` keeps one rank's files only (no batch output)."""
    run_dir = Path(run_dir)
    logs = run_dir / LOGS_DIR
    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} is not a folder", "give a run folder, like runs/tiny-gpt")
    if not logs.is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} has no logs/ folder", "give a run folder (it holds plan.json and "
                          "logs/), like runs/tiny-gpt")
    if tail is not None and tail < 0:
        raise ConfigError("--tail", f"{tail} is negative", "give the number of records to show, like --tail 50")
    view = MergedLogs(run_dir)
    files = sorted((p for p in logs.glob(RANK_LOG_GLOB) if _rank_of(p) is not None), key=lambda p: _rank_of(p) or 0)
    if rank is not None:
        files = [p for p in files if _rank_of(p) == rank]
        if not files and not rank_error_path(run_dir, rank).exists():
            ranks = ", ".join(str(_rank_of(p)) for p in sorted(logs.glob(RANK_LOG_GLOB), key=lambda p: p.name))
            raise ConfigError("--rank", f"{run_dir} has no log of rank {rank}", f"pick one of: {ranks or 'none'}")
    else:
        files += sorted(p for p in logs.glob("slurm-*") if p.suffix in (".out", ".err"))
        files += sorted((run_dir / SUBMITIT_DIR).glob("*_log.err"))
    records: list[LogRecord] = []
    for path in files:
        number = _rank_of(path)
        source = f"rank{number}" if number is not None else (
            path.name if path.parent == logs else f"submitit/{path.name.removesuffix('_log.err')}.err")
        records += read_records(path, source, number, view.notes)
        view.sources.append(source if number is None else path.name)
    view.errors = _rank_errors(logs, rank)
    notable = sorted((r for r in records if r.severity), key=lambda r: (r.time if r.time is not None else
                                                                        float("-inf"), r.source))
    view.error_records = _fold(notable)
    if not errors_only:
        ordered = sorted(enumerate(records), key=lambda item: (
            item[1].time if item[1].time is not None else float("-inf"), item[0]))
        view.timeline = [r for _, r in ordered]
        if tail is not None:
            view.timeline = view.timeline[-tail:] if tail else []
    return view


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def format_text(view: MergedLogs) -> str:
    """Plain lines (greppable, no colour): the errors, then ``source | line`` for the timeline."""
    out = [f"== errors in {view.run_dir} =="]
    if not view.errors and not view.error_records:
        out.append("no rank reported an error or warning")
    for index, error in enumerate(view.errors):
        first = " (first)" if index == 0 and len(view.errors) + sum(len(e.same_ranks) for e in view.errors) > 1 else ""
        out.append(f"rank {error.rank} on {error.host or '?'} at {_clock(error.time)}{first}: {error.error}")
        if error.where:
            out.append(f"    at {error.where}")
        if error.same_ranks:
            out.append(f"    the same error on rank {', '.join(map(str, error.same_ranks))}")
    width = max((len(r.source) for r in [*(r for r, _ in view.error_records), *view.timeline]), default=5)
    if view.error_records:
        out.append("-- error and warning records, earliest first --")
        for record, same in view.error_records:
            out += _prefixed([record], width)
            if same:
                out.append(f"{'':>{width}} | (the same in {', '.join(same)})")
    if view.timeline:
        out.append(f"== timeline: {len(view.timeline)} records from {', '.join(view.sources)} ==")
        out += _prefixed(view.timeline, width)
    out += [f"note: {note}" for note in view.notes]
    return "\n".join(out)


def _prefixed(records: list[LogRecord], width: int) -> list[str]:
    return [f"{record.source:>{width}} | {line}" for record in records for line in record.lines()]
