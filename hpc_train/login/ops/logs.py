"""``python -m hpc_train logs RUN_DIR``: every rank's log as one timeline, errors first.

Why: a job of 64 ranks leaves 64 ranks' lines, and the line that matters (the first rank's traceback) is one of
them, seconds before 63 others report that their peer went away. The view puts each rank's error on top (the
earliest first, identical ones folded together) and then merges all records by time with a rank prefix, so the
order of events across ranks reads top to bottom.

The ranks of a node share one log (``logs/ranks-FIRST-LAST.log``, :mod:`hpc_train.run.node_log`; older run
folders hold a ``rank-N.log`` per rank). A record is ``%(asctime)s rankN LEVEL message``; lines without a
timestamp (a traceback) belong to the record above, and so to its rank. The batch output joins the timeline too:
Slurm's ``logs/slurm-*.out/err`` (rendered scripts) and submitit's ``submitit/JOB_TASK_log.err`` (where srun and
slurmstepd say which task ended how). Its lines mostly carry no time of their own, so each takes the time of the
last timestamped line before it in the same file (the first one, before any). Copies of a rank's lines in the
batch output (rank 0's stdout, torch's ``[rankN]:`` traceback lines) are dropped: the rank's own log and error
file hold them.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpc_train.common.terminal import ranges
from hpc_train.errors import ConfigError
from hpc_train.failures.records import open_bytes, read_text
from hpc_train.run.error_log import node_error_records
from hpc_train.run.files import folder_names, held_folders, parse_json, refuse_link, run_file_stat, time_value
from hpc_train.run.loglines import RANK_RECORD
from hpc_train.run.node_log import log_ranks
from hpc_train.run.paths import LOGS_DIR, RANK_ERROR_GLOB, SUBMITIT_DIR, rank_error_path

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
_DIGITS = re.compile(r"[0-9]+")
_FRAME = re.compile(r'File "([^"]+)", line ([0-9]+), in (\S+)')
_MAX_BYTES = 64 << 20  # per rank: a longer log is read from its last 64 MiB a rank it holds (the view says so)


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
        return _severity(self.level, self.text, self.more, self.rank)

    def lines(self) -> list[str]:
        head = " ".join(part for part in (self.stamp, self.level, self.text) if part)
        return [head, *self.more]

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "stamp": self.stamp, "source": self.source, "rank": self.rank,
                "level": self.level, "severity": self.severity, "text": "\n".join([self.text, *self.more])}


def _severity(level: str, text: str, more: tuple[str, ...] | list[str], rank: int | None) -> str:
    if level in ("ERROR", "CRITICAL"):
        return "error"
    if "Traceback (most recent call last)" in text or (more and any("Traceback (most recent call last)" in line
                                                                    for line in more)):
        return "error"
    if rank is None:
        if _SCHEDULER_NOTICE.search(text):
            return "warning"
        return "error" if _ERROR_TEXT.search(text) else ""
    if level == "WARNING" or _NOTICE.match(text):
        return "warning"
    return ""


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
    moment = _second(date, clock)
    return None if moment is None else moment + (float(f"0.{fraction}") if fraction else 0.0)


@lru_cache(maxsize=4096)
def _second(date: str, clock: str) -> float | None:
    """Once per second of the clock: 16,384 ranks log their records within a few seconds of each other."""
    try:
        return datetime.strptime(f"{date} {clock}", "%Y-%m-%d %H:%M:%S").timestamp()
    except ValueError:
        return None


def _read(path: Path | str, notes: list[str], ranks: int = 1) -> str:
    limit = _MAX_BYTES * max(1, ranks)
    try:
        data, size = open_bytes(path, limit, tail=True)
    except OSError as error:
        notes.append(f"{os.path.basename(path)}: not read ({error.strerror or error})")
        return ""
    text = data.decode("utf-8", errors="replace")
    if size > limit:
        notes.append(f"{os.path.basename(path)} is {size >> 20} MiB: only its last {limit >> 20} MiB are shown")
        text = text.partition("\n")[2]
    return text


def read_records(path: Path | str, source: str, rank: int | None, notes: list[str] | None = None,
                 notable_only: bool = False, holds: range | None = None,
                 only_rank: int | None = None) -> list[LogRecord]:
    """The records of one file. A rank log's records (``holds``: the ranks its name says it holds; ``rank``: the
    one rank of a one-rank log) start at timestamped lines, each from the rank its line names (its source
    ``rankN``); in other files every line that does not start with white space is a record, timed by the last
    timestamp seen in the file. ``notable_only``: only a rank log's records with a severity (the rest is never
    built); ``only_rank``: only that rank's records."""
    text = _read(path, notes if notes is not None else [], len(holds) if holds is not None else 1)
    if holds is not None or rank is not None:
        return _rank_records(text, source, rank, notable_only, only_rank)
    records: list[LogRecord] = []
    last_time: float | None = None
    head: dict[str, Any] | None = None
    more: list[str] = []

    def close() -> None:
        if head is not None:
            records.append(LogRecord(**head, more=tuple(more), order=len(records)))

    for line in text.splitlines():
        m = _RANK_RECORD.match(line)
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
    first = next((r.time for r in records if r.time is not None), None)  # lines before the first timestamp
    return [r if r.time is not None else replace(r, time=first) for r in records]


def _rank_records(text: str, source: str, rank: int | None, notable_only: bool,
                  only_rank: int | None = None) -> list[LogRecord]:
    """A rank log's records: each starts at a timestamped line naming its rank, the lines after it (a traceback)
    belong to it. Lines before the first record are ``rank``'s (a one-rank log's), or dropped (a node's log read
    from the middle: their rank is unknown)."""
    records: list[LogRecord] = []
    head: tuple[float | None, int | None, str, str, str] | None = None  # time, rank, level, text, stamp
    more: list[str] = []
    count = 0
    match = _RANK_RECORD.match
    sources: dict[int | None, str] = {}

    def source_of(number: int | None) -> str:
        if (name := sources.get(number)) is None:
            name = sources[number] = source if number is None or number == rank else f"rank{number}"
        return name

    for line in [*text.splitlines(), None]:
        m = match(line) if line is not None and line[:1].isdigit() else None  # a record starts with its date
        if m and len(m[2]) > 9:  # a 5,000-digit rank is no rank: the line is text of the record above
            m = None
        if line is not None and not m and head is not None:
            more.append(line)
            continue
        if head is not None and head[1] is not None and (only_rank is None or head[1] == only_rank):
            if not notable_only or _severity(head[2], head[3], more, head[1]):
                records.append(LogRecord(head[0], source_of(head[1]), head[1], head[2], head[3], tuple(more),
                                         head[4], count))
            count += 1
        if line is not None:
            head, more = ((_stamp_time(m[1]), int(m[2]), m[3], m[4], m[1]) if m else (None, rank, "", line, "")), []
    return records


@lru_cache(maxsize=65536)
def _stamp_time(stamp: str) -> float | None:
    date, _, rest = stamp.partition(" ")
    clock, _, fraction = rest.partition(",")
    return _epoch(date, clock, fraction or None)


def _rank_errors(logs: Path, rank: int | None) -> list[RankError]:
    """Every error record (``rank-N.error.json``, the nodes' ``errors-A-B.jsonl``), earliest first, identical
    errors (digits aside) folded into the first: one record and the list of the other ranks, however many ranks
    failed alike (built once, not copied per rank)."""
    found = []
    listing = _listing(logs)
    names = [name for name in listing if fnmatchcase(name, RANK_ERROR_GLOB)]
    folder = str(logs)
    records: list[Any] = node_error_records(logs, listing, rank)  # the nodes' files, where agents keep them
    for name in names if rank is None else [rank_error_path(logs.parent, rank).name]:
        try:
            records.append(parse_json(read_text(f"{folder}/{name}")))  # numbers in range, or it is skipped
        except ValueError:
            continue
    for data in records:
        if not isinstance(data, dict) or not isinstance(data.get("rank"), int) or isinstance(data["rank"], bool):
            continue
        if rank is not None and data["rank"] != rank:
            continue
        when = data.get("time")
        tb = str(data.get("traceback", ""))
        frames = _FRAME.findall(tb)
        where = f"{_last_parts(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]}" if frames else ""
        found.append(RankError(data["rank"], str(data.get("host", "")), time_value(when), str(data.get("error", "")),
                               where, tb))
    found.sort(key=lambda e: (e.time if e.time is not None else float("inf"), e.rank))
    folded: dict[str, tuple[RankError, list[int]]] = {}
    for error in found:
        key = _DIGITS.sub("#", error.error)
        if key in folded:
            folded[key][1].append(error.rank)
        else:
            folded[key] = (error, [])
    return [replace(first, same_ranks=tuple(same)) if same else first for first, same in folded.values()]


@lru_cache(maxsize=1024)
def _last_parts(path: str) -> str:
    """``distributed/faults.py`` of a frame's file: once per file, not per rank (a ``Path`` costs 10 us)."""
    return "/".join(Path(path).parts[-2:])


def _listing(folder: Path) -> list[str]:
    """The names in ``folder``, never through a link (``logs/`` a link to another place lists nothing)."""
    return folder_names(folder)


def _fold(records: list[LogRecord]) -> list[tuple[LogRecord, list[str]]]:
    """Rank records that differ only in numbers (ports, ranks, times) shown once, naming the other ranks; other
    records only when their text is the same (srun's "n1: task 0" and "n2: task 1" are two facts)."""
    folded: dict[str, tuple[LogRecord, list[str]]] = {}
    lines: dict[str, str] = {}  # each distinct line with its digits folded, once: ranks' tracebacks share most

    def fold(line: str) -> str:
        if (key := lines.get(line)) is None:
            key = lines[line] = _DIGITS.sub("#", line)
        return key

    for record in records:
        if record.rank is not None:  # digits never span lines: the same key as folding the joined text
            key = "\n".join([fold(record.level), fold(record.text), *map(fold, record.more)])
        else:
            key = "batch\0" + _ANY_STAMP.sub("", "\n".join([record.level, record.text, *record.more]))
        if key in folded:
            folded[key][1].append(record.source)
        else:
            folded[key] = (record, [])
    return list(folded.values())


def _rank_logs(logs: Path) -> list[tuple[range, str]]:
    """(the ranks it holds, name) of every node's log (``ranks-A-B.log``) and older one-rank log (``rank-N.log``),
    by first rank, from one listing (a ``Path`` per file costs more than reading it)."""
    found = [(held, name) for name in _listing(logs)
             if (held := log_ranks(name)) is not None]  # (a name claiming over a node's ranks is none)
    return sorted(found, key=lambda item: (item[0].start, item[1]))


def merged_view(run_dir: Path, rank: int | None = None, errors_only: bool = False,
                tail: int | None = None) -> MergedLogs:
    """Read ``RUN_DIR/logs``: the rank errors, the error records, and the merged timeline (its last ``tail``
    records when given). ``rank`` keeps one rank's files only (no batch output)."""
    with held_folders():  # logs/ opened once for its thousands of files
        return _merged_view(Path(run_dir), rank, errors_only, tail)


def _merged_view(run_dir: Path, rank: int | None, errors_only: bool, tail: int | None) -> MergedLogs:
    logs = run_dir / LOGS_DIR
    refuse_link(run_dir)
    if os.path.islink(logs):
        raise ConfigError("RUN_DIR", f"{logs} is a symbolic link; hpc_train never reads a run folder's files "
                          "through one", f"remove the link (rm {logs}); the ranks make logs/ again")
    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} is not a folder", "give a run folder, like runs/tiny-gpt")
    if not logs.is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} has no logs/ folder", "give a run folder (it holds plan.json and "
                          "logs/), like runs/tiny-gpt")
    if tail is not None and tail < 0:
        raise ConfigError("--tail", f"{tail} is negative", "give the number of records to show, like --tail 50")
    view = MergedLogs(run_dir)
    every_log = _rank_logs(logs)
    rank_logs = [(held, name) for held, name in every_log if rank is None or rank in held]
    if rank is not None and not rank_logs and run_file_stat(rank_error_path(run_dir, rank)) is None \
            and not node_error_records(logs, folder_names(logs), rank):
        ranks = ranges(sorted({number for held, _ in every_log for number in held}))
        raise ConfigError("--rank", f"{run_dir} has no log of rank {rank}", f"pick one of: {ranks or 'none'}")
    # (path, the ranks a rank log holds, source of its records, its name among the sources)
    files: list[tuple[Path | str, range | None, str, str]] = [
        (os.path.join(logs, name), held, f"rank{held.start}", name) for held, name in rank_logs]
    if rank is None:  # the batch output, listed never through a link
        files += [(logs / n, None, n, n) for n in sorted(_listing(logs)) if n.startswith("slurm-")
                  and n.endswith((".out", ".err"))]
        files += [(run_dir / SUBMITIT_DIR / n, None, name, name) for n in sorted(_listing(run_dir / SUBMITIT_DIR))
                  if fnmatchcase(n, "*_log.err") for name in [f"submitit/{n.removesuffix('_log.err')}.err"]]
    records: list[LogRecord] = []
    for path, held, source, listed in files:
        one = held.start if held is not None and len(held) == 1 else None  # an older one-rank log
        found = read_records(path, source, one, view.notes, notable_only=errors_only, holds=held, only_rank=rank)
        records += [r for r in found if r.severity] if errors_only and held is None else found
        view.sources.append(listed)
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
            out.append(f"    the same error on rank {ranges(error.same_ranks)}")
    width = max((len(r.source) for r in [*(r for r, _ in view.error_records), *view.timeline]), default=5)
    if view.error_records:
        out.append("-- error and warning records, earliest first --")
        for record, same in view.error_records:
            out += _prefixed([record], width)
            if same:
                out.append(f"{'':>{width}} | (the same in {_sources(same)})")
    if view.timeline:
        out.append(f"== timeline: {len(view.timeline)} records from {', '.join(view.sources)} ==")
        out += _prefixed(view.timeline, width)
    out += [f"note: {note}" for note in view.notes]
    return "\n".join(out)


def _sources(names: list[str]) -> str:
    """``rank0, rank1, rank2, rank7, slurm-12.err`` as ``ranks 0-2,7, slurm-12.err``: 16,384 ranks in a few
    characters when they failed alike."""
    ranks = [int(name[4:]) for name in names if name.startswith("rank") and name[4:].isdigit()]
    others = [name for name in names if not (name.startswith("rank") and name[4:].isdigit())]
    said = [f"rank{ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"] if ranks else []
    return ", ".join([*said, *others])


def _prefixed(records: list[LogRecord], width: int) -> list[str]:
    return [f"{record.source:>{width}} | {line}" for record in records for line in record.lines()]
