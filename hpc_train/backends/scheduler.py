"""What Slurm says about a set of runs: ONE ``squeue`` call and ONE ``sacct`` call per poll, for every run shown.

Why batched: a status view of ten runs polled every 10 s would otherwise start twenty scheduler clients a poll, and
busy controllers throttle users who do that. Why ``squeue --me`` (not ``--jobs``): a job that was just submitted
(still PENDING, no rank has written anything yet) is found by its output path or working folder inside the run
folder, so it shows before any job id reached the run folder. Why ``sacct --duplicates``: a requeued job keeps its
id; ``-D`` gives one record per attempt (with its job steps), so each attempt can be classified on its own.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["QueueEntry", "SchedulerAnswer", "SlurmRecord", "StepRecord", "parse_duration", "parse_sacct",
           "parse_squeue", "poll", "queue_matches", "sacct_argv", "squeue_argv"]

TIMEOUT_S = 20
_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
SACCT_FIELDS = ("JobID", "JobIDRaw", "State", "ExitCode", "NodeList", "Reason", "Start", "End", "Elapsed",
                "Timelimit")
SQUEUE_FIELDS = ("JobID", "JobArrayID", "State", "NodeList", "Reason", "StdOut", "WorkDir", "Name", "TimeUsed",
                 "TimeLimit")
Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class StepRecord:
    """One job step of an attempt (``123.0``, ``123.batch``): where the ranks' own exit status shows."""

    step: str
    state: str
    exit_code: str = "0:0"
    nodes: str = ""


@dataclass(frozen=True)
class SlurmRecord:
    """One attempt of a job as sacct reports it (``State`` keeps its words, e.g. ``CANCELLED by 1000``)."""

    job_id: str
    state: str
    exit_code: str = "0:0"
    nodes: str = ""
    reason: str = ""
    start: str = ""
    end: str = ""
    elapsed_s: float | None = None
    limit_s: float | None = None
    raw_id: str = ""
    steps: tuple[StepRecord, ...] = ()

    @property
    def base_state(self) -> str:
        """``CANCELLED by 0`` -> ``CANCELLED``; empty -> ``UNKNOWN``."""
        return self.state.split()[0].rstrip("+").upper() if self.state.strip() else "UNKNOWN"

    def exit_statuses(self) -> list[tuple[int, int]]:
        """``(return code, signal)`` of the allocation and every step, steps first: the ranks' status is there."""
        found = []
        for text in [*(s.exit_code for s in self.steps), self.exit_code]:
            rc, _, sig = text.partition(":")
            if (rc.isascii() and rc.isdigit()):
                found.append((int(rc), int(sig) if (sig.isascii() and sig.isdigit()) else 0))
        return found


@dataclass(frozen=True)
class QueueEntry:
    """One job in ``squeue`` (pending, running, completing, requeued)."""

    job_id: str
    array_id: str
    state: str
    nodes: str
    reason: str
    stdout: str = ""
    workdir: str = ""
    name: str = ""
    time_used: str = ""
    time_limit: str = ""

    def ids(self) -> set[str]:
        return {i for i in (self.job_id, self.array_id) if i}


@dataclass
class SchedulerAnswer:
    """One poll: the user's queue, the accounting history of the asked jobs, and why either is missing."""

    available: bool
    notes: list[str] = field(default_factory=list)
    queue: list[QueueEntry] = field(default_factory=list)
    history: dict[str, list[SlurmRecord]] = field(default_factory=dict)
    calls: int = 0

    def queued(self, job_id: str) -> QueueEntry | None:
        return next((entry for entry in self.queue if job_id in entry.ids()), None)

    def last_record(self, job_id: str) -> SlurmRecord | None:
        records = self.history.get(job_id)
        return records[-1] if records else None


def parse_duration(text: str) -> float | None:
    """Seconds of a Slurm duration: ``1-02:03:04``, ``02:03:04``, ``03:04``, ``5``; None for UNLIMITED and the like."""
    text = text.strip()
    days = 0
    if "-" in text:
        day_text, _, text = text.partition("-")
        if not (day_text.isascii() and day_text.isdigit()):
            return None
        days = int(day_text)
    parts = text.split(":")
    if not text or len(parts) > 3 or not all((p.isascii() and p.isdigit()) for p in parts):
        return None
    if len(parts) == 1:  # plain minutes (a time limit)
        return days * 86400 + int(parts[0]) * 60.0
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return days * 86400 + float(seconds)


def parse_sacct(text: str) -> dict[str, list[SlurmRecord]]:
    """``sacct --parsable2 --noheader --duplicates`` rows in :data:`SACCT_FIELDS` order, as records per job id
    (one per attempt, oldest first; each step row belongs to the allocation row above it). Each list is filed
    under the job id and under the raw id (an array task ``531_0`` is also job ``532``)."""
    rows: list[tuple[SlurmRecord, list[StepRecord]]] = []
    open_steps: dict[str, list[StepRecord]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < len(SACCT_FIELDS):
            continue
        job_id, raw_id, state, exit_code, nodes, reason, start, end, elapsed, limit = parts[:len(SACCT_FIELDS)]
        base, dot, step = job_id.partition(".")
        if dot:
            open_steps.get(base, []).append(StepRecord(step, state, exit_code, nodes))
            continue
        steps: list[StepRecord] = []
        open_steps[job_id] = steps
        rows.append((SlurmRecord(job_id, state, exit_code, nodes, "" if reason == "None" else reason, start, end,
                                 parse_duration(elapsed), parse_duration(limit), raw_id.partition(".")[0]), steps))
    history: dict[str, list[SlurmRecord]] = {}
    for record, steps in rows:
        history.setdefault(record.job_id, []).append(replace(record, steps=tuple(steps)))
    for job_id, records in list(history.items()):
        raw = records[-1].raw_id
        if raw and raw != job_id:
            history.setdefault(raw, records)
    return history


def parse_squeue(text: str) -> list[QueueEntry]:
    """``squeue -h -O FIELD:|,...`` rows in :data:`SQUEUE_FIELDS` order."""
    entries = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < len(SQUEUE_FIELDS):
            continue
        job_id, array_id, state, nodes, reason, stdout, workdir, name, used, limit = (
            p.strip() for p in parts[:len(SQUEUE_FIELDS)])
        entries.append(QueueEntry(job_id, array_id if array_id != "N/A" else "", state, nodes,
                                  "" if reason == "None" else reason, stdout, workdir, name, used, limit))
    return entries


def squeue_argv() -> list[str]:
    """Every job of this user, one row each; ``|`` after each field (squeue pads otherwise)."""
    return ["squeue", "--me", "--noheader", "--array", "-O", ",".join(f"{name}:|" for name in SQUEUE_FIELDS)]


def sacct_argv(job_ids: Iterable[str]) -> list[str]:
    """Every attempt (``--duplicates``) and step of ``job_ids``; with ``--jobs`` sacct looks back to the epoch."""
    return ["sacct", "--noheader", "--parsable2", "--duplicates", "--jobs", ",".join(job_ids),
            f"--format={','.join(SACCT_FIELDS)}"]


def queue_matches(entry: QueueEntry, run_dir: Path) -> bool:
    """Whether a queued job belongs to ``run_dir``: its output goes there (submitit: ``RUN/submitit/``; sbatch:
    ``RUN/logs/slurm-%j.out``) or it runs in it (rendered scripts ``--chdir`` into the run folder)."""
    root = str(Path(run_dir).resolve())
    return entry.workdir.rstrip("/") == root or entry.stdout.startswith(root + "/")


def _default_run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def _call(run: Runner, argv: list[str], answer: SchedulerAnswer) -> str | None:
    answer.calls += 1
    try:
        result = run(argv)
    except subprocess.TimeoutExpired:
        answer.notes.append(f"{argv[0]} did not answer within {TIMEOUT_S} s (is the controller busy?)")
        return None
    except OSError as error:
        answer.notes.append(f"{argv[0]} failed: {error}")
        return None
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        answer.notes.append(f"{argv[0]} failed: {detail[-1] if detail else f'exit status {result.returncode}'}")
        return None
    return result.stdout


def poll(job_ids: Collection[str], run_dirs: Collection[Path], run: Runner | None = None,
         which: Callable[[str], str | None] | None = None) -> SchedulerAnswer:
    """One ``squeue`` and (when there is any job to ask about) one ``sacct`` call for all runs.

    ``job_ids``: the ids the run folders recorded; queued jobs whose output or working folder lies in one of
    ``run_dirs`` are asked about too. Without Slurm on PATH nothing is called and ``available`` is False.
    """
    run = run or _default_run
    which = which or shutil.which
    if which("squeue") is None or which("sacct") is None:
        return SchedulerAnswer(False, ["Slurm is not available here (squeue/sacct not on PATH): showing what the "
                                       "run folders say"])
    answer = SchedulerAnswer(True)
    text = _call(run, squeue_argv(), answer)
    if text is not None:
        answer.queue = parse_squeue(text)
    wanted = {i for i in job_ids if _JOB_ID.fullmatch(i)}
    for entry in answer.queue:
        if any(queue_matches(entry, run_dir) for run_dir in run_dirs):
            wanted |= {i for i in entry.ids() if _JOB_ID.fullmatch(i)}
    if wanted:
        text = _call(run, sacct_argv(sorted(wanted, key=_id_key)), answer)
        if text is not None:
            answer.history = parse_sacct(text)
    return answer


def _id_key(job_id: str) -> tuple[int, int]:
    base, _, task = job_id.partition("_")
    return int(base), int(task or -1)
