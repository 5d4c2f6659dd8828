"""``python -m hpc_train status [RUN_DIR ...]``: where each run stands, from the scheduler and the run folder.

One poll = one ``squeue`` + one ``sacct`` call for all runs shown (:mod:`hpc_train.backends.scheduler`), joined with
what each run folder says: ``metrics.jsonl`` (last step, loss, tokens/s, MFU, and the recent step rate for the
ETA), ``checkpoints/latest``, ``attempts.jsonl`` (the attempts timeline) and the rank evidence of a failed attempt
(:mod:`hpc_train.failures.classify`). Without Slurm the run-folder side is shown alone, and the view says so.

How a run folder names its jobs: ``attempts.jsonl`` (rank 0 writes the job id when an attempt starts), the file
names submitit writes at submit time (``submitit/JOB_submitted.pkl``, ``JOB_0_log.out``), Slurm's output files of a
rendered script (``logs/slurm-JOB.out``), and, for a job nothing has been written for yet, the queue itself: a
queued job whose output path or working folder lies in the run folder belongs to it. So a job submitted a second
ago shows as PENDING.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from hpc_train.backends import LocalBackend, executor_backend, scheduler
from hpc_train.common.terminal import plain, shown
from hpc_train.errors import ConfigError
from hpc_train.failures.classify import Classification, classify
from hpc_train.failures.evidence import collect_evidence
from hpc_train.login.ops.health_view import health_cell, health_lines, read_findings
from hpc_train.login.ops.status_files import RATE_RECORDS as _RATE_RECORDS
from hpc_train.login.ops.status_files import CheckpointState, checkpoint_state, metrics_tail
from hpc_train.run.attempts import Attempt, AttemptLog
from hpc_train.run.chain import successor_of
from hpc_train.run.error_log import error_logs
from hpc_train.run.exclusions import read_exclusions
from hpc_train.run.files import finite, folder_names, read_json_object, refuse_link, run_file_stat, small_int
from hpc_train.run.paths import (
    ATTEMPTS_FILE,
    LOGS_DIR,
    METRICS_FILE,
    PLAN_FILE,
    RANK_ERROR_GLOB,
    RESULT_FILES,
    SUBMITIT_DIR,
)

__all__ = ["AttemptView", "CheckpointState", "RunFolder", "RunStatus", "Telemetry", "build_status", "collect",
           "find_run_dirs", "read_folder", "render", "to_json"]

_SUBMITIT_FILE = re.compile(r"^([0-9]+(?:_[0-9]+)?)_(?:submitted\.pkl|submission\.sh|[0-9]+_log\.(?:out|err)|"
                            r"[0-9]+_result\.pkl)$")
_SLURM_FILE = re.compile(r"^slurm-([0-9]+(?:_[0-9]+)?)\.(?:out|err)$")
_JOB_ID = re.compile(r"[0-9]{1,18}(_[0-9]{1,9})?")  # a Slurm job id (an array task's too); more digits are damage
_ENDED_BADLY = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
                "DEADLINE", "KILLED", "STOPPED", "HUNG"}
_FAILED_OUTCOMES = ("failed", "killed", "crashed", "infrastructure", "hang")
_SPARK_POINTS = 24  # status --watch draws the loss of this many recent records
_SPARKS = "▁▂▃▄▅▆▇█"


def _has_job_ids(executor: str) -> bool:
    """Whether a run folder's jobs are Slurm's to ask about: every executor but the local one, a folder whose
    plan names none (torn, or another version's) included."""
    return executor_backend(executor) is not LocalBackend


def sparkline(values: list[float]) -> str:
    """``values`` as one line of block characters, lowest to highest ("" for fewer than 2)."""
    if len(values) < 2:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(_SPARKS[min(len(_SPARKS) - 1, int((v - low) / span * len(_SPARKS)))] for v in values)
_CLASSIFIED_ATTEMPTS = 5  # failed attempts explained per run, newest first


@dataclass
class Telemetry:
    """What rank 0's ``metrics.jsonl`` says, and the ETA from the recent step rate."""

    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    seconds_per_step: float | None = None
    eta_s: float | None = None
    updated: float | None = None
    losses: list[float] = field(default_factory=list)  # the recent records' loss, oldest first (the sparkline)


@dataclass
class AttemptView:
    """One line of ``attempts.jsonl``, with the failure class of an attempt that failed."""

    attempt: int
    job_id: str
    restart: int
    started: float
    ended: float | None
    outcome: str
    start_step: int
    end_step: int | None
    note: str = ""
    failure: dict[str, Any] | None = None
    in_place: int = 0  # the restart inside the same Slurm attempt (hpc_train.rank.agent.agent)


@dataclass
class RunFolder:
    """The run folder's side, read without the scheduler."""

    path: Path
    name: str
    executor: str
    program: str
    total_steps: int | None
    attempts: list[Attempt]
    job_ids: list[str]
    metrics: list[dict[str, Any]]
    checkpoint: CheckpointState | None
    excluded: list[str]
    notes: list[str] = field(default_factory=list)
    finished: str = ""  # smoke.json / train.json: "completed"; a rank error file: "failed"


@dataclass
class RunStatus:
    """One row of the view (``--json`` gives all of it)."""

    run_dir: str
    name: str
    executor: str
    state: str
    job_id: str
    nodes: str
    reason: str
    telemetry: Telemetry
    checkpoint: CheckpointState | None
    attempts: list[AttemptView]
    failure: Classification | None
    excluded: list[str]
    job_ids: list[str]
    notes: list[str]
    health: list[dict[str, Any]] | None = None  # health.json's findings (None: no record)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["failure"] = self.failure.to_dict() if self.failure else None
        return data


# -- the run folder ------------------------------------------------------------------------------------------


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """The run folders asked for (or every ``./runs/*`` with a ``plan.json``), each checked once."""
    if not paths:
        found = sorted(p.parent for p in Path("runs").glob("*/plan.json"))
        if not found:
            raise ConfigError("RUN_DIR", "none given, and ./runs holds no run folder",
                              "give run folders: python -m hpc_train status runs/NAME [runs/OTHER ...]")
        return found
    unique: list[Path] = []
    for path in paths:
        refuse_link(path)
        if not path.is_dir():
            raise ConfigError("RUN_DIR", f"{path} is not a folder", "give a run folder, like runs/tiny-gpt")
        if not any((path / name).exists() for name in (PLAN_FILE, ATTEMPTS_FILE, LOGS_DIR)):
            raise ConfigError("RUN_DIR", f"{path} is not a run folder (no plan.json, attempts.jsonl or logs/)",
                              "give a folder that submit or render made, like runs/tiny-gpt")
        if path.resolve() not in {p.resolve() for p in unique}:
            unique.append(path)
    return unique


def read_folder(path: Path) -> RunFolder:
    """Everything the view needs from one run folder; a file that is missing or torn leaves its part empty."""
    notes: list[str] = []
    plan = read_json_object(path / PLAN_FILE)
    config = plan.get("config", {}) if isinstance(plan.get("config"), dict) else {}
    steps = config.get("train", {}).get("steps") if isinstance(config.get("train"), dict) else None
    program = str(config.get("job", {}).get("program", "")) if isinstance(config.get("job"), dict) else ""
    if program not in ("", "train", "smoke"):
        steps = None  # a user program: train.steps is the built-in trainer's, its own total is unknown
    executor = str(plan.get("executor", ""))
    attempts = AttemptLog(path).read(warn=True)
    ids = _folder_job_ids(path, attempts) if _has_job_ids(executor) else []
    try:
        excluded = [e.node for e in read_exclusions(path)]
    except ConfigError as error:
        excluded, notes = [], [*notes, str(error)]
    finished = "completed" if any(run_file_stat(path / name) for name in RESULT_FILES) else ""
    logs = folder_names(path / LOGS_DIR)
    if not finished and (any(fnmatchcase(name, RANK_ERROR_GLOB) for name in logs) or error_logs(logs)):
        finished = "failed"
    return RunFolder(path, str(plan.get("name") or path.name), executor, program,
                     steps if isinstance(steps, int) else None, attempts, ids, metrics_tail(path / METRICS_FILE),
                     checkpoint_state(path), excluded, notes, finished)


def _folder_job_ids(path: Path, attempts: list[Attempt]) -> list[str]:
    ids = {a.job_id for a in attempts if a.job_id}
    ids |= {nxt for a in attempts if a.job_id and (nxt := successor_of(path, a.job_id))}  # a chain's next job
    for folder, pattern in ((path / SUBMITIT_DIR, _SUBMITIT_FILE), (path / LOGS_DIR, _SLURM_FILE)):
        ids |= {m[1] for name in folder_names(folder) if (m := pattern.match(name))}
    return sorted((i for i in ids if _JOB_ID.fullmatch(i)), key=_id_key)


def _id_key(job_id: str) -> tuple[int, int]:
    base, _, task = job_id.partition("_")
    return int(base), int(task or -1)


def telemetry(folder: RunFolder, since: float | None = None) -> Telemetry:
    """The last step's numbers, and the step rate over recent records written after ``since`` (the current
    attempt's start: a requeue's pause is not a slow step)."""
    info = Telemetry(total_steps=folder.total_steps)
    if not folder.metrics:
        return info
    last = folder.metrics[-1]
    info.step, info.updated = last["step"], _number(last.get("time"))
    info.loss, info.tokens_per_s, info.mfu = (_number(last.get(k)) for k in ("loss", "tokens_per_s", "mfu"))
    info.losses = [loss for r in folder.metrics[-_SPARK_POINTS:] if (loss := _number(r.get("loss"))) is not None]
    recent = [r for r in folder.metrics[-_RATE_RECORDS:] if _number(r.get("time")) is not None
              and (since is None or r["time"] >= since)]
    seconds = steps = 0.0
    for before, after in itertools.pairwise(recent):
        if after["step"] > before["step"] and after["time"] > before["time"]:
            seconds += after["time"] - before["time"]
            steps += after["step"] - before["step"]
    if steps:
        info.seconds_per_step = seconds / steps
    elif (step_time := _number(last.get("step_time_s"))) is not None:
        info.seconds_per_step = step_time
    if info.total_steps is not None and info.seconds_per_step is not None:
        info.eta_s = max(info.total_steps - info.step, 0) * info.seconds_per_step
    return info


def _number(value: Any) -> float | None:
    return finite(value)


# -- joining the scheduler ----------------------------------------------------------------------------------


Poll = Callable[[list[str], list[Path]], scheduler.SchedulerAnswer]


def collect(run_dirs: list[Path], poll: Poll = scheduler.poll) -> tuple[list[RunStatus], scheduler.SchedulerAnswer]:
    """Read every run folder, poll the scheduler once for all of them, and join the two (``poll``: a fake
    scheduler in tests)."""
    folders = [read_folder(path) for path in run_dirs]
    slurm_runs = [f for f in folders if _has_job_ids(f.executor)]
    if slurm_runs:
        answer = poll([i for f in slurm_runs for i in f.job_ids], [f.path for f in slurm_runs])
    else:
        answer = scheduler.SchedulerAnswer(False, ["no run here uses Slurm (executor local)"])
    return [build_status(folder, answer) for folder in folders], answer


def build_status(folder: RunFolder, answer: scheduler.SchedulerAnswer) -> RunStatus:
    """One run's row: its newest job's state and nodes, telemetry, attempts and the class of a failure."""
    notes = list(folder.notes)
    ids = list(folder.job_ids)
    if _has_job_ids(folder.executor):
        ids += [i for e in answer.queue if scheduler.queue_matches(e, folder.path) for i in [e.array_id or e.job_id]
                if i and i not in ids and _JOB_ID.fullmatch(i)]
    ids.sort(key=_id_key)
    job_id = ids[-1] if ids else (folder.attempts[-1].job_id if folder.attempts else "")
    state, nodes, reason, record = _state(folder, answer, job_id, notes)
    last = folder.attempts[-1] if folder.attempts else None
    info = telemetry(folder, since=last.started if last else None)
    if state not in ("RUNNING", "COMPLETING"):
        info.eta_s = None
    failure = None
    read: dict[Any, Any] = {}  # the newest attempt's evidence and class, worked out once for both uses
    if state in _ENDED_BADLY:
        restart = last.restart if last is not None and last.job_id == job_id else None
        read[(job_id or None, restart)] = evidence = collect_evidence(folder.path, job_id or None, restart)
        failure = read[(job_id or None, restart, record)] = classify(record, evidence)
        if failure.failure_class == "completed":
            failure = None
    failed = [a.attempt for a in folder.attempts if a.outcome in _FAILED_OUTCOMES][-_CLASSIFIED_ATTEMPTS:]
    views = [_attempt_view(folder, a, answer, a.attempt in failed, read) for a in folder.attempts]
    return RunStatus(str(folder.path), folder.name, folder.executor or "?", state, job_id, nodes, reason, info,
                     folder.checkpoint, views, failure, folder.excluded, ids, notes, read_findings(folder.path))


def _state(folder: RunFolder, answer: scheduler.SchedulerAnswer, job_id: str,
           notes: list[str]) -> tuple[str, str, str, scheduler.SlurmRecord | None]:
    """State, nodes and reason of the run's newest job: the queue first (live), then accounting, then the run
    folder (the local executor, or no Slurm here)."""
    if _has_job_ids(folder.executor) and answer.available and job_id:
        queued = answer.queued(job_id)
        record = answer.last_record(job_id)
        if queued is not None:
            return queued.state, _node_list(queued.state, queued.nodes), queued.reason, record
        if record is not None:
            return record.base_state, _node_list(record.base_state, record.nodes), record.reason, record
        notes.append(f"job {job_id} is neither queued nor in sacct (purged, or another cluster's)")
    last = folder.attempts[-1] if folder.attempts else None
    if last is None:
        return (folder.finished.upper() or ("NO JOB" if not job_id else "UNKNOWN")), "", "", None
    if last.outcome == "running" and executor_backend(folder.executor) is LocalBackend and not _alive(last):
        return "KILLED", last.host, "", None
    state = {"running": "RUNNING", "completed": "COMPLETED", "preempted": "STOPPED", "failed": "FAILED",
             "killed": "KILLED", "hang": "HUNG"}.get(last.outcome, last.outcome.upper())
    return state, last.host, last.note, None


def _node_list(state: str, nodes: str) -> str:
    """The nodes a job runs on: "pending" for a pending job, where Slurm says "None assigned" (sacct) or gives
    the reason in place of nodes (squeue); nothing for a job that ended before it had any."""
    if state.upper().startswith("PENDING"):
        return "pending"
    return "" if nodes.strip() in ("None assigned", "(null)") else nodes


def _alive(attempt: Attempt) -> bool:
    """Whether a local run's controller (its job id is that process's id, on this host) still runs."""
    import socket

    pid = small_int(attempt.job_id)  # a 400-digit "process id" overflowed os.kill's C int
    if attempt.host != socket.gethostname() or pid is None:
        return True  # cannot tell from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _attempt_view(folder: RunFolder, attempt: Attempt, answer: scheduler.SchedulerAnswer, explain: bool,
                  read: dict[Any, Any] | None = None) -> AttemptView:
    """One attempt; ``explain``: classify it (the newest failed attempts only: each reads the rank logs, unless
    ``read`` holds its evidence already)."""
    failure = None
    if "restarted in place" in attempt.note:  # the agent recorded why (Slurm's record is the whole allocation's)
        failure = {"class": attempt.outcome, "reason": attempt.note}
    elif explain:
        records = answer.history.get(attempt.job_id, [])
        record = records[attempt.restart] if attempt.restart < len(records) else None
        read = read or {}
        found = read.get((attempt.job_id, attempt.restart, record)) or classify(record, read.get(
            (attempt.job_id, attempt.restart)) or collect_evidence(folder.path, attempt.job_id, attempt.restart))
        failure = found.to_dict()
    return AttemptView(attempt.attempt, attempt.job_id, attempt.restart, attempt.started, attempt.ended,
                       attempt.outcome, attempt.start_step, attempt.end_step, attempt.note, failure,
                       attempt.in_place)


# -- output ------------------------------------------------------------------------------------------------


def to_json(statuses: list[RunStatus], answer: scheduler.SchedulerAnswer, now: float | None = None,
            indent: int | None = 2) -> str:
    """Everything of one poll; ``slurm.calls`` counts the scheduler calls it took (at most 2)."""
    return json.dumps({"time": time.time() if now is None else now,
                       "slurm": {"available": answer.available, "notes": answer.notes, "calls": answer.calls},
                       "runs": [s.to_dict() for s in statuses]}, indent=indent, default=str)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{hours}:{minutes:02d}:{secs:02d}"


def _ago(moment: float | None, now: float) -> str:
    if moment is None:
        return ""
    return f"{_duration(max(0.0, now - moment))} ago"


def _clock(moment: float | None) -> str:
    return "-" if moment is None else time.strftime("%m-%d %H:%M:%S", time.localtime(moment))


_STYLE = {"RUNNING": "bold green", "COMPLETED": "green", "PENDING": "yellow", "REQUEUED": "yellow",
          "COMPLETING": "green", "FAILED": "bold red", "NODE_FAIL": "bold red", "OUT_OF_MEMORY": "bold red",
          "TIMEOUT": "magenta", "PREEMPTED": "magenta", "CANCELLED": "red", "KILLED": "red", "STOPPED": "magenta",
          "HUNG": "bold red", "HANG": "bold red"}


def render(statuses: list[RunStatus], answer: scheduler.SchedulerAnswer, now: float | None = None,
           trend: bool = False) -> Any:
    """The rich renderable of one poll: a row per run (with ``trend``, as ``--watch`` draws it, the recent loss
    as a sparkline); for a single run also its attempts and failure."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text


    now = time.time() if now is None else now
    table = Table(title=f"hpc_train status at {_clock(now)}", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("run", "state", "job", "nodes", "step", "loss", *(("trend",) if trend else ()), "tok/s", "MFU",
                   "ETA", "checkpoint", "attempts", "health"):
        table.add_column(column, justify="right" if column in ("step", "loss", "tok/s", "MFU") else "left")
    for s in statuses:
        t = s.telemetry
        step = "-" if t.step is None else f"{t.step}/{t.total_steps}" if t.total_steps else str(t.step)
        ckpt = "-"
        if s.checkpoint is not None:
            where = s.checkpoint.step if s.checkpoint.step is not None else s.checkpoint.name
            ckpt = shown(f"step {where} ({_ago(s.checkpoint.time, now)})")
        failed = sum(1 for a in s.attempts if a.outcome in _FAILED_OUTCOMES)
        attempts = f"{len(s.attempts)}" + (f" ({failed} failed)" if failed else "")
        state = Text(s.state + (f" ({s.reason})" if s.reason and s.state == "PENDING" else ""),
                     style=_STYLE.get(s.state, ""))
        table.add_row(shown(s.name), state, shown(s.job_id or "-"), shown(s.nodes or "-"), step,
                      "-" if t.loss is None else f"{t.loss:.4f}", *((sparkline(t.losses),) if trend else ()),
                      "-" if t.tokens_per_s is None else f"{t.tokens_per_s:,.0f}",
                      f"{100 * t.mfu:.1f}%" if t.mfu else "n/a", _duration(t.eta_s), ckpt, attempts,
                      health_cell(s.health))
    parts: list[Any] = [table]
    for s in statuses:
        if s.failure is not None:
            parts.append(Text.assemble((f"{plain(s.name)}: ", "bold"), (s.failure.failure_class, "bold red"), "  ",
                                       plain(s.failure.reason)))
    if len(statuses) == 1:
        parts += _details(statuses[0], now)
    notes = [*answer.notes, *(n for s in statuses for n in s.notes)]
    parts += [Text(f"note: {plain(note)}", style="dim") for note in notes]
    return Group(*parts)


def _details(s: RunStatus, now: float) -> list[Any]:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(plain(f"run folder {s.run_dir}; executor {s.executor}; jobs "
                                   f"{', '.join(s.job_ids) or '-'}"), style="dim")]
    if s.attempts:
        table = Table(title="attempts", title_justify="left", box=box.SIMPLE_HEAD)
        for column in ("#", "job", "restart", "start", "end", "outcome", "steps", "why"):
            table.add_column(column)
        for a in s.attempts:
            end = a.end_step if a.end_step is not None else "..." if a.outcome == "running" else "?"
            steps = f"{a.start_step}->{end}"
            why = a.failure["reason"] if a.failure else a.note
            restart = f"{a.restart}.{a.in_place}" if a.in_place else str(a.restart)  # 0.1: restarted in place
            table.add_row(str(a.attempt), shown(a.job_id), restart, _clock(a.started), _clock(a.ended),
                          Text(a.outcome, style=_STYLE.get(a.outcome.upper(), "")), steps, shown(why))
        parts.append(table)
    if s.excluded:
        parts.append(Text(plain(f"excluded nodes: {', '.join(s.excluded)}")))
    parts += [Text(line, style="yellow") for line in health_lines(s.health)]
    t = s.telemetry
    if t.updated is not None:
        rate = f"; {t.seconds_per_step:.2f} s per step recently" if t.seconds_per_step else ""
        parts.append(Text(f"last metrics {_ago(t.updated, now)}{rate}", style="dim"))
    return parts
