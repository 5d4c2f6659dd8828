"""Follow submitted jobs to their end: live state, the rank-0 log as it grows, and one clear verdict.

Slurm state comes from one batched sacct call per poll for all followed jobs (:mod:`hpc_train.login.slurm.jobstate`);
the poll interval backs off while nothing changes. A rank that fails leaves its error record (a line of its node's
``logs/errors-FIRST-LAST.jsonl`` below a node's agent, else ``logs/rank-N.error.json``);
the follower reports it at once and, if the other ranks do not end by themselves, cancels the job, unless
anything is requeuing it (:mod:`hpc_train.login.slurm.cancel_policy`); either way it says why in one line, and a
cancel is recorded in the run folder so that ``status`` names the follower, not a uid.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from hpc_train.backends import executor_backend
from hpc_train.common.terminal import plain, ranges
from hpc_train.login.slurm.cancel_policy import CancelDecision, decide_cancel, failures_since, read_facts
from hpc_train.login.slurm.jobstate import SlurmQueryError, query_states
from hpc_train.run.attempts import Attempt, AttemptLog
from hpc_train.run.chain import successor_of
from hpc_train.run.error_log import error_logs, read_error_log
from hpc_train.run.files import (
    MAX_RECORD_FILE,
    atomic_write,
    folder_names,
    held_folders,
    open_folder,
    open_record,
    parse_json,
    read_json_object,
    read_record_text,
)
from hpc_train.run.node_log import node_log_path, split_by_rank
from hpc_train.run.paths import (
    LOGS_DIR,
    RANK_ERROR_GLOB,
    SUBMITIT_DIR,
    follower_cancel_path,
)

__all__ = ["FollowedJob", "LogTail", "follow", "poll", "record_cancel", "take_successor"]

_SUCCESS = {"COMPLETED"}
_CLOCK_SLACK_S = 30.0


class LogTail:
    """New lines of a growing file, read from where the last call stopped; with ``rank``, only that rank's
    records of a node's log (a record's lines after its first belong to the rank its first line names)."""

    def __init__(self, path: Path, offset: int = 0, rank: int | None = None) -> None:
        self.path = path
        self.offset = offset
        self.rank = rank
        self._owner: int | None = None  # the rank of the last record seen: its next lines are that rank's

    def new_lines(self) -> list[str]:
        """What was appended since the last call (at most MAX_RECORD_FILE a poll, whole lines: a record being
        written is read at the next poll), never through a link (``logs/`` or the log a link: another place's
        file), never blocking on a FIFO; control characters shown escaped."""
        try:
            with open_record(self.path) as handle:
                handle.seek(self.offset)
                data = handle.read(MAX_RECORD_FILE)
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) < MAX_RECORD_FILE:
            return []  # not one whole line yet
        data = data[:end or len(data)]
        self.offset += len(data)
        lines = data.decode("utf-8", errors="replace").splitlines()
        if self.rank is not None:
            owned = list(split_by_rank(lines, self._owner))
            self._owner = owned[-1][0] if owned else self._owner
            lines = [line for owner, line in owned if owner == self.rank]
        return [plain(line) for line in lines]


class ErrorRecords:
    """A run's ``rank-N.error.json`` records as the follower last read them: each poll lists ``logs/`` and stats
    the records, and reads again only a new or rewritten one (its inode, size or time changed). A poll of a job
    whose 16,384 ranks all failed costs a listing and 16,384 stats, not 16,384 reads of up to 16 MiB each
    (:func:`~hpc_train.login.slurm.cancel_policy.read_failures` gives the same records, reading every file)."""

    def __init__(self, run_dir: Path) -> None:
        self.logs = Path(run_dir) / LOGS_DIR
        self.seen: dict[str, tuple[tuple[int, int, int], list[dict[str, Any]]]] = {}

    def read(self, since: float = 0.0) -> list[dict[str, Any]]:
        """As ``read_failures(run_dir, since)``: the records written at or after ``since``, earliest first."""
        try:
            folder = open_folder(self.logs)  # never through a link: logs/ a link lists nothing
        except OSError:
            return []
        try:
            with held_folders():  # the new records' reads open logs/ once, not once each
                seen = self._stat_and_read(folder)
        finally:
            os.close(folder)
        self.seen = seen
        return failures_since(r for _, records in seen.values() for r in records)(since)

    def _stat_and_read(self, folder: int) -> dict[str, tuple[tuple[int, int, int], list[dict[str, Any]]]]:
        with os.scandir(folder) as listing:
            entries = sorted((e for e in listing if fnmatchcase(e.name, RANK_ERROR_GLOB) or error_logs([e.name])),
                             key=lambda e: e.name)
        seen: dict[str, tuple[tuple[int, int, int], list[dict[str, Any]]]] = {}
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (info.st_ino, info.st_size, info.st_mtime_ns)
            old = self.seen.get(entry.name)
            path = os.path.join(self.logs, entry.name)
            if old is not None and old[0] == key:
                seen[entry.name] = old
            elif entry.name.endswith(".jsonl"):  # a node's records: a torn last line is read at the next poll
                seen[entry.name] = (key, list(read_error_log(path).values()))
            elif (record := _read_error(path, info.st_size)) is not None:  # a torn one: read at the next poll
                seen[entry.name] = (key, [record])
        return seen


def _read_error(path: str, size: int) -> dict[str, Any] | None:
    """One error record through :func:`~hpc_train.run.files.open_record` (never a link, a FIFO or a device),
    read as far as its size says (bounded): None when it is unreadable, torn or not an object. ``path`` stays a
    string: a ``Path`` per record costs more than reading it."""
    try:
        with open_record(path) as handle:
            text = handle.read(min(size + 4096, MAX_RECORD_FILE)).decode("utf-8", errors="replace")
        record = parse_json(text)  # a number out of range: damage, like a torn record
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclass
class FollowedJob:
    """One submitted job (or array task) and its run folder."""

    job: Any
    run_dir: Path
    label: str = ""
    requeue: bool = False
    log_offset: int = 0
    state: str = "SUBMITTED"
    done: bool = False
    failed_at: float | None = None
    preempted_at: float | None = None
    submitted_at: float = field(default_factory=time.time)  # rank errors from before are an earlier job's
    kept_for: str = ""  # why the follower did not cancel, as last said
    first_failure_at: float | None = None  # monotonic: when a rank's failure was first seen
    tail: LogTail = field(init=False)
    errors: ErrorRecords = field(init=False)
    tasks_per_node: int = 1  # the plan's: rank 0's lines are in the log of the layout's first node

    def __post_init__(self) -> None:
        self.tail = LogTail(node_log_path(self.run_dir, 0, self.tasks_per_node), self.log_offset, rank=0)
        self.errors = ErrorRecords(self.run_dir)

    chained: str = ""  # the job of a dependency chain that now carries the run (hpc_train.run.chain)

    @property
    def job_id(self) -> str:
        return self.chained or str(self.job.job_id)

    @property
    def since(self) -> float:
        """Records written after this is this submission's (the compute nodes' clocks may lag the login node's)."""
        return self.submitted_at - _CLOCK_SLACK_S

    def rank_errors(self) -> list[dict[str, Any]]:
        """This job's ranks' failures, earliest first (consequences of a stop are not among them)."""
        return self.errors.read(self.since)

    def cancel_decision(self) -> CancelDecision:
        waited = time.monotonic() - self.first_failure_at if self.first_failure_at is not None else 0.0
        return decide_cancel(read_facts(self.run_dir, self.job_id, self.state, self.since, waited,
                                        failures=self.rank_errors()))


def poll(jobs: list[FollowedJob], executor: str) -> None:
    """Update every job's state: one sacct call for all Slurm jobs; local jobs ask their processes."""
    if executor_backend(executor).on_slurm:
        states = query_states([job.job_id for job in jobs if not job.done])
        for job in jobs:
            if job.job_id in states:
                job.state = states[job.job_id].state
                job.done = states[job.job_id].done and not _waiting_for_requeue(job)
        return
    for job in jobs:
        if not job.done:
            job.done = job.job.done()
            # one word for an end everywhere: status, sacct and the attempts say COMPLETED (submitit: FINISHED)
            job.state = job.job.state if not job.done else ("COMPLETED" if _local_ok(job) else "FAILED")


def _follow_chains(jobs: list[FollowedJob], console: Console) -> None:
    """A job that ended after submitting the next one of its chain (``[slurm] requeue = "dependency"``): follow
    that one from here, as the same run."""
    for job in jobs:
        ended = job.job_id
        successor = take_successor(job)
        if successor is not None:
            console.print(f"[bold]job {ended}[/]: goes on as job {successor} (a new job after this one: the "
                          "site's requeue = \"dependency\")")


def take_successor(job: FollowedJob) -> str | None:
    """When ``job`` ended having submitted the next job of its chain, follow that one instead; its id, or None."""
    successor = successor_of(job.run_dir, job.job_id) if job.done else None
    if successor is not None:
        job.chained, job.done, job.state, job.failed_at = successor, False, "PENDING", None
    return successor


def _waiting_for_requeue(job: FollowedJob, patience_s: float = 300.0) -> bool:
    """A preempted job, or one whose node failed, that Slurm requeues comes back PENDING: keep following it for
    a while."""
    if job.state not in ("PREEMPTED", "NODE_FAIL") or not job.requeue:
        job.preempted_at = None
        return False
    job.preempted_at = job.preempted_at or time.monotonic()
    return time.monotonic() - job.preempted_at < patience_s


def _local_ok(job: FollowedJob) -> bool:
    """A finished local job succeeded when it left a result that is not an error. One that ended without any
    (a rank that left through ``os._exit``: a hang, a crash) has failed now: submitit's ``results()`` would wait
    15 s for a result file a dead process can no longer write."""
    paths = getattr(job.job, "paths", None)
    if paths is not None and not paths.result_pickle.exists():
        return False
    try:
        job.job.results()
    except Exception:
        return False
    return True


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _stopped_attempt(run_dir: Path) -> Attempt | None:
    """The last attempt, when it saved after a signal and did not requeue (the ranks exited with status 75)."""
    attempts = AttemptLog(run_dir).read()
    last = attempts[-1] if attempts else None
    return last if last is not None and last.outcome == "preempted" and not last.requeued else None


def _hung_attempt(run_dir: Path) -> Attempt | None:
    """The last attempt, when the watchdog ended it as hung and it was not requeued (exit status 77)."""
    attempts = AttemptLog(run_dir).read()
    last = attempts[-1] if attempts else None
    return last if last is not None and last.outcome == "hang" and not last.requeued else None


def _cancelled_by_user(job: FollowedJob) -> str:
    """The reason the user gave hpc_train for cancelling this job (``hpc_train cancel``, ``Job.cancel()``,
    Ctrl-C to submit), or ""."""
    record = read_json_object(follower_cancel_path(job.run_dir))
    if record.get("by") != "user" or str(record.get("job_id", "")) != job.job_id:
        return ""
    return str(record.get("reason", ""))[:200] or "no reason recorded"


def _report_failure(console: Console, job: FollowedJob) -> None:
    errors = job.rank_errors()
    name = f"job {job.job_id}" + (f" ({job.label})" if job.label else "")
    by_user = "" if errors else _cancelled_by_user(job)
    if by_user:
        console.print(f"[bold yellow]{name} cancelled[/] by the user ({escape(by_user)}); the same command "
                      "resumes it from its last checkpoint")
        return
    hung = None if errors else _hung_attempt(job.run_dir)
    if hung is not None:
        console.print(f"[bold red]{name} hung[/]: {escape(hung.note)}. Every rank's Python stacks are in "
                      f"{escape(str(job.run_dir / 'logs'))}/stacks-rank-N.txt; the checkpoint of step "
                      f"{hung.start_step if hung.end_step is None else hung.end_step} or earlier is intact.")
        return
    stopped = None if errors else _stopped_attempt(job.run_dir)
    if stopped is not None:
        console.print(f"[bold yellow]{name} stopped[/] after {stopped.signal} and saved step {stopped.end_step}; "
                      f"not requeued: {escape(stopped.note)}. Run the same command again to resume.")
        return
    if errors:
        first = errors[0]
        ranks = _ranks(errors)
        console.print(f"[bold red]{name} failed[/]: rank {_shown(first.get('rank'))} on "
                      f"{_shown(first.get('host'))} raised {_shown(first.get('error'))} (failed ranks: {ranks}); "
                      f"state {job.state}")
        console.out(plain(_tail(str(first.get("traceback", "")))), highlight=False)
    else:
        console.print(f"[bold red]{name} failed[/]: state {job.state}, no rank reported an error")
        for folder, pattern in ((LOGS_DIR, "slurm-*.err"), (SUBMITIT_DIR, "*_0_log.err")):
            for file in sorted(n for n in folder_names(job.run_dir / folder) if fnmatchcase(n, pattern)):
                text = read_record_text(job.run_dir / folder / file)  # never a link, a FIFO, or unbounded
                if text.strip():
                    console.out(plain(f"--- {file}\n{_tail(text)}"), highlight=False)
    console.print(f"rank logs: {escape(str(job.run_dir / 'logs'))}")


def _shown(value: Any) -> str:
    """A value of an error record as text for the console: markup and control characters escaped, bounded."""
    return escape(plain(str(value)[:500]))


def _ranks(errors: list[dict[str, Any]]) -> str:
    """The failed ranks as ranges (``0-85,87-16383``); a rank that is not a number is named as it is."""
    said = [error.get("rank") for error in errors]
    numbers = [rank for rank in said if isinstance(rank, int) and not isinstance(rank, bool)]
    others = [_shown(str(rank)[:40]) for rank in said if not isinstance(rank, int) or isinstance(rank, bool)]
    return ", ".join(part for part in (ranges(numbers), *others) if part)


def _cancel_or_keep(console: Console, job: FollowedJob) -> None:
    """A rank failed and the others did not stop: cancel, unless the job is being requeued (then look again at
    the next poll). Says why in one line; a cancel is recorded for ``status``."""
    decision = job.cancel_decision()
    if not decision.cancel:
        if decision.reason != job.kept_for:
            console.print(f"[yellow]job {job.job_id}: not cancelled: {escape(decision.reason)}[/]")
        job.kept_for = decision.reason
        return
    console.print(f"[red]job {job.job_id}: cancelling it: {escape(decision.reason)}[/]")
    try:
        record_cancel(job.run_dir, job.job_id, "follower", decision.reason)
    except OSError as error:
        console.print(f"[yellow]could not record the cancel in the run folder: {escape(str(error))}[/]")
    job.job.cancel(check=False)
    job.failed_at = float("inf")


def record_cancel(run_dir: Path, job_id: str, by: str, reason: str) -> None:
    """Say in the run folder who cancelled the job through hpc_train (``follower`` or ``user``) and why, so that
    ``status`` names them and not a uid."""
    attempts = AttemptLog(run_dir).read()
    record = {"job_id": job_id, "attempt_job_id": attempts[-1].job_id if attempts else "", "time": time.time(),
              "by": by, "reason": reason}
    atomic_write(follower_cancel_path(run_dir), json.dumps(record) + "\n")


def follow(jobs: list[FollowedJob], executor: str, console: Console, poll_s: float = 0.5, max_poll_s: float = 5.0,
           cancel_after_s: float = 5.0, give_up_s: float = 120.0) -> int:
    """Follow until every job ends; 0 when all completed, else 1 (after reporting each failure).

    sacct failing for a moment (slurmdbd restarting) is waited out; after ``give_up_s`` of failures the
    follower stops with exit 1, and the jobs keep running.
    """
    delay = poll_s
    failing_since: float | None = None
    many = len(jobs) > 1
    status = console.status("waiting for the scheduler") if console.is_terminal else None
    if status:
        status.start()
    try:
        while True:
            before = [(job.state, job.done) for job in jobs]
            try:
                poll(jobs, executor)
                failing_since = None
            except SlurmQueryError as error:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > give_up_s:
                    ids = ",".join(job.job_id for job in jobs)
                    console.print(f"[bold red]lost track of job {ids}[/]: {escape(str(error))}. The job keeps "
                                  f"running: 'sacct -j {ids}' shows it; 'scancel {ids}' stops it.")
                    return 1
                console.print(f"[yellow]sacct failed, retrying: {escape(str(error).splitlines()[0])}[/]")
            changed = before != [(job.state, job.done) for job in jobs]
            for job, (old_state, _) in zip(jobs, before, strict=True):
                for line in job.tail.new_lines():  # what the ranks wrote before the state they ended in
                    changed = True
                    console.out(f"{job.label + ' ' if many else ''}rank0 | {line}", highlight=False)
                if job.state != old_state:
                    console.print(f"[bold]job {job.job_id}[/]{f' ({job.label})' if many else ''}: {job.state}")
                if not job.done and job.failed_at is None and job.rank_errors():
                    job.failed_at = job.first_failure_at = time.monotonic()
                    console.print(f"[red]job {job.job_id}: a rank failed; waiting for the others to stop[/]")
                if not job.done and job.failed_at and time.monotonic() - job.failed_at > cancel_after_s:
                    _cancel_or_keep(console, job)
            _follow_chains(jobs, console)  # after the ended job's last lines
            if status:
                status.update(", ".join(f"job {job.job_id}: {job.state}" for job in jobs))
            if all(job.done for job in jobs):
                break
            delay = poll_s if changed else min(max_poll_s, delay * 1.5)
            time.sleep(delay)
    finally:
        if status:
            status.stop()
    failed = [job for job in jobs if job.state not in _SUCCESS or job.rank_errors()]
    for job in failed:
        _report_failure(console, job)
    for job in jobs:
        if job not in failed:
            console.print(f"[bold green]job {job.job_id} completed[/]; run folder: {job.run_dir}")
    return 1 if failed else 0
