"""Looking back as a requeued attempt starts: why did the job's previous attempt end, and what follows from it.

A node that dies takes its ranks with it, so nothing of the job is left to decide anything at that moment:
Slurm requeues the job by itself (``--requeue``, ``JobRequeue=1``). The next attempt's rank 0 therefore asks
before it trains: sacct for the previous attempt, slurmdbd's node events for the node that went down, the run
folder for what the ranks said. A node failure or an infrastructure fault puts the node on the run's exclusion
list (``excluded_nodes.json``) and on the job (``ExcNodeList``, so later requeues avoid it too); if this attempt
landed on an excluded node again, it requeues at once; past ``[retry]``'s limit it stops with the reason.

Ranks that raise an infrastructure error (an NCCL system error, a GPU fault) are alive and decide for
themselves: :func:`requeue_after_error`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

from hpc_train.backends import SlurmBackend
from hpc_train.backends.scheduler import SlurmRecord, parse_sacct, sacct_argv
from hpc_train.common.hostlist import expand
from hpc_train.failures.classify import Classification, classify, is_hardware_fault
from hpc_train.failures.evidence import Evidence, RankReport, collect_evidence
from hpc_train.failures.policy import RetryPolicy, decide
from hpc_train.run.attempts import AttemptLog
from hpc_train.run.exclusions import add_exclusions, exclude_expression, read_exclusions
from hpc_train.run.jobid import scontrol_job_id
from hpc_train.run.paths import HEARTBEAT_DIR, recovery_claim_path
from hpc_train.run.peer_errors import lost_its_peer
from hpc_train.run.stops import attempt_key

__all__ = ["RETRIED_CLASSES", "Recovery", "down_nodes", "look_back", "requeue_after_error"]

RETRIED_CLASSES = ("node_failure", "infrastructure")  # hangs requeue from the watchdog; preemption on its own
DOWN_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "NO_RESPOND")
Runner = Callable[..., "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Recovery:
    """What this attempt does: ``continue`` training, ``requeue`` (landed on an excluded node) or ``stop``."""

    action: str
    message: str = ""
    failure_class: str = ""


def _run(run: Runner, argv: list[str]) -> str | None:
    """stdout of a Slurm command, or None when it is missing, fails or does not answer: looking back must never
    keep an attempt from training."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        result = run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def _shift(stamp: str, seconds: int) -> str:
    try:
        return (datetime.fromisoformat(stamp) + timedelta(seconds=seconds)).isoformat(timespec="seconds")
    except ValueError:
        return stamp


def down_nodes(record: SlurmRecord, run: Runner = subprocess.run) -> list[str]:
    """The previous attempt's nodes that went DOWN (or drained, failed, stopped responding) while it ran: from
    slurmdbd's node events (a node back in service by now still shows there), then from sinfo now."""
    nodes = expand(record.nodes) if record.nodes and record.nodes != "None assigned" else []
    if not nodes:
        return []
    found: set[str] = set()
    if record.start and record.end:
        text = _run(run, ["sacctmgr", "--noheader", "--parsable2", "show", "event", f"Nodes={','.join(nodes)}",
                          f"Start={_shift(record.start, -60)}", f"End={_shift(record.end, 120)}",
                          "format=NodeName,State"]) or ""
        for line in text.splitlines():
            name, _, state = line.partition("|")
            if name in nodes and any(word in state.upper() for word in DOWN_STATES):
                found.add(name)
    text = _run(run, ["sinfo", "--noheader", "--Node", "--nodes", ",".join(nodes), "--format=%N|%T"]) or ""
    for line in text.splitlines():
        name, _, state = line.partition("|")
        if name in nodes and any(word in state.upper() for word in DOWN_STATES):
            found.add(name)
    return sorted(found)


def _previous_record(job_id: str, run: Runner) -> SlurmRecord | None:
    """sacct's record of the attempt before this one (sacct lists a requeued job once per attempt)."""
    history = parse_sacct(_run(run, sacct_argv([job_id])) or "").get(job_id, [])
    return history[-2] if len(history) >= 2 else None


def _earlier_failures(run_dir: Path) -> list[str]:
    return [a.outcome for a in AttemptLog(run_dir).read() if a.outcome in ("node_failure", "infrastructure", "hang")]


def _exclude_on_job(job_id: str, expression: str, run: Runner, attempts: int = 10) -> bool:
    """Put the exclusion on the job itself so that Slurm's own requeues avoid the nodes. Slurm takes it only
    while the job is pending, so this follows a requeue and retries while the job leaves the running state."""
    for _ in range(attempts):
        result = _run(run, ["scontrol", "update", f"JobId={scontrol_job_id(os.environ, job_id)}",
                                  f"ExcNodeList={expression}"])
        if result is not None:
            return True
        time.sleep(0.5)
    return False


def _next_attempt(run_dir: Path, job_id: str, run: Runner) -> tuple[bool, str]:
    """Ask Slurm for the next attempt through the job's backend (:class:`hpc_train.backends.SlurmBackend`):
    ``scontrol requeue``, or where requeue is forbidden the next job of the chain (its ``--exclude`` the run's
    excluded nodes). (whether it was done, what was done or why not)."""
    backend = SlurmBackend(os.environ, job_id)
    done = backend.requeue(backend.next_attempt(), run_dir, run)
    return done.action != "none", "requeued" if done.action == "scontrol" else done.reason


def _requeue_avoiding(run_dir: Path, job_id: str, allocation: list[str], log: Callable[[str], None],
                      run: Runner) -> Recovery | None:
    """When this attempt runs on a node the run excludes: requeue with the exclusion on the job (or, where
    requeue is forbidden, submit the next job with it as ``--exclude``)."""
    excluded = read_exclusions(run_dir)
    bad = sorted(set(allocation) & {e.node for e in excluded})
    if not bad:
        return None
    done, said = _next_attempt(run_dir, job_id, run)
    if not done:
        return Recovery("stop", f"this attempt runs on excluded node(s) {', '.join(bad)} and {said}")
    if SlurmBackend(os.environ).chained:
        log(f"recovery: this attempt landed on excluded node(s) {', '.join(bad)}: {said}")
        return Recovery("requeue", f"landed on excluded node(s) {', '.join(bad)}: {said}")
    expression = exclude_expression(excluded)
    placed = _exclude_on_job(job_id, expression, run)
    log(f"recovery: this attempt landed on excluded node(s) {', '.join(bad)}: requeued "
        + (f"with ExcNodeList={expression}" if placed else "(Slurm did not take ExcNodeList; it may land there "
                                                           "again, and will requeue again)"))
    return Recovery("requeue", f"landed on excluded node(s) {', '.join(bad)}: requeued")


def _apply(run_dir: Path, job_id: str, classification: Classification, policy: RetryPolicy,
           allocation: list[str], log: Callable[[str], None], run: Runner) -> Recovery:
    """The policy's decision for ``classification``, carried out: exclusion list, then a requeue if this attempt
    runs on an excluded node."""
    excluded = read_exclusions(run_dir)
    decision = decide(classification, _earlier_failures(run_dir), policy, excluded=[e.node for e in excluded])
    kind = classification.failure_class
    if not decision.retry:
        return Recovery("stop", decision.message, kind)
    if decision.exclude_nodes:
        add_exclusions(run_dir, decision.exclude_nodes, kind, job_id, classification.reason)
    log(f"recovery: {decision.message}")
    moved = _requeue_avoiding(run_dir, job_id, allocation, log, run)
    return replace(moved, failure_class=kind) if moved else Recovery("continue", decision.message, kind)


def look_back(run_dir: Path, job_id: str, restart: int, policy: RetryPolicy, allocation: list[str],
              log: Callable[[str], None], run: Runner = subprocess.run,
              failed_ranks: Collection[int] | None = None) -> Recovery:
    """Rank 0, before training, in an attempt with ``restart`` > 0: classify the job's previous attempt and act.

    Only node failures and infrastructure faults are decided here: a hang was decided by the watchdog, and a
    preemption or time limit by the preemption path, before their attempts ended. ``failed_ranks``: the ranks
    that left an error record (:func:`hpc_train.run.error_records.ranks_with_records`, listed before this
    attempt's ranks could clear theirs); only theirs, and those srun named, are read. None: every rank's."""
    if not job_id:
        return Recovery("continue")
    if restart <= 0:  # a new submission already got the exclusions as --exclude (plan); a requeue may not have
        return _requeue_avoiding(run_dir, job_id, allocation, log, run) or Recovery("continue")
    record = _previous_record(job_id, run)
    attempts = AttemptLog(run_dir)
    # The attempt this job's previous run opened; none when a node died before rank 0 could write it.
    previous = [a for a in attempts.read() if a.job_id == job_id and a.restart == restart - 1][-1:] or [None]
    if record is None or (previous[0] is not None and previous[0].outcome in ("hang", "completed")):
        return _requeue_avoiding(run_dir, job_id, allocation, log, run) or Recovery("continue")
    # O(failed ranks): the ranks of this attempt leave their records of the last one for rank 0 to clear.
    evidence = collect_evidence(run_dir, job_id, restart - 1, ranks=failed_ranks)
    classification = classify(record, evidence, down_nodes(record, run))
    if classification.failure_class == "infrastructure" and not _hardware_fault(evidence):
        classification = replace(classification, nodes=())  # a network error shows on both ends: no node is bad
    if classification.failure_class not in RETRIED_CLASSES:
        moved = _requeue_avoiding(run_dir, job_id, allocation, log, run)
        return moved or Recovery("continue", classification.reason, classification.failure_class)
    recovery = _apply(run_dir, job_id, classification, policy, allocation, log, run)
    if previous[0] is not None:  # the attempt Slurm ended says why, for status and for the retry count
        attempts.finish(previous[0], outcome=classification.failure_class,
                        note=f"{classification.reason}; {recovery.message}"[:500])
    return recovery


def _hardware_fault(evidence: Evidence) -> bool:
    """:func:`is_hardware_fault` of every rank's error and traceback, each distinct line once: its words never span
    a line, and 16,384 ranks' tracebacks share most of theirs (the joined text was 32 MB to search)."""
    lines = {line for r in evidence.ranks for text in (r.error, r.traceback) for line in text.splitlines()}
    return any(is_hardware_fault(line) for line in lines)


def mended_in_place(rank: int, host: str, error: str, traceback: str) -> bool:
    """Whether starting every rank again inside the job mends this rank's error: a network fault that is not
    this node's own hardware, or a peer that went away (its own cause is restarted or decided by its agent)."""
    if lost_its_peer(f"{error}\n{traceback}"):
        return True
    classification = classify(None, Evidence(ranks=(RankReport(rank=rank, host=host, error=error,
                                                                traceback=traceback),)))
    return classification.failure_class == "infrastructure" and not is_hardware_fault(f"{error}\n{traceback}")


def _claim(run_dir: Path, job_id: str, restart: int, rank: int, in_place: int = 0) -> bool:
    """One decider per attempt: the first rank to fail. The others' errors are mostly what they saw of its
    failure, and a dozen ranks requeueing and excluding at once would race on the list and on the job. The claim
    names the rank, so that the follower waits for its decision before it cancels anything."""
    (run_dir / HEARTBEAT_DIR).mkdir(mode=0o700, exist_ok=True)
    try:
        descriptor = os.open(recovery_claim_path(run_dir, attempt_key(job_id, restart, in_place)),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w", encoding="utf-8") as claim:
        claim.write(f"{rank}\n")
    return True


def requeue_after_error(run_dir: Path, job_id: str, restart: int, rank: int, host: str, error: str,
                        traceback: str, policy: RetryPolicy, log: Callable[[str], None],
                        run: Runner = subprocess.run, in_place: int = 0) -> Recovery:
    """A rank that raised: when its error is an infrastructure fault (not the program's), requeue the job within
    ``[retry] infrastructure``, excluding this node when the fault is its own GPU's; anything else fails.

    Only the first failing rank of an attempt decides. A network error (an NCCL system error, an InfiniBand
    completion error) shows on both ends of the link, so it requeues without excluding a node: the next attempt
    may land elsewhere, and a node that keeps failing shows up in ``status``."""
    if not job_id:
        return Recovery("continue")
    report = RankReport(rank=rank, host=host, error=error, traceback=traceback)
    classification = classify(None, Evidence(ranks=(report,)))
    if classification.failure_class != "infrastructure" or not _claim(run_dir, job_id, restart, rank, in_place):
        return Recovery("continue", classification.reason, classification.failure_class)
    own = is_hardware_fault(f"{error}\n{traceback}")
    classification = replace(classification, nodes=(host,) if own else ())
    recovery = _apply(run_dir, job_id, classification, policy, [host] if own else [], log, run)
    if recovery.action == "continue":  # retried without moving off this node: requeue all the same
        done, said = _next_attempt(run_dir, job_id, run)
        if not done:
            return Recovery("stop", f"{recovery.message}; {said}", "infrastructure")
        chained = SlurmBackend(os.environ).chained
        recovery = Recovery("requeue", recovery.message + (f"; {said}" if chained else ""), "infrastructure")
    return recovery
