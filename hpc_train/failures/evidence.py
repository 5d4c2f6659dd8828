"""Reading the run folder into evidence: what the ranks of one attempt left behind, for :mod:`.classify`.

A node's log holds every attempt of its ranks (it is appended to), error and stack files are rewritten by each
attempt, and Slurm appends each requeue's batch output to the same files; this module cuts out the one attempt
asked for.
Nothing here judges the evidence: :func:`hpc_train.failures.classify.classify` does, as a pure function.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Collection
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from hpc_train.failures.records import RankFiles, line_time, read_json, read_tail
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.error_log import error_log_ranks, read_error_log
from hpc_train.run.error_records import kept_path, record_is_of
from hpc_train.run.files import (
    folder_names,
    held_folders,
    read_json_object,
    read_record_text,
    run_file_stat,
    small_int,
    time_value,
)
from hpc_train.run.loglines import BATCH_START, RANK_RECORD, parse_start
from hpc_train.run.node_log import log_ranks
from hpc_train.run.node_span import MAX_RANKS_A_NODE
from hpc_train.run.paths import (
    LOGS_DIR,
    PLAN_FILE,
    SUBMITIT_DIR,
    follower_cancel_path,
    rank_error_path,
    stacks_path,
)

__all__ = ["SRUN_ERROR", "Evidence", "RankReport", "collect_evidence", "ranks_per_task", "srun_tasks", "task_ranks"]

_TAIL_BYTES = 1 << 20
_KEPT = "prev-"  # a record kept aside for the look-back (hpc_train.run.error_records)
_RANK_FILE = re.compile(r"(stacks-)?rank-([0-9]{1,9})\.")  # a rank's log, error record, stacks (logs/ holds them)
SRUN_ERROR = re.compile(r"srun: error: (\S+): tasks? ([0-9,\-]+): (.+)")  # srun on a task that failed
_MAX_TASKS = 1 << 18  # hpc_train's largest world: srun's "tasks 0-99999999999" is damage, not a range to walk


@dataclass(frozen=True)
class RankReport:
    """What one rank left behind in one attempt."""

    rank: int
    host: str = ""
    node_index: int | None = None
    error: str = ""
    error_time: float | None = None
    traceback: str = ""
    log_tail: tuple[str, ...] = ()
    stacks: str = ""
    stderr: tuple[str, ...] = ()
    launcher: str = ""


@dataclass(frozen=True)
class Evidence:
    """The run folder's side of one attempt (see :func:`collect_evidence`)."""

    ranks: tuple[RankReport, ...] = ()
    batch_log: str = ""
    outcome: str = ""  # what rank 0 wrote into attempts.jsonl for this attempt (hang, preempted, failed, ...)
    note: str = ""
    cancelled_by: str = ""  # who cancelled this job through hpc_train and why (logs/follower-cancel.json)
    ranks_per_task: int = 1  # an srun task's ranks: a node's where its agent starts them (Plan.node_agents)


def collect_evidence(run_dir: Path, job_id: str | None = None, restart: int | None = None,
                     tail_lines: int = 200, ranks: Collection[int] | None = None) -> Evidence:
    """What the ranks of one attempt left in ``run_dir``: error files, the attempt's log lines, dumped stacks and
    the batch output of ``job_id`` (Slurm's ``logs/slurm-JOB.*``, submitit's ``submitit/JOB_*_log.err``).

    A rank log holds every attempt (it is appended to); the attempt's part starts at its "start: ... job J restart
    R" line. Without ``job_id`` the newest part of each log is read. Error and stack files are per rank, rewritten
    by each attempt, so they count only when the attempt asked for is that rank's newest one. ``ranks``: read only
    these ranks' files and those of the ranks the batch output names (srun's failed tasks, ``[rankN]:`` lines),
    not every rank's: the look-back of a requeued attempt reads the ranks that left an error record.
    """
    with held_folders():  # logs/ opened once for its thousands of files
        return _collect(Path(run_dir), job_id, restart, tail_lines, ranks)


def _collect(run_dir: Path, job_id: str | None, restart: int | None, tail_lines: int,
             ranks: Collection[int] | None) -> Evidence:
    batch = _batch_log(run_dir, job_id, restart, tail_lines)
    stderr: dict[int, list[str]] = {}
    for line in batch.splitlines():
        if m := re.match(r"\[rank([0-9]{1,9})\]:(.*)", line):
            stderr.setdefault(int(m[1]), []).append(m[2])
    names = (RankFiles(run_dir, rank_error_path), RankFiles(run_dir, stacks_path), RankFiles(run_dir, kept_path))
    logs = _RankLogs(run_dir / LOGS_DIR)
    node_errors = _NodeErrors(run_dir / LOGS_DIR)
    files = _rank_files(run_dir / LOGS_DIR, names[0], names[1], logs, node_errors)
    per_task = ranks_per_task(run_dir)
    named = {rank for task in srun_tasks(batch) for rank in range(task * per_task, (task + 1) * per_task)}
    chosen = set(files) if ranks is None else set(files) & {*ranks, *named}
    reports = [report for rank in sorted(chosen | set(stderr))
               if (report := _rank_report(rank, files.get(rank, ""), logs, names, stderr.get(rank, []), job_id,
                                          restart, tail_lines, node_errors)) is not None]
    attempts = [a for a in AttemptLog(run_dir).read()
                if job_id is None or (a.job_id == job_id and (restart is None or a.restart == restart))]
    last = attempts[-1] if attempts else None
    return Evidence(tuple(reports), batch, last.outcome if last else "", last.note if last else "",
                    _follower_cancel(run_dir, job_id), per_task)


def ranks_per_task(run_dir: Path) -> int:
    """How many ranks one srun task of the run holds: where a node's agent starts them (``retry.in_place``,
    :attr:`Plan.node_agents`) srun's task T is node T, with ``job.tasks_per_node`` ranks; else one."""
    from hpc_train.config.plan import Plan

    try:
        plan = Plan.from_json(read_record_text(run_dir / PLAN_FILE))
    except Exception:  # no plan, or a damaged one: srun's tasks are taken for ranks, as before agents per node
        return 1
    per_node = plan.resources.tasks_per_node  # (the ranks of torchrun and mpirun name their launcher: their
    return per_node if plan.node_agents and 0 < per_node <= MAX_RANKS_A_NODE else 1  # srun lines are not read)


def task_ranks(tasks: dict[int, tuple[str, str, str]], per_task: int, reports: Collection[RankReport]
               ) -> dict[int, tuple[str, str, str]]:
    """srun's failed tasks as ranks. With a node's agent as the task, the rank its words are about is the one of
    its node that left no error record (the one that died without a word), else the node's first."""
    if per_task == 1:
        return tasks
    silent = {report.rank for report in reports if not report.error and not report.traceback}
    out: dict[int, tuple[str, str, str]] = {}
    for task, said in tasks.items():
        ranks = range(task * per_task, (task + 1) * per_task)
        quiet = [rank for rank in ranks if rank in silent]
        out.setdefault(quiet[0] if len(quiet) == 1 else ranks[0], said)
    return out


class _RankLogs:
    """A rank's lines in the logs that hold it (its node's ``ranks-A-B.log``; an older ``rank-N.log`` first), each
    file read once (its last ``_TAIL_BYTES`` per rank it holds) and split by rank. Ranks are asked for in order,
    and a node's ranks are consecutive: only the few files read last are kept."""

    def __init__(self, logs: Path) -> None:
        self.logs = str(logs)
        self.holding: dict[int, list[str]] = {}  # rank: the names of the logs that hold it
        self._split: dict[str, dict[int, list[str]]] = {}

    def add(self, name: str) -> range | None:
        """Take ``name`` from the listing when it is a rank log; the ranks it holds."""
        held = log_ranks(name)  # a name that claims more ranks than a node runs is not a node's log
        if held is not None:
            for rank in held:
                self.holding.setdefault(rank, []).append(name)
        return held

    def lines(self, rank: int) -> list[str]:
        names = self.holding.get(rank)
        if not names:
            return []
        if len(names) == 1:
            return self._lines_of(names[0]).get(rank, [])
        found: list[str] = []
        for name in sorted(names, key=lambda name: not name.startswith("rank-")):
            found += self._lines_of(name).get(rank, [])
        return found

    def _lines_of(self, name: str) -> dict[int, list[str]]:
        """``{rank: its lines}`` of one log, read once (a record's lines after its first are its rank's)."""
        split = self._split.get(name)
        if split is not None:
            return split
        if len(self._split) >= 4:
            self._split.clear()
        held = log_ranks(name) or range(0)
        text = read_tail(f"{self.logs}/{name}", _TAIL_BYTES * max(1, len(held)))
        split = self._split[name] = {}
        owner = held.start if len(held) == 1 else None
        current: list[str] | None = split.setdefault(owner, []) if owner is not None else None
        match = RANK_RECORD.match
        for line in text.splitlines():
            if line[:1].isdigit() and (m := match(line)) and len(m[2]) <= 9 and int(m[2]) != owner:
                owner = int(m[2])
                current = split.setdefault(owner, [])
            if current is not None:
                current.append(line)
        return split


class _NodeErrors:
    """The nodes' error logs (``errors-A-B.jsonl``, and ``prev-errors-A-B.jsonl`` kept aside for the look-back:
    :mod:`hpc_train.run.error_log`), each read once, when one of its ranks is asked for."""

    def __init__(self, logs: Path) -> None:
        self.logs = str(logs)
        self.holding: dict[tuple[int, bool], str] = {}  # (rank, kept): the name of the file that may hold it
        self._read: dict[str, dict[int, dict[str, Any]]] = {}

    def add(self, name: str) -> range | None:
        held = error_log_ranks(name)
        if held is not None:
            for rank in held:
                self.holding[(rank, name.startswith("prev-"))] = name
        return held

    def record(self, rank: int, kept: bool) -> dict[str, Any]:
        name = self.holding.get((rank, kept))
        if name is None:
            return {}
        if name not in self._read:
            if len(self._read) >= 4:  # ranks come in order and a node's are consecutive
                self._read.clear()
            self._read[name] = read_error_log(f"{self.logs}/{name}")
        return self._read[name].get(rank, {})


def _rank_files(logs: Path, errors: RankFiles, stacks: RankFiles, rank_logs: _RankLogs,
                node_errors: _NodeErrors) -> dict[int, str]:
    """``{rank: its kinds of file}`` from one listing of ``logs/``: "e" its error record, "s" its dumped stacks,
    "k" a record kept aside, "n" and "p" its node's error log and one kept aside, "l" a log that holds it (its
    node's); the logs go into ``rank_logs``, the nodes' error logs into ``node_errors``."""
    found: dict[int, str] = {}
    for name in folder_names(logs):  # never through a link: logs/ a link lists nothing
        if (held := rank_logs.add(name)) is not None:
            for rank in held:
                found[rank] = found.get(rank, "") + "l"
            continue
        if name.endswith(".jsonl") and (held := node_errors.add(name)) is not None:
            kind = "p" if name.startswith("prev-") else "n"
            for rank in held:
                found[rank] = found.get(rank, "") + kind
            continue
        kept = name.startswith(_KEPT)
        if "rank-" in name and (m := _RANK_FILE.match(name.removeprefix(_KEPT) if kept else name)):
            rank = int(m[2])
            kind = "k" if kept else "e" if name == errors.name(rank) else "s" if name == stacks.name(rank) else "l"
            found[rank] = found.get(rank, "") + kind
    return found


def _rank_report(rank: int, kinds: str, logs: _RankLogs, names: tuple[RankFiles, ...], stderr: list[str],
                 job_id: str | None, restart: int | None, tail_lines: int, node_errors: _NodeErrors
                 ) -> RankReport | None:
    """One rank's part of the attempt, or None when it left nothing of it. Files the listing did not show are
    not opened (an error record or stacks written since belong to the next poll)."""
    error_file, stacks_file, kept_file = (name(rank) for name in names)
    part = _segment(logs.lines(rank) if "l" in kinds else [], job_id, restart)
    current = read_json(error_file) if "e" in kinds else node_errors.record(rank, False) if "n" in kinds else {}
    kept = read_json(kept_file) if "k" in kinds else node_errors.record(rank, True) if "p" in kinds else {}
    error = _attempt_error(current, kept, part.newest, job_id, restart)
    stacks = ""
    if part.newest and "s" in kinds and _after(stacks_file, part.started()):
        stacks = read_tail(stacks_file, _TAIL_BYTES)
    if not part.lines and not error and not stacks and not stderr:
        return None
    when = error.get("time")
    return RankReport(
        rank=rank, host=str(error.get("host", "")), node_index=part.node_index, error=str(error.get("error", "")),
        error_time=time_value(when),
        traceback=str(error.get("traceback", "")), log_tail=tuple(part.lines[-tail_lines:]), stacks=stacks,
        stderr=tuple(stderr[-tail_lines:]), launcher=part.launcher)


def _attempt_error(current: dict[str, Any], kept: dict[str, Any], newest: bool, job_id: str | None,
                   restart: int | None) -> dict[str, Any]:
    """The rank's error record of the attempt asked for. A record stamped with its job and restart counts when
    it is that attempt's (a requeued attempt's ranks move their last record aside to ``prev-rank-N.error.json``
    as they start, so the look-back finds it there); an older, unstamped one only when the attempt asked for is
    the rank's newest part of its log."""
    record = current
    if record and (record_is_of(record, job_id, restart) if "job_id" in record and job_id is not None else newest):
        return record
    if kept and job_id is not None and record_is_of(kept, job_id, restart):
        return kept
    return {}


def _follower_cancel(run_dir: Path, job_id: str | None) -> str:
    """Who cancelled ``job_id`` through hpc_train and why: its follower, or the user (``Job.cancel()``), so that
    ``status`` names them, not a uid."""
    record = read_json_object(follower_cancel_path(run_dir))
    if job_id is None or job_id not in (str(record.get("job_id", "")), str(record.get("attempt_job_id", ""))):
        return ""
    reason = str(record.get("reason", ""))[:500] or "no reason recorded"
    if record.get("by") == "user":
        return f"by the user: {reason}"
    return f"by hpc_train's follower on the login node: {reason}"


@dataclass(frozen=True)
class _Segment:
    lines: list[str]
    newest: bool
    node_index: int | None = None
    launcher: str = ""

    def started(self) -> float | None:
        """When the attempt's start line was logged (read only where stacks need it)."""
        return line_time(self.lines[0]) if self.node_index is not None and self.lines else None


def _segment(lines: list[str], job_id: str | None, restart: int | None) -> _Segment:
    """One attempt's lines of a rank log (from its start line to the next one), and what the start line says."""
    starts = [(i, s) for i, line in enumerate(lines) if "start: " in line and (s := parse_start(line)) is not None]
    if not starts:
        return _Segment(lines, True)
    chosen = len(starts) - 1
    if job_id is not None:
        matching = [k for k, (_, s) in enumerate(starts)
                    if s.job_id == job_id and (restart is None or s.restart == restart)]
        if not matching:
            return _Segment([], False)
        chosen = matching[-1]
    first, start = starts[chosen]
    end = starts[chosen + 1][0] if chosen + 1 < len(starts) else len(lines)
    return _Segment(lines[first:end], chosen == len(starts) - 1, start.node_rank, start.launcher)


def _after(path: str | Path, started: float | None) -> bool:
    info = run_file_stat(path)
    return info is not None and (started is None or info.st_mtime >= started - 1)


def _batch_log(run_dir: Path, job_id: str | None, restart: int | None, tail_lines: int) -> str:
    """The batch step's output of this job: where srun and slurmstepd say what happened to the tasks. A
    requeued job appends to the same files; each attempt starts at the template's "hpc_train: job J restart R"
    line or submitit's "Starting with JobEnvironment"."""
    if job_id:
        ident = glob.escape(job_id)
        patterns = [f"logs/slurm-{ident}.out", f"logs/slurm-{ident}.err", f"submitit/{ident}_*_log.err"]
    else:
        patterns = ["logs/slurm-*.out", "logs/slurm-*.err", "submitit/*_log.err"]
    names = [f"{folder}/{name}" for folder in (LOGS_DIR, SUBMITIT_DIR) for name in folder_names(run_dir / folder)]
    found = {run_dir / name: info for name in names if any(fnmatchcase(name, p) for p in patterns)
             if (info := run_file_stat(run_dir / name)) is not None}  # listed and read never through a link
    paths = sorted(found)
    if not job_id and paths:  # the newest job's files only
        newest = _file_job(max(paths, key=lambda p: found[p].st_mtime).name)
        paths = [p for p in paths if _file_job(p.name) == newest]
    parts = []
    for path in paths:
        lines = _read_tail(path).splitlines()
        marks = [i for i, line in enumerate(lines)
                 if BATCH_START.match(line) or "Starting with JobEnvironment" in line]
        if marks:
            index = restart if restart is not None and restart < len(marks) else len(marks) - 1
            lines = lines[marks[index]:marks[index + 1] if index + 1 < len(marks) else len(lines)]
        parts.extend(lines[-tail_lines:])
    return "\n".join(parts)


def _file_job(name: str) -> str:
    """The job id in ``slurm-123.err`` or ``123_0_log.err``."""
    if name.startswith("slurm-"):
        return name.removeprefix("slurm-").rsplit(".", 1)[0]
    return name.rsplit("_", 2)[0]


def _read_tail(path: Path, limit: int = _TAIL_BYTES) -> str:
    return read_tail(path, limit)


def srun_tasks(batch: str) -> dict[int, tuple[str, str, str]]:
    """``{task: (node, task list, message)}`` from srun's "srun: error: n1: task 1: Exited with exit code 1"."""
    tasks: dict[int, tuple[str, str, str]] = {}
    for m in SRUN_ERROR.finditer(batch):
        for part in m[2].split(","):
            low, _, high = part.partition("-")
            first, last = small_int(low), small_int(high or low)
            if first is not None and last is not None and last - first < _MAX_TASKS:
                for task in range(first, last + 1):
                    tasks.setdefault(task, (m[1], m[2], m[3]))
    return tasks
