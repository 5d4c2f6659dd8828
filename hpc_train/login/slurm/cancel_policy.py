"""Whether the follower on the login node may cancel a job one of whose ranks has failed: a pure decision.

The follower cancels so that ranks left waiting on a dead peer do not burn the allocation until a collective
times out. It must never cancel a job that is being requeued: a cancelled requeue ends ``CANCELLED`` and the run
is lost. A requeue shows in several places, and any one of them is enough to keep the job:

- Slurm's state: ``REQUEUED``, ``PENDING`` after a requeue, ``PREEMPTED``, a requeue hold;
- the attempt record: rank 0 recorded the attempt as stopped or hung (requeued or stopping by itself);
- the run folder: rank 0's stop notice for a program that did not ask ``should_stop()``, a rank that is still
  deciding a retry (the recovery claim without its error record), an error the retry policy requeued.

Ranks whose errors only say that a peer went away ("Connection closed by peer", an aborted communicator) are
waiting on the cause: a rank that has not written its error yet, or a node that died, which Slurm takes a while
to declare (``NODE_FAIL``) before it requeues the job. The follower gives such a job :data:`PEER_PATIENCE_S`.
Only a failure the retry policy does not retry, with none of the above, is cancelled; the reason is one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from hpc_train.run.attempts import Attempt, AttemptLog
from hpc_train.run.error_log import node_error_records
from hpc_train.run.files import finite, folder_names, parse_json, read_record_text, small_int, time_value
from hpc_train.run.in_place import read_notice as read_restart
from hpc_train.run.paths import LOGS_DIR, RANK_ERROR_GLOB, recovery_claim_path
from hpc_train.run.peer_errors import lost_its_peer
from hpc_train.run.stops import attempt_key, read_notice

__all__ = ["PEER_PATIENCE_S", "REQUEUING_STATES", "CancelDecision", "CancelFacts", "decide_cancel", "read_facts",
           "read_failures"]

REQUEUING_STATES = frozenset({"REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PREEMPTED", "PENDING", "SUSPENDED"})
STOPPING_OUTCOMES = ("preempted", "hang")  # rank 0 recorded a stop: the ranks leave by themselves
PEER_PATIENCE_S = 120.0  # Slurm's SlurmdTimeout is often 100-300 s; a rank that only lost its peers can wait


@dataclass(frozen=True)
class CancelFacts:
    """What the follower knows of one job when a rank has failed."""

    job_id: str
    state: str  # Slurm's (sacct) or the local executor's
    attempt: Attempt | None  # this job's newest attempt in attempts.jsonl
    failures: tuple[dict[str, Any], ...]  # rank-N.error.json records of this job, earliest first
    stop_phase: str | None = None  # rank 0's stop notice for this attempt: "stopping" or "done"
    deciding_rank: int | None = None  # a rank that claimed the retry decision and has not written its record
    waited_s: float = 0.0  # since the first failure was seen
    restarting: str | None = None  # the restart notice of this attempt (its agents start the ranks again)


@dataclass(frozen=True)
class CancelDecision:
    cancel: bool
    reason: str


def decide_cancel(facts: CancelFacts) -> CancelDecision:
    """Cancel only a job whose failure the retry policy does not retry and that nothing is requeuing."""
    keep = _being_requeued(facts)
    if keep:
        return CancelDecision(False, keep)
    if not facts.failures:
        return CancelDecision(False, "no rank reported a failure of its own")
    first = next((f for f in facts.failures if not lost_its_peer(str(f.get("error", "")))), facts.failures[0])
    return CancelDecision(True, f"rank {first.get('rank')} on {first.get('host') or '?'} failed with "
                                f"{str(first.get('error', ''))[:200]}, which the retry policy does not retry, and "
                                "the other ranks did not stop by themselves")


def _being_requeued(facts: CancelFacts) -> str:
    """Why the job must be kept, or "" when nothing is requeuing or stopping it."""
    if facts.state in REQUEUING_STATES:
        return f"job {facts.job_id} is {facts.state}: it is being requeued"
    attempt = facts.attempt
    if attempt is not None and attempt.outcome in STOPPING_OUTCOMES:
        how = "and requeued" if attempt.requeued else "and its ranks are leaving"
        return f"attempt {attempt.attempt} was recorded as {attempt.outcome} {how}"
    if facts.stop_phase is not None:
        return f"rank 0 is stopping the attempt for the signal ({facts.stop_phase})"
    if facts.restarting is not None:
        return f"the ranks are restarting in place ({facts.restarting})"
    if facts.deciding_rank is not None:
        return f"rank {facts.deciding_rank} is deciding whether the retry policy requeues its error"
    retried = [f for f in facts.failures if f.get("requeued") is True]
    if retried:
        return f"rank {retried[0].get('rank')}'s error was retried: the job is being requeued"
    mended = [f for f in facts.failures if f.get("restart_in_place") is True]
    if mended:
        return f"rank {mended[0].get('rank')}'s error is mended by an in-place restart of every rank"
    if facts.failures and facts.waited_s < PEER_PATIENCE_S and all(
            lost_its_peer(str(f.get("error", ""))) for f in facts.failures):
        ranks = ", ".join(str(f.get("rank")) for f in facts.failures)
        return (f"rank {ranks} only lost a peer: waiting up to {PEER_PATIENCE_S:.0f} s for the failing rank's own "
                "error or Slurm's node-failure requeue")
    return ""


def read_failures(run_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """Every error record (``rank-N.error.json``, and the nodes' ``errors-FIRST-LAST.jsonl``) written at or after
    ``since`` (an earlier submission's are history), earliest first. A rank's consequences of a stop are
    recorded apart and never count here. Listed and read never through a link (``logs/`` a link to another place
    holds none of this run's records)."""
    logs = Path(run_dir) / LOGS_DIR
    names = folder_names(logs)
    errors = node_error_records(logs, names)
    for name in sorted(n for n in names if fnmatchcase(n, RANK_ERROR_GLOB)):
        try:
            error = parse_json(read_record_text(logs / name))  # a number out of range: damage, skipped
        except ValueError:
            continue  # being written right now: next poll
        if isinstance(error, dict):
            errors.append(error)
    return failures_since(errors)(since)


def failures_since(records: Iterable[dict[str, Any]]) -> Callable[[float], list[dict[str, Any]]]:
    """The records whose ``time`` is at or after a moment, earliest first (then by rank): a record whose time or
    rank is no number in range (a string, 1e308, a list) sorts last, never as a comparison of a str with a float."""
    keyed = [(time_value(record.get("time", 0.0)), record) for record in records]

    def since(moment: float) -> list[dict[str, Any]]:
        errors = [(when, record) for when, record in keyed if when is not None and when >= moment]
        # The first rank to fail is the cause; the others usually fail because it went away.
        return [record for _, record in sorted(errors, key=lambda item: (item[0], _rank_key(item[1])))]
    return since


def _rank_key(record: dict[str, Any]) -> float:
    rank = finite(record.get("rank", 0))
    return rank if rank is not None else float("inf")


def read_facts(run_dir: Path, job_id: str, state: str, since: float = 0.0, waited_s: float = 0.0,
               failures: Sequence[dict[str, Any]] | None = None) -> CancelFacts:
    """The facts :func:`decide_cancel` takes, from the run folder (attempts, stop notice, recovery claim) as
    this submission (made at ``since``) left it: a run folder is followed by one job at a time, and an array
    task's attempts carry Slurm's own job id, not the task's. ``failures``: the error records since ``since``
    as the caller read them already (the follower keeps them between polls), else they are read here."""
    attempts = [a for a in AttemptLog(run_dir).read() if a.started >= since - 1]
    attempt = attempts[-1] if attempts else None
    failures = tuple(read_failures(run_dir, since) if failures is None else failures)
    stop_phase = deciding = restarting = None
    if attempt is not None:
        failures = tuple(f for f in failures if f.get("in_place", 0) >= attempt.in_place)  # earlier lives': history
        restart = read_restart(run_dir, attempt_key(attempt.job_id, attempt.restart), attempt.in_place + 1, 0.0)
        restarting = f"{restart.failure_class}: {restart.reason}" if restart is not None else None
        key = attempt_key(attempt.job_id, attempt.restart, attempt.in_place)
        notice = read_notice(run_dir, key, attempt.started)
        stop_phase = notice.phase if notice is not None else None
        deciding = _claimant(run_dir, key)
        if deciding is not None and any(f.get("rank") == deciding for f in failures):
            deciding = None  # it has decided: its record says whether it requeued
    return CancelFacts(job_id, state, attempt, failures, stop_phase, deciding, waited_s, restarting)


def _claimant(run_dir: Path, key: str) -> int | None:
    return small_int(read_record_text(recovery_claim_path(run_dir, key)).strip())
